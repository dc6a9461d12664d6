// The training run's configuration: a TOML file with sections [model],
// [train], [optim] and [data], plus command-line overrides `--section.key
// value`. Every key is documented in docs/config.md. Unknown keys, wrong types
// and invalid values are rejected with a message naming the key.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "meshtrain/model/config.h"
#include "meshtrain/optim/adamw.h"
#include "meshtrain/optim/schedule.h"
#include "meshtrain/train/preference.h"

namespace meshtrain {

// fp16's dynamic loss scale (train/update_gate.h LossScaler): train.loss_scale_*.
struct LossScaleSettings {
  double init = 65536.0;           // 2^16
  int64_t growth_interval = 2000;  // applied steps without overflow before the scale doubles
  double min = 1.0;                // the scale never backs off below this
  static constexpr double kGrowth = 2.0, kBackoff = 0.5;
};

struct TrainSettings {
  Precision precision = Precision::fp32;
  LossScaleSettings loss_scale;  // fp16 only
  uint64_t seed = 1337;
  int64_t steps = 100;
  int64_t batch_size = 8;        // sequences per optimizer step (the global batch)
  int64_t batch_tokens = 0;      // the global batch in tokens instead (0 = use batch_size)
  int64_t micro_batch_size = 0;  // sequences per forward/backward; 0 = batch_size
  int64_t seq_len = 256;
  std::string device = "cpu";    // the backend that runs the model (backend/registry.h)
  int threads = 0;               // 0 = the cores available to the process
  float grad_clip = 1.0f;        // 0 = no clipping
  int64_t eval_interval = 100;   // steps; 0 = never (except never at all without data.val)
  int64_t eval_batches = 4;      // global batches per validation (each G rows over the dp ranks)
  int64_t log_interval = 1;
  double peak_flops = 0;         // MFU denominator; 0 = measure at start
  int64_t checkpoint_interval = 0;  // steps; 0 = only at the end, -1 = never
  std::string out_dir = "runs/default";
  // Activation checkpointing (model.h RecomputePolicy): "none" | "selective" |
  // "full"; recompute_layers (full only): recompute the first N layers of each
  // pipeline chunk, 0 = all.
  Recompute recompute = Recompute::none;
  int64_t recompute_layers = 0;
  // Straggler detection (train/stragglers.h): every straggler_interval steps
  // (0 = off) the ranks' step breakdowns are gathered; a rank whose own work
  // exceeds the median rank's by more than straggler_threshold (0.2 = 20%) is named.
  int64_t straggler_interval = 0;
  double straggler_threshold = 0.2;
  // Before allocating, each rank's predicted peak (train/memory_plan.h) against
  // what its host allows: "error" refuses, "warn" prints and trains, "off" skips.
  std::string memory_check = "error";
  // Timeline trace of steps "A-B" or "N" (docs/trace.md); "" = off.
  std::string trace_steps;
  // Start from the weights of this directory (a Hugging Face one, a training
  // checkpoint of any layout; train/checkpoint.h init_model_config) with a
  // fresh optimizer at step 0; the model comes from it. "" = random init.
  std::string init_from;

