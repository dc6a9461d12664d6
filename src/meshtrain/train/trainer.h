// The single-rank training loop: gradient accumulation over micro-batches,
// global-norm clipping, AdamW with the LR schedule, periodic validation,
// console and JSONL metrics, checkpoints that resume bit-exactly.
#pragma once

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "meshtrain/backend/cpu/context.h"
#include "meshtrain/comm/mesh.h"
#include "meshtrain/data/loader.h"
#include "meshtrain/model/model.h"
#include "meshtrain/optim/adamw.h"
#include "meshtrain/parallel/ddp/ddp.h"
#include "meshtrain/parallel/pipeline/executor.h"
#include "meshtrain/parallel/zero/sharded.h"
#include "meshtrain/train/checkpoint.h"
#include "meshtrain/train/config.h"

namespace meshtrain {

struct StepRecord {
  int64_t step = 0;  // 1-based: the step just completed
  double loss = 0;   // mean token loss over the step's batch
  float lr = 0;
  double grad_norm = 0;  // before clipping
  double tokens_per_s = 0;
  double mfu = 0;
  double step_ms = 0;
  double data_ms = 0;  // of step_ms, waiting for the loader's micro-batches
  double comm_ms = 0;          // data parallel: the gradient all-reduces' busy time
  double exposed_comm_ms = 0;  // of step_ms, waiting for them after backward
  uint64_t comm_bytes = 0;     // bytes of the step's collectives (CallRecord::bytes)
  // Pipeline (pp > 1), this rank: time computing, waiting for a peer's
  // activation or gradient, and in the whole schedule; the measured bubble
  // (schedule - compute) / compute next to the theoretical (p - 1) / (v m);
  // the most micro-batches whose activations were held at once.
  double pp_busy_ms = 0, pp_wait_ms = 0, pp_schedule_ms = 0;
  double pp_bubble = 0, pp_bubble_theory = 0;
  int64_t pp_in_flight = 0;
  uint64_t tp_comm_bytes = 0;  // tensor parallel: the tp group's collectives (CallRecord::bytes)
};

struct TrainerOptions {
  std::string resume_dir;  // a step directory to resume from; empty = start from the seed
  bool console = true;     // per-step lines and reports on stdout
  // This process's data-parallel rank and the data-parallel size: the loader
  // hands it rows [dp_rank, dp_rank + 1) * batch_size / dp_size of each global batch.
  int64_t dp_rank = 0;
  int64_t dp_size = 1;
  int prefetch = 2;  // micro-batches the loader makes ahead (0 = on the training thread)
  // A multi-rank run: the mesh (which must outlive the trainer) sets dp_rank
  // and dp_size; with dp > 1 gradients are averaged by DistributedDataParallel,
  // or with parallel.zero > 0 (which needs the mesh) sharded by ZeRO.
  // Only rank 0 prints and writes checkpoints; rank R > 0 writes its metrics
  // to out_dir/metrics.rank<R>.jsonl.
  DeviceMesh* mesh = nullptr;
};

class Trainer {
 public:
  Trainer(const TrainConfig& config, const TrainerOptions& options = {});
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // Runs the remaining steps up to train.steps with evaluation, logging and
  // checkpoints (one at the end unless train.checkpoint_interval is -1).
  // Returns the records of the steps run.
  std::vector<StepRecord> run();
  // One optimizer step (no logging, evaluation or checkpoint).
  StepRecord train_step();
  // Mean validation loss per token over this rank's share of the fixed
  // validation set (train.eval_batches global batches).
  double evaluate();
  // Writes <out_dir>/step_<N>/ for the current step; returns its path. With
  // ZeRO every rank must call it (the shards are gathered to rank 0, which writes).
  std::string save_checkpoint();

  int64_t step() const { return step_; }
  const TrainConfig& config() const { return config_; }
  Model& model() { return *model_; }
  // The flat AdamW (parallel.zero = 0 only; throws otherwise).
  AdamW& optimizer();
  zero::ShardedDataParallel* zero() { return zero_.get(); }  // null unless parallel.zero > 0
  // The master weights in the flat tp = 1 layout (whole tensors), on every
  // rank. Collective with ZeRO (gathered from the shards) and tp (from the slices).
  std::vector<float> gather_weights();
  // The global data position of the next step (saved in checkpoints).
  SamplerPosition sampler_position() const { return loader_->position(); }
  double peak_flops() const { return peak_flops_; }

 private:
  void log_step(const StepRecord& record);
  void log_eval(double val_loss);
  // Weights and optimizer state from a step directory (ZeRO: this rank's shards).
  void load_state(const std::string& dir);
  // Tensor parallel / pipeline stage: whole tensors read into `local`, this
  // rank's slices and stage kept; written by assembling the tp group's slices
  // (collective over tp).
  void load_sliced_state(const std::string& dir, CheckpointTensors& local);
  // The tp-local flat layout those work on: the model's, or (pipeline) the
  // whole model's, assembled from / taken by the stages.
  std::vector<TensorSplit> tp_local_splits() const;
  void save_tensor_parallel_checkpoint(const std::string& dir, const CheckpointTensors& local,
                                       const TrainState& state);
  // Rank 0 prints its bytes by category and (several ranks) the maximum over
  // ranks; every rank writes its own to its metrics file. Collective.
  void log_memory(const char* when);

  TrainConfig config_;
  TrainerOptions options_;
  MemoryTracker tracker_;
  std::unique_ptr<cpu::CpuContext> ctx_;
  std::unique_ptr<TokenDataset> train_data_;
  std::unique_ptr<TokenDataset> val_data_;  // null without data.val
  std::unique_ptr<DataLoader> loader_;
  std::unique_ptr<ValidationSet> val_set_;  // null without data.val
  std::unique_ptr<Model> model_;
  std::unique_ptr<AdamW> optimizer_;
  std::unique_ptr<DistributedDataParallel> ddp_;  // dp > 1 only; after model_ (uses it)
  std::unique_ptr<zero::ShardedDataParallel> zero_;  // parallel.zero > 0; after model_
  // Pipeline parallelism (parallel.pp > 1): the schedule's executor, the
  // first and last stages' group (tied embeddings), the step's micro-batches.
  std::unique_ptr<pipeline::Executor> pipeline_;
  std::unique_ptr<Communicator> tied_;
  std::vector<int64_t> pp_split_;
  std::vector<MicroBatch> pp_batches_;
  // Runs the pipeline schedule on the step's micro-batches (tied embeddings'
  // gradients summed over the first and last stages); returns this stage's loss sum.
  double pipeline_micro_batches(float grad_scale, StepRecord& record);
  LrSchedule schedule_;
  int64_t step_ = 0;
  double peak_flops_ = 0;
  std::string peak_source_;
  MicroBatch val_batch_;  // scratch for evaluate()
  std::ofstream metrics_;
};

}  // namespace meshtrain
