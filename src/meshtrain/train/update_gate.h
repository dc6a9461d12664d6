// Whether a step's update is applied. After the gradient norm and before the
// optimizer step the trainer consults its gates: each votes apply or skip from
// what this rank sees, and ONE collective over the whole world (every dp, tp
// and pp rank) combines the votes, so every rank takes the same decision — an
// overflow on any rank skips the step on all of them.
//
// A skipped step changes no weight, no optimizer moment and not AdamW's step
// count; the data position and the LR schedule advance (the step's batch is
// consumed, the next step uses the next batch and the next LR). The gates'
// state (loss scale, counters) travels in the checkpoint's train state.
//
// Gates now: the fp16 loss scaler (LossScaler). The stability guard (non-finite
// loss / gradient norm, spikes) plugs in the same way. Without gates (fp32,
// bf16) decide() runs no collective and applies every step.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/model/model.h"
#include "meshtrain/train/config.h"
#include "meshtrain/train/step.h"

namespace meshtrain {

// What a gate sees of the step being decided (this rank's values; the trainer
// has already reduced the loss over dp and the norm over every element).
struct StepCheck {
  int64_t step = 0;      // 1-based: the step being decided
  double loss = 0;       // the step's mean token loss (may be non-finite)
  double grad_norm = 0;  // of the unscaled gradients, before clipping (may be non-finite)
};

class UpdateGate {
 public:
  virtual ~UpdateGate() = default;
  // The gate's key in the checkpoint's train state ("loss_scale").
  virtual std::string name() const = 0;
  // Why this gate skips a step, for the metrics ("gradient overflow").
  virtual std::string skip_reason() const = 0;
  // The multiplier of the loss gradient this gate asks for the next step
  // (loss scaling); 1 for gates that do not scale.
  virtual double loss_scale() const { return 1.0; }
  // This rank's vote: true = skip the step.
  virtual bool vote_skip(const StepCheck& check) = 0;
  // The decision, the same on every rank: `voted` whether this gate voted to
  // skip on any rank, `applied` whether the step was applied. May throw (a
  // gate that cannot recover ends the run, on every rank at once).
  virtual void decided(const StepCheck& check, bool voted, bool applied) = 0;
  virtual nlohmann::json state() const = 0;
  // `where` names the checkpoint for errors.
  virtual void load_state(const nlohmann::json& state, const std::string& where) = 0;
};

struct GateDecision {
  bool apply = true;
  std::string reason;  // skipped: the reasons of the gates that voted so, joined by "; "
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
  std::string skip_reason() const override { return "gradient overflow"; }
  double loss_scale() const override { return scale_; }
  bool vote_skip(const StepCheck& check) override;
  void decided(const StepCheck& check, bool voted, bool applied) override;
  nlohmann::json state() const override;
  void load_state(const nlohmann::json& state, const std::string& where) override;

  int64_t good_steps() const { return good_steps_; }  // applied without overflow since the last change
  int64_t overflows() const { return overflows_; }

 private:
  LossScaleSettings settings_;
  double scale_;
  int64_t good_steps_ = 0, overflows_ = 0;
};

// The gates `config` asks for: the loss scaler with train.precision = "fp16".
std::unique_ptr<UpdateGates> make_update_gates(const TrainConfig& config, Communicator* world);

// Test hook: with MESHTRAIN_INJECT_INF=<step>@<rank>, world rank <rank> writes
// +inf into the first element of each of its local parameter gradients at
// step <step> (after the gradient sync: only that rank's gradients hold it). Replicated parameters
// (dp 1, DDP, tp, pp); ZeRO holds no local gradient views there (error).
void inject_grad_fault(Model& model, int64_t step, int world_rank);

}  // namespace meshtrain