  int64_t grad_accum_steps() const { return batch_size / micro_batch_size; }
  int64_t tokens_per_step() const { return batch_size * seq_len; }
};

struct OptimSettings {
  float lr = 3e-4f;
  float min_lr = 3e-5f;
  int64_t warmup_steps = 0;
  LrDecay decay = LrDecay::cosine;
  AdamWConfig adamw;
};

struct DataSettings {
  std::vector<std::string> train;  // as written (files or globs)
  std::vector<std::string> val;    // the same; empty = no validation
  std::string tokenizer = "gpt2";  // what the token ids mean: "gpt2" or "bytes"
  std::string gpt2_ranks = "data/gpt2.tiktoken";  // the GPT-2 ranks file (tokenizer "gpt2")
  // "tokens": llm.c token shards; "sft-jsonl": prompt/response or chat records in
  // meshtrain's own format; "chat-jsonl": chat records rendered by the
  // tokenizer folder's chat template (data/sft.h).
  std::string format = "tokens";
  bool sft_pack = true;                  // several records per row, attention kept within each
  std::string sft_overflow = "truncate";  // a record longer than seq_len: "truncate" | "refuse"
  bool sft() const { return format == "sft-jsonl" || format == "chat-jsonl"; }
  // "preference-jsonl": {prompt, chosen, rejected} records (data/preference.h)
  // for preference optimisation ([dpo]).
  bool preference() const { return format == "preference-jsonl"; }
  bool records() const { return sft() || preference(); }  // JSONL records, not token shards
};

// [dpo]: preference optimisation of data.format = "preference-jsonl" rows
// (train/preference.h; docs/finetune.md#dpo).
struct PreferenceSettings {
  DpoSettings loss;  // dpo.beta, dpo.loss ("sigmoid" | "ipo"), dpo.label_smoothing
  // The reference policy's log-probabilities: computed in one forward pass
  // over the training data before the first step and stored with the run
  // (true), or in every step by the model with its LoRA adapters switched off
  // (false). Default: false with LoRA, true without (full fine-tuning keeps
  // no frozen copy of the model).
  bool precompute_reference = false;
};

// [parallel]: the device mesh (dp = world size / (tp * pp)) and data-parallel
// gradient synchronisation; see docs/distributed.md.
struct ParallelSettings {
  int tp = 1;             // tensor-parallel size (heads, kv heads, hidden_dim must divide)
  bool sequence_parallel = false;  // tp > 1: norms and residual stream sharded along the rows
  int pp = 1;             // pipeline-parallel size
  // Expert-parallel size (MoE models): each MoE layer's experts split over
  // ep of the dp ranks (ep divides dp and moe.experts; docs/moe.md).
  int ep = 1;
  // Context-parallel size (docs/distributed.md#context-parallelism-parallelcp):
  // each sequence cut into 2 x cp chunks, rank r of the cp group holding
  // chunks r and 2cp - 1 - r; train.seq_len must divide by 2 x cp. cp_comm:
  // how attention sees the other chunks ("allgather": K and V all-gathered,
  // dK and dV reduce-scattered).
  int cp = 1;
  std::string cp_comm = "allgather";
  // Pipeline (docs/distributed.md): the schedule ("gpipe", "1f1b",
  // "interleaved"), chunks per rank for interleaved, and the layers per
  // (virtual) stage: "auto" balances the stages' FLOPs (the last also runs the
  // output layer and loss), "" or "uniform" balances layer counts, "3,2,..."
  // is explicit.
  std::string schedule = "1f1b";
  int virtual_stages = 1;
  std::string pp_split = "auto";
  double bucket_mb = 25;  // gradient bucket size in MiB
  bool overlap = true;    // all-reduce buckets while backward runs
  // ZeRO (docs/distributed.md): 0 = plain DDP; 1 shards optimizer state,
  // 2 + gradients, 3 + parameters.
  int zero = 0;
  bool prefetch = true;               // stage 3: all-gather the next unit ahead
  bool reshard_after_forward = true;  // stage 3: free a unit after its forward
  int64_t max_inflight_reduces = 2;   // stages 1-3: gradient reduce-scatters in flight at most
  std::string offload = "none";       // optimizer state: "none" | "cpu" | "disk"
  std::string offload_dir;            // disk: where; empty = <train.out_dir>/offload
  double offload_budget_mb = 0;       // cpu/disk: resident MiB of optimizer state (0 = no limit)
};

// [ckpt]: distributed checkpoints (docs/distributed.md#distributed-checkpoints-ckptdistributedh).
struct CkptSettings {
  double buffer_mb = 64;  // staging buffer per rank for synchronous writes and loads
  bool async = false;     // copy the state at the step boundary, write it in the background
  int64_t keep_last = 0;  // committed checkpoints kept (0 = all)
};

// [guard]: the stability guard (train/update_gate.h StabilityGuard;
// docs/distributed.md#stability-guard).
enum class GuardPolicy { skip, rollback };

struct GuardSettings {
  bool enabled = true;         // non-finite loss / gradient norm => skip (fp32, bf16)
  int64_t max_skips = 5;       // consecutive guard skips => roll back
  int64_t window = 100;        // applied steps in the spike statistics
  int64_t min_steps = 20;      // applied steps in the window before spikes are judged
  double loss_z = 0;           // z-score above the window's mean that is a loss spike (0 = off)
  double grad_z = 0;           // the same for the gradient norm (0 = off)
  GuardPolicy policy = GuardPolicy::skip;  // what a spike does
  int64_t rollback_skip_batches = 0;  // batches skipped beyond the one that caused a rollback
  int64_t max_rollbacks = 3;   // rollbacks in one process before the run ends as diverged
};

// [comm]: deadlines of communication calls and the flight recorder
// (docs/distributed.md#hangs-watchdog-and-flight-recorder).
struct CommSettings {
  // Seconds after a call's start; 0 = none. timeout_s: calls inside training
  // steps (from a process's second step); long_timeout_s: every other call
  // (start-up, first step, evaluation, checkpoints).
  double timeout_s = 300;
  double long_timeout_s = 3600;
  int64_t flight_records = 1024;  // completed calls kept per rank; 0 = no recorder and no watchdog
  // How device tensors move between the ranks of a train.device = "cuda" run
  // (comm/nccl/device_world.h): "auto", "nccl", or "mpi" (host staging). Host
  // data always moves through MPI; a "cpu" run moves everything through MPI.
  std::string backend = "auto";
};

struct TrainConfig {
  std::string model_preset;  // empty when every model field is explicit
  // [model] keys the file (or an override) set: train.init_from checks them
  // against the directory's model. Not saved.
  std::vector<std::string> model_keys;
  ModelConfig model;
  TrainSettings train;
  OptimSettings optim;
  DataSettings data;
  ParallelSettings parallel;
  CkptSettings ckpt;
  GuardSettings guard;
  CommSettings comm;
  PreferenceSettings dpo;

