// Whether a step's update is applied. After the gradient norm and before the
// optimizer step the trainer consults its gates: each votes apply or skip (a
// reason code) from what this rank sees, and ONE collective over the whole
// world (every dp, tp and pp rank) combines the votes (the largest code per
// gate), so every rank takes the same decision — an overflow on any rank skips
// the step on all of them.
//
// A skipped step changes no weight, no optimizer moment and not AdamW's step
// count; the data position and the LR schedule advance (the step's batch is
// consumed, the next step uses the next batch and the next LR). The gates'
// state (loss scale, counters, windows) travels in the checkpoint's train state.
//
// A gate may also ask for a rollback (RollbackRequest): the trainer reloads
// the last committed checkpoint and continues past the data that caused it
// (Trainer::roll_back). The request follows from the combined decision only,
// so every rank asks for the same one.
//
// Gates now: the fp16 loss scaler (LossScaler) and the stability guard
// (StabilityGuard: non-finite values in fp32 / bf16, loss and gradient-norm
// spikes). Without gates decide() runs no collective and applies every step.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/model/model.h"
#include "meshtrain/train/config.h"
#include "meshtrain/train/data_parallel.h"
#include "meshtrain/train/step.h"

namespace meshtrain {

// What a gate sees of the step being decided (this rank's values; the trainer
// has already reduced the loss over dp and the norm over every element).
struct StepCheck {
  int64_t step = 0;      // 1-based: the step being decided
  double loss = 0;       // the step's mean token loss (may be non-finite)
  double grad_norm = 0;  // of the unscaled gradients, before clipping (may be non-finite)
};

// A gate's request to go back to the last committed checkpoint; the data
// continues `skip_batches` global batches past the batch of the step that
// asked (that batch included in the count is not: it is always skipped).
struct RollbackRequest {
  std::string reason;  // "loss spike (z 9.1 > 6)", "5 consecutive skipped steps"
  int64_t skip_batches = 0;
};

class UpdateGate {
 public:
  virtual ~UpdateGate() = default;
  // The gate's key in the checkpoint's train state ("loss_scale").
  virtual std::string name() const = 0;
  // Why this gate skips a step with vote code `code` (> 0), for the metrics
  // ("gradient overflow").
  virtual std::string skip_reason(int64_t code) const = 0;
  // The multiplier of the loss gradient this gate asks for the next step
  // (loss scaling); 1 for gates that do not scale.
  virtual double loss_scale() const { return 1.0; }
  // This rank's vote: 0 = apply, > 0 = skip for the gate's reason `code`;
  // the largest code over the ranks wins (order codes by severity).
  virtual int64_t vote(const StepCheck& check) = 0;
  // The decision, the same on every rank: `verdict` the largest code this
  // gate voted on any rank (0: none voted skip), `applied` whether the step
  // was applied. May throw (a gate that cannot recover ends the run, on every
  // rank at once).
  virtual void decided(const StepCheck& check, int64_t verdict, bool applied) = 0;
  // Asked after decided(): a rollback this gate wants (then cleared).
  virtual std::optional<RollbackRequest> take_rollback() { return std::nullopt; }
  virtual nlohmann::json state() const = 0;
  // `where` names the checkpoint for errors.
  virtual void load_state(const nlohmann::json& state, const std::string& where) = 0;
};

struct GateDecision {
  bool apply = true;
  std::string reason;  // skipped: the reasons of the gates that voted so, joined by "; "
  // A gate asked to go back to the last checkpoint (the trainer's roll_back).
  std::optional<RollbackRequest> rollback;
};

// The gates of a run and the one collective combining their votes.
class UpdateGates {
 public:
  // world: every rank of the mesh (null: a single process).
  explicit UpdateGates(Communicator* world) : world_(world) {}
  void add(std::unique_ptr<UpdateGate> gate) { gates_.push_back(std::move(gate)); }
  bool empty() const { return gates_.empty(); }

  // The product of the gates' loss scales.
  double loss_scale() const;
  // Collects the votes, combines them over the world (one all-reduce of one
  // flag per gate; none without gates) and tells every gate the decision.
  // Collective.
  GateDecision decide(const StepCheck& check);
  // Fills the step's skipped / skip_reason / loss_scale / skipped_steps fields.
  void fill(const GateDecision& decision, double loss_scale, StepRecord& record) const;
  int64_t skipped_steps() const { return skipped_steps_; }

