// What one training step reports, and the hooks that observe steps (metrics,
// and later the stability guard, watchdog and trace) without the loop
// growing branches for each.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace meshtrain {

// A MoE layer's routing in one step (model.h MoeLayerStats) over every
// data-parallel rank: the choices each expert received (min, mean, max and
// the max / mean imbalance), those dropped over capacity, and per micro-batch means of the load-balancing
// statistic E * sum P f (1: uniform) and of the z-loss's mean lse^2, before
// their coefficients.
struct MoeLayerRecord {
  int64_t layer = 0;
  int64_t tokens_min = 0, tokens_max = 0;
  double tokens_mean = 0, imbalance = 0;
  int64_t dropped = 0;  // choices over an expert's capacity (moe.capacity_factor)
  double aux = 0, z = 0;
  std::vector<int64_t> tokens;  // [E]: each expert's choices
  double bias_min = 0, bias_max = 0;  // the selection bias the step routed with (moe.bias_update_rate)
};

struct StepRecord {
  int64_t step = 0;  // 1-based: the step just completed
  double loss = 0;   // mean token loss over the step's batch (its loss tokens)
  int64_t loss_tokens = 0;  // tokens whose loss counts, whole global batch (SFT: response tokens)
  float lr = 0;
  double grad_norm = 0;  // before clipping (of the unscaled gradients; non-finite when skipped)
  // The update gates (train/update_gate.h): whether the step's update was
  // skipped on every rank and why, the loss scale it ran with (1 unless
  // fp16), and the run's skipped steps so far (a resumed run continues the count).
  bool skipped = false;
  std::string skip_reason;
  double loss_scale = 1.0;
  int64_t skipped_steps = 0;
  // A gate asked for a rollback at this step (train/update_gate.h): the run
  // went back to the checkpoint of step rollback_to_step (the next record is
  // that step + 1) and its data skipped rollback_skipped_batches batches.
  bool rolled_back = false;
  int64_t rollback_to_step = 0, rollback_skipped_batches = 0;
  std::string rollback_reason, rollback_checkpoint;
  double tokens_per_s = 0;
  double mfu = 0;
  double step_ms = 0;
  double data_ms = 0;  // of step_ms, waiting for the loader's micro-batches
  double comm_ms = 0;          // data parallel: the gradient collectives' busy time
  double exposed_comm_ms = 0;  // of step_ms, waiting for them after backward
  double optimizer_ms = 0;     // of step_ms, the optimizer step (0 when skipped)
  double gates_ms = 0;         // of step_ms, the update gates' votes and their one collective
  uint64_t comm_bytes = 0;     // bytes of the step's collectives (CallRecord::bytes)
  // Pipeline (pp > 1), this rank: time computing, waiting for a peer's
  // activation or gradient, and in the whole schedule; the measured bubble
  // (schedule - compute) / compute next to the theoretical (p - 1) / (v m);
  // the most micro-batches whose activations were held at once.
  bool pipelined = false;
  double pp_busy_ms = 0, pp_wait_ms = 0, pp_schedule_ms = 0;
  double pp_bubble = 0, pp_bubble_theory = 0;
  int64_t pp_in_flight = 0;
  uint64_t tp_comm_bytes = 0;  // tensor parallel: the tp group's collectives (CallRecord::bytes)
  // Expert parallelism (ep > 1): the ep group's all-to-alls in the step, the
  // bytes this rank sent and their busy time. The compute waits for each
  // (dispatch and combine block), so all of it is exposed.
  uint64_t ep_comm_bytes = 0;
  double ep_comm_ms = 0;
  // ZeRO with parallel.offload cpu/disk: the store's traffic in the step and its
  // read-ahead (acquires that found their chunk read vs. had to wait for it).
  bool offloaded = false;
  uint64_t offload_read_bytes = 0, offload_written_bytes = 0;
  uint64_t offload_ready = 0, offload_waited = 0;
  std::vector<MoeLayerRecord> moe;  // this rank's MoE layers (its stage's), in layer order
  // Preference optimisation ([dpo]; train/preference.h): means over the
  // step's pairs (every dp rank's) of the chosen and rejected responses'
  // rewards β (log πθ − log πref), their margin, and the share of pairs whose
  // chosen reward is the higher.
  bool preference = false;
  double reward_chosen = 0, reward_rejected = 0, reward_margin = 0, reward_accuracy = 0;
};

// Observes the training loop. Every rank's hooks are called at the same
// points (a hook may run collectives). Errors thrown end the run.
class StepHook {
 public:
  virtual ~StepHook() = default;
  virtual void before_step(int64_t step) {}  // step: 1-based, the one about to run
  virtual void on_step(const StepRecord& record) {}
  virtual void on_eval(int64_t step, double val_loss) {}
  virtual void on_checkpoint(int64_t step, const std::string& dir) {}
  virtual void on_end() {}  // after run()'s last step, evaluation and checkpoint
};

}  // namespace meshtrain
