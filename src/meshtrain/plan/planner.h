// One candidate layout of a training job on a cluster: memory per rank by
// category on the most loaded pipeline stage, step time by component, and
// what the whole run costs. Pure arithmetic; formulas in docs/plan.md.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "meshtrain/model/config.h"
#include "meshtrain/plan/compute.h"
#include "meshtrain/plan/failures.h"
#include "meshtrain/plan/finetune.h"
#include "meshtrain/plan/hardware.h"
#include "meshtrain/plan/memory.h"
#include "meshtrain/plan/transformer.h"

namespace meshtrain::plan {

struct Job {
  int64_t seq = 2048;
  int64_t global_batch = 0;  // sequences per optimizer step
  double tokens = 0;         // tokens to train on
  Precision precision = Precision::bf16;
  Optimizer optimizer = Optimizer::adamw;
  bool dropout = false;
  // Overrides the GPU's calibrated gemm_efficiency (hardware.h) when > 0.
  double compute_efficiency = 0;
  double fragmentation = 0.10;          // allowance, fraction of the tracked bytes
  double reserve_bytes = 1024.0 * 1024 * 1024;  // CUDA context, cuBLAS and NCCL workspaces
  double bucket_bytes = 25.0 * 1024 * 1024;     // DDP gradient bucket (two in flight)
  double cpu_adam_params_per_second = 1e9;      // per GPU, optimizer offload
  // 0 = no checkpoints, < 0 = Daly's optimum for the failure rate (failures.h).
  double checkpoint_interval_seconds = 3600;
  double checkpoint_write_bandwidth = 100e9;    // aggregate bytes/s to storage
  FailureModel failures;
  Finetune finetune;  // method none = pre-training
  Attention attention = Attention::flash;
  // --fp8: the blocks' linear GEMMs in FP8 (ComputeShape::fp8), bf16 otherwise.
  bool fp8 = false;
  int64_t mtp = 0;  // --mtp: multi-token-prediction modules (ComputeShape::mtp)
  // SMs the DualPipe schedule gives the expert all-to-alls it overlaps with
  // compute (DeepSeek-V3 section 3.2.2: 20 of the H800's 132).
  int64_t comm_sms = 20;
  bool balance_pipeline = true;  // layers per stage by cost (pipeline_split.h), else uniform
  std::vector<int64_t> pipeline_split;  // given layers per stage (overrides both when set)
  void validate() const;
  int64_t tokens_per_step() const { return global_batch * seq; }
};

struct Layout {
  int64_t tp = 1, pp = 1, vpp = 1, dp = 1, micro_batch = 1;
  int64_t cp = 1;  // context parallelism: the sequence split over cp ranks (ranks: tp, cp, dp, pp)
  // Expert parallelism (MoE models): the routed experts split over ep of the
  // dp ranks (ep divides dp and the experts); their state is sharded over the
  // expert-data-parallel group of dp / ep ranks; tokens move by all-to-alls.
  int64_t ep = 1;
  // Megatron-Core's MoE parallel folding (Liu et al. 2025, arXiv 2504.14960),
  // with expert TP 1: the ep group is ep consecutive GPUs of the tp x cp x dp
  // ranks, so it spans ep GPUs rather than ep x tp x cp, and the expert state
  // is sharded over tp x cp x dp / ep ranks. The engine draws ep from dp
  // (docs/moe.md); the search never folds unless told (--ep-fold), like
  // DualPipe it describes another framework's runs.
  bool ep_fold = false;
  // GPUs one ep group spans, and the ranks that hold the same experts (the
  // expert-data-parallel group).
  int64_t ep_span() const { return ep_fold ? ep : ep * tp * cp; }
  int64_t expert_dp() const { return ep_fold ? tp * cp * dp / ep : dp / ep; }
  int zero = 0;
  // ZeRO-3 only: shard over groups of this many DP ranks and replicate across
  // the groups (HSDP / hybrid sharding); 0 = over the whole DP group.
  int64_t shard = 0;
  // Ranks that share (and ZeRO-shard) the model states: the DP group times cp.
  int64_t shards() const { return (shard > 0 ? shard : dp) * cp; }
  int64_t grad_ranks() const { return dp * cp; }
  Recompute recompute = Recompute::selective;
  bool sequence_parallel = false;
  Offload offload = Offload::none;
  Schedule schedule = Schedule::one_f_one_b;
};

// Per-model numbers computed once (the registry walk is slow for 405B).
struct PlanContext {
  ModelConfig model;
  ModelConfig active;  // active_dense_view(model): what per-op compute and activations read
  TransformerCounts counts;
  double layer_flops_per_token = 0;   // training, model FLOPs
  double output_flops_per_token = 0;
  double model_flops_per_token = 0;   // == ModelConfig::train_flops_per_token(seq)
};
PlanContext make_context(const ModelConfig& model, const Job& job);

struct StepTime {
  double compute = 0;    // model FLOPs at the efficiency factor
  double recompute = 0;  // the extra forward work of activation recomputation
  double bubble = 0;     // pipeline fill and drain
  double tp = 0, cp = 0, dp = 0, pp = 0, ep = 0;  // exposed communication
  double optimizer = 0;  // the optimizer step: memory-bound, at HBM bandwidth
  double offload = 0;    // host transfers and CPU optimizer step
  double checkpoint = 0; // a blocking checkpoint write, amortised over its interval
  double total() const {
    return compute + recompute + bubble + tp + cp + dp + pp + ep + optimizer + offload +
           checkpoint;
  }
};

struct Estimate {
  Layout layout;
  int64_t gpus = 0;
  int64_t microbatches = 0;        // per optimizer step, per pipeline
  int64_t layers_per_stage = 0;    // on the stage with the most layers
  int64_t memory_stage_layers = 0; // on the stage `memory` describes
  std::vector<int64_t> split;      // layers per virtual chunk (pipeline_split.h)
  std::vector<double> stage_seconds;  // one micro-batch's compute on each stage
  MemoryBreakdown memory;          // the stage that needs the most
  std::string memory_stage;        // "first", "last" or "only"
  double params_per_rank = 0;      // before ZeRO sharding (the most loaded stage / tp)
  double hbm_fraction = 0;         // memory.device_total() / HBM
  bool fits = false;
  StepTime time;
  // All-ranks totals for one step (time.dp is what is exposed, these are the raw).
  double dp_comm_raw = 0, dp_overlap_window = 0;
  double cp_comm_raw = 0;
  double ep_bytes_per_step = 0;  // one rank's all-to-all bytes per step (MoE, ep > 1)
  double ep_comm_raw = 0;        // their time; time.ep is what is exposed
  double model_flops_per_step = 0, hardware_flops_per_step = 0;
  double step_seconds = 0, tokens_per_second = 0, mfu = 0;
  double checkpoint_bytes = 0, checkpoint_seconds = 0;  // one save
  double steps = 0, train_seconds = 0, gpu_hours = 0, cost = 0;  // failure-free
  Goodput goodput;  // with failures: wall_seconds, the run's real length
  double wall_gpu_hours = 0, wall_cost = 0;
  double trainable_params = 0;  // fine-tuning: adapters (or all, full)
  std::string bottleneck;  // "compute", or the largest overhead: "bubble", "TP comm", ...
  double bottleneck_share = 0;
};

// "" when the layout can run on this cluster and job, else why not (one line).
std::string check_layout(const PlanContext& ctx, const Cluster& cluster, const Job& job,
                         const Layout& layout);
// Requires check_layout(...) == "".
Estimate evaluate(const PlanContext& ctx, const Cluster& cluster, const Job& job,
                  const Layout& layout);

// The cluster's GPU with the job's --efficiency override applied.
GpuSpec effective_gpu(const Cluster& cluster, const Job& job);
// What compute of `layout` gets of it: under DualPipe with expert
// parallelism, the peaks of the SMs left beside the job's comm_sms.
GpuSpec layout_gpu(const Cluster& cluster, const Job& job, const Layout& layout);
// One micro-batch of `layout` as the compute model sees it.
ComputeShape compute_shape(const Job& job, const Layout& layout);
// One micro-batch through one layer as the activation-memory model sees it.
ActivationShape activation_shape(const PlanContext& ctx, const Job& job, const Layout& layout);

// The compute efficiency at which `layout` takes `measured_step_seconds` per
// step (bisection; the step time falls as the efficiency rises). Throws Error
// when even efficiency 1 is slower than the measurement.
double calibrate_efficiency(const PlanContext& ctx, const Cluster& cluster, Job job,
                            const Layout& layout, double measured_step_seconds);

// "tp 8 pp 4 v 2 dp 32 zero 1 mb 1 selective sp"
std::string describe(const Layout& layout);
// "1", "3", or "3/8" for ZeRO-3 sharded in groups of 8.
std::string zero_label(const Layout& layout);

}  // namespace meshtrain::plan