  // {"skipped_steps": n, "<gate name>": <its state>, ...}
  nlohmann::json state() const;
  // Restores what state() wrote; entries of gates this run does not have are
  // ignored (a changed precision), gates without an entry keep their start.
  void load_state(const nlohmann::json& state, const std::string& where);

 private:
  Communicator* world_;
  std::vector<std::unique_ptr<UpdateGate>> gates_;
  int64_t skipped_steps_ = 0;
};

// Dynamic loss scaling for fp16 (settings: config.h LossScaleSettings): the
// loss gradient is multiplied by the scale; an overflow (a non-finite loss or
// gradient norm, on any rank) skips the step and halves the scale (not below
// the minimum); growth_interval applied steps in a row without overflow
// double it. An overflow at the minimum scale ends the run ("training
// diverged"). Steps skipped by another gate leave the scale unchanged.
class LossScaler final : public UpdateGate {
 public:
  explicit LossScaler(const LossScaleSettings& settings);
  std::string name() const override { return "loss_scale"; }
  std::string skip_reason(int64_t) const override { return "gradient overflow"; }
  double loss_scale() const override { return scale_; }
  int64_t vote(const StepCheck& check) override;
  void decided(const StepCheck& check, int64_t verdict, bool applied) override;
  nlohmann::json state() const override;
  void load_state(const nlohmann::json& state, const std::string& where) override;

  int64_t good_steps() const { return good_steps_; }  // applied without overflow since the last change
  int64_t overflows() const { return overflows_; }

 private:
  LossScaleSettings settings_;
  double scale_;
  int64_t good_steps_ = 0, overflows_ = 0;
};

// The stability guard ([guard], config.h GuardSettings). Votes skip on
// a non-finite loss or gradient norm (when `judge_non_finite`: fp32 / bf16;
// under fp16 the loss scaler owns overflows) and on a spike: the loss or the
// norm more than loss_z / grad_z standard deviations above the mean of the
// last `window` applied steps (once min_steps are in it). max_skips
// consecutive guard skips => a rollback; with policy "rollback" a spike asks
// for one at once. Every rank holds the same window (the loss is summed over
// dp and pp, the norm over the mesh); the votes are combined anyway.
class StabilityGuard final : public UpdateGate {
 public:
  enum Code : int64_t { kGradSpike = 1, kLossSpike = 2, kNonFinite = 3 };  // by severity
  StabilityGuard(const GuardSettings& settings, bool judge_non_finite);
  std::string name() const override { return "guard"; }
  std::string skip_reason(int64_t code) const override;
  int64_t vote(const StepCheck& check) override;
  void decided(const StepCheck& check, int64_t verdict, bool applied) override;
  std::optional<RollbackRequest> take_rollback() override;
  nlohmann::json state() const override;
  void load_state(const nlohmann::json& state, const std::string& where) override;

  int64_t consecutive_skips() const { return consecutive_; }
  int64_t spikes() const { return spikes_; }
  int64_t non_finite() const { return non_finite_; }
  // z-scores of this rank's last vote (0 before min_steps or when off).
  double last_loss_z() const { return loss_z_; }
  double last_grad_z() const { return grad_z_; }

 private:
  GuardSettings settings_;
  bool judge_non_finite_;
  std::deque<double> losses_, norms_;  // the applied steps' values, oldest first
  int64_t consecutive_ = 0, spikes_ = 0, non_finite_ = 0;
  int64_t rollbacks_ = 0;  // in this process (not in the checkpoint: a rollback reloads it)
  double loss_z_ = 0, grad_z_ = 0;
  std::optional<RollbackRequest> rollback_;
};

// The gates `config` asks for: the loss scaler with train.precision = "fp16",
// the stability guard with guard.enabled.
std::unique_ptr<UpdateGates> make_update_gates(const TrainConfig& config, Communicator* world);

// Test hooks, each <steps>@<rank> where <steps> is N or N-M: world rank
// <rank> changes each of its local parameter gradients when the step reads
// global batch N (..M) of the data (a fresh run's step N reads batch N; after
// a rollback that skipped the batch, the fault is not met again), after the
// gradient sync, so only that rank's gradients hold it:
//   MESHTRAIN_INJECT_INF    +inf into the first element
//   MESHTRAIN_INJECT_NAN    NaN into the first element
//   MESHTRAIN_INJECT_SPIKE  every element x 1000 (a gradient-norm spike)
// The gradients are DataParallel::local_gradients(): the replicated model's
// (dp 1, DDP, tp, pp) or ZeRO's shards (the first element of each shard).
void inject_grad_fault(DataParallel& dp, int64_t batch, int world_rank);

}  // namespace meshtrain
