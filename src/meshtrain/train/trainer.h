// The training loop on one rank: the data parallelism (gradient sync and
// optimizer ownership), the step runner (local micro-batches or a pipeline
// schedule) and the checkpointer are built once from the config and the
// mesh; train_step composes them, step hooks observe it.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "meshtrain/backend/backend.h"
#include "meshtrain/comm/mesh.h"
#include "meshtrain/data/loader.h"
#include "meshtrain/model/model.h"
#include "meshtrain/train/checkpoint.h"
#include "meshtrain/train/checkpointer.h"
#include "meshtrain/train/config.h"
#include "meshtrain/train/data_parallel.h"
#include "meshtrain/train/memory_plan.h"
#include "meshtrain/train/step.h"
#include "meshtrain/train/step_runner.h"
#include "meshtrain/train/stragglers.h"
#include "meshtrain/train/update_gate.h"
#include "meshtrain/util/out_dir_lock.h"

namespace meshtrain {

struct TrainerOptions {
  // A step directory to resume from; "auto" = out_dir's newest checkpoint
  // that verifies (`latest` first), or a fresh start when there is none;
  // empty = start from the seed.
  std::string resume_dir;
  // A fresh run refuses an out_dir holding another run's metrics or
  // checkpoints unless told to overwrite them (they are deleted).
  bool overwrite = false;
  // A resume refuses config changes that break exact continuation
  // (resume_config_changes) unless allowed.
  bool allow_config_change = false;
  bool console = true;     // per-step lines and reports on stdout
  // This process's data-parallel rank and the data-parallel size: the loader
  // hands it rows [dp_rank, dp_rank + 1) * batch_size / dp_size of each global batch.
  int64_t dp_rank = 0;
  int64_t dp_size = 1;
  int prefetch = 2;  // micro-batches the loader makes ahead (0 = on the training thread)
  // A multi-rank run: the mesh (which must outlive the trainer) sets dp_rank
  // and dp_size and the parallel modes. Only rank 0 prints; rank R > 0 writes
  // its metrics to out_dir/metrics.rank<R>.jsonl; every rank writes its own
  // part of each checkpoint.
  DeviceMesh* mesh = nullptr;
  // Under `meshtrain launch` (MESHTRAIN_LAUNCH_ATTEMPT / _TIME): the attempt
  // (1 = the first run) and when the launcher started it (unix seconds); a
  // resumed run writes them into its resume event. 0 = not launched.
  int launch_attempt = 0;
  double launched_at = 0;
};

class MetricsLog;

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
  // Mean validation loss per token over the fixed validation set
  // (train.eval_batches global batches). Collective.
  double evaluate();
  // Writes <out_dir>/step_<N>/ for the current step (every rank writes its
  // part); returns its path. With ckpt.async it is committed in the background.
  std::string save_checkpoint();
  // Waits until an asynchronous checkpoint is committed (collective).
  void wait_for_checkpoint();
  // Saves, waits for the commit and tells the hooks (on_checkpoint); returns
  // the directory. Collective.
  std::string checkpoint_now();
  // One record in this rank's metrics file (an event: resume, preempted, ...).
  void log_event(const nlohmann::json& record);

  // Observers called by run() after each step, evaluation and checkpoint.
  void add_hook(std::unique_ptr<StepHook> hook);

  int64_t step() const { return step_; }
  const TrainConfig& config() const { return config_; }
  Model& model() { return *model_; }
  DataParallel& data_parallel() { return *dp_; }
  const layout::ShardMap& shard_map() const { return checkpointer_->shard_map(); }
  const Checkpointer& checkpointer() const { return *checkpointer_; }
  // The directory this run resumed from (resolved for "auto"); empty for a fresh start.
  const std::string& resumed_from() const { return resumed_from_; }
  // The master weights in the flat tp = 1 layout (whole tensors), on every
  // rank. Collective.
  std::vector<float> gather_weights() { return gather_state(layout::StateKind::master); }
  // Any state (master, AdamW moments) in that layout, on every rank. Collective.
  std::vector<float> gather_state(layout::StateKind kind);
  // The global data position of the next step (saved in checkpoints).
  SamplerPosition sampler_position() const { return loader_->position(); }
  double peak_flops() const { return peak_flops_; }
  const UpdateGates& update_gates() const { return *gates_; }
  MemoryTracker& tracker() { return tracker_; }
  // Every rank's predicted memory (memory_plan.h), made before allocating;
  // indexed by world rank.
  const std::vector<RankMemory>& memory_plan() const { return memory_plan_; }

 private:
  // Resolves options_.resume_dir: the directory, or for "auto" out_dir's
  // checkpoints to try, newest first (agreed by every rank). Collective.
  std::vector<std::string> resolve_resume();
  // out_dir's checkpoints with a valid manifest and whole files, newest first,
  // listed by rank 0 (its notes printed when `report`), the same on every
  // rank; their checksums are the load's. Collective.
  std::vector<std::string> checkpoint_candidates(bool report);
  // The train state of `dir`, checked against this run's model and settings.
  TrainState read_resume_state(const std::string& dir) const;
  // What a gate's rollback request makes the trainer do, at step record.step
  // (after its batch was read): reload the newest committed checkpoint
  // (weights, optimizer state, step, the gates' state) and continue the data
  // request.skip_batches global batches past that step's batch, filling the
  // record's rollback fields. No checkpoint: ErrorKind::diverged. Collective.
  void roll_back(const RollbackRequest& request, StepRecord& record);
  // The global batch (1-based, counted over epochs) the next step reads.
  int64_t next_batch_number() const;
  // A fresh run: refuses (or with overwrite deletes) another run's files,
  // before any rank writes. Collective.
  void prepare_out_dir();
  void print_setup(const LoaderOptions& loader);
  // The memory report (memory_report.h): measured next to predicted, every
  // rank to its metrics file, rank 0 a table of all ranks. Collective.
  void log_memory(const char* when);

  TrainConfig config_;
  TrainerOptions options_;
  OutDirLocks out_dir_locks_;  // taken first, let go last (after a pending save)
  MemoryTracker tracker_;
  std::vector<RankMemory> memory_plan_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<SampleSource> train_data_;  // token shards or SFT records (data.format)
  std::unique_ptr<SampleSource> val_data_;    // null without data.val
  LoaderOptions loader_options_;
  std::unique_ptr<DataLoader> loader_;
  std::unique_ptr<ValidationSet> val_set_;  // null without data.val
  std::unique_ptr<Model> model_;
  std::unique_ptr<DataParallel> dp_;        // after model_ (uses it)
  std::unique_ptr<StepObjective> objective_;  // null: the token losses' sum
  std::unique_ptr<StepRunner> runner_;      // after model_ and objective_
  std::unique_ptr<Checkpointer> checkpointer_;
  std::unique_ptr<UpdateGates> gates_;  // whether each step's update is applied
  MetricsLog* metrics_ = nullptr;  // owned by hooks_
  std::vector<std::unique_ptr<StepHook>> hooks_;  // the metrics log first
  SlowRankDelays slow_;  // test hook MESHTRAIN_SLOW_RANK (zero normally)
  LrSchedule schedule_;
  int64_t step_ = 0;
  std::string resumed_from_;
  uint64_t base_digest_ = 0;  // TrainState::base_digest
  double peak_flops_ = 0;
  std::string peak_source_;
};

}  // namespace meshtrain