  LrSchedule lr_schedule() const;
};

// parallel.pp_split as layers per (virtual) stage, in model order (chunk j on
// stage j % pp): "auto" from the planner's FLOP costs of the embedding, a block
// and the head + loss (plan/pipeline_split.h); {} for "" / "uniform" (the
// executor splits by count), for pp = 1, and when the model has fewer layers
// than stages (the executor names that); an explicit list as given. Throws
// Error naming the key on a malformed list.
std::vector<int64_t> pp_split_layers(const TrainConfig& config);

// "section.key" -> "value" as given on the command line.
using ConfigOverrides = std::vector<std::pair<std::string, std::string>>;

// Parses TOML text (`source_name` names it in errors), applies the overrides
// (each value parsed per its key's type) and validates. Throws Error
// ("config: unknown key 'train.stepz'").
TrainConfig parse_config(const std::string& toml_text, const std::string& source_name,
                         const ConfigOverrides& overrides = {});
TrainConfig load_config(const std::string& path, const ConfigOverrides& overrides = {});

// The resolved configuration as TOML text that parse_config accepts (every
// key explicit, no preset needed) — saved with checkpoints.
std::string config_to_toml(const TrainConfig& config);
// The same as a JSON object text, and back (checkpoints' train_state.json).
std::string config_to_json(const TrainConfig& config);
TrainConfig config_from_json(const std::string& json_text);

// Every accepted key as "section.key" (docs/config.md must document each).
std::vector<std::string> config_keys();

// data.train / data.val expanded: globs matched (sorted), lists flattened.
// Throws Error naming the key and pattern when nothing matches.
std::vector<std::string> expand_train_files(const DataSettings& data);
std::vector<std::string> expand_val_files(const DataSettings& data);

}  // namespace meshtrain
