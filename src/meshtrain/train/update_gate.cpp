#include "meshtrain/train/update_gate.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>

#include "meshtrain/util/error.h"

namespace meshtrain {

double UpdateGates::loss_scale() const {
  double scale = 1.0;
  for (const auto& gate : gates_) scale *= gate->loss_scale();
  return scale;
}

GateDecision UpdateGates::decide(const StepCheck& check) {
  GateDecision decision;
  if (gates_.empty()) return decision;
  std::vector<int64_t> votes;
  votes.reserve(gates_.size());
  for (const auto& gate : gates_) votes.push_back(gate->vote_skip(check) ? 1 : 0);
  // The one collective: a gate's flag is set when it voted skip on any rank.
  if (world_ != nullptr && world_->size() > 1) {
    world_->all_reduce(votes.data(), static_cast<int64_t>(votes.size()), CommDType::i64,
                       ReduceOp::max);
  }
  std::vector<std::string> reasons;
  for (size_t i = 0; i < gates_.size(); ++i) {
    if (votes[i] != 0) reasons.push_back(gates_[i]->skip_reason());
  }
  decision.apply = reasons.empty();
  decision.reason = fmt::format("{}", fmt::join(reasons, "; "));
  if (!decision.apply) ++skipped_steps_;
  for (size_t i = 0; i < gates_.size(); ++i) gates_[i]->decided(check, votes[i] != 0, decision.apply);
  return decision;
}

void UpdateGates::fill(const GateDecision& decision, double loss_scale, StepRecord& r) const {
  r.skipped = !decision.apply;
  r.skip_reason = decision.reason;
  r.loss_scale = loss_scale;
  r.skipped_steps = skipped_steps_;
}

nlohmann::json UpdateGates::state() const {
  nlohmann::json out{{"skipped_steps", skipped_steps_}};
  for (const auto& gate : gates_) out[gate->name()] = gate->state();
  return out;
}

void UpdateGates::load_state(const nlohmann::json& state, const std::string& where) {
  if (state.is_null()) return;  // a checkpoint from before the gates: their start
  MESHTRAIN_CHECK(state.is_object(), "{}: update_gates must be an object", where);
  if (state.contains("skipped_steps")) {
    const nlohmann::json& n = state.at("skipped_steps");
    MESHTRAIN_CHECK(n.is_number_integer() && n.get<int64_t>() >= 0,
                    "{}: update_gates.skipped_steps must be a non-negative integer", where);
    skipped_steps_ = n.get<int64_t>();
  }
  for (const auto& gate : gates_) {
    if (state.contains(gate->name())) gate->load_state(state.at(gate->name()), where);
  }
}

LossScaler::LossScaler(const LossScaleSettings& settings)
    : settings_(settings), scale_(settings.init) {
  MESHTRAIN_CHECK(settings.min > 0 && settings.init >= settings.min && settings.growth_interval >= 1,
                  "loss scaler: needs 0 < min ({}) <= init ({}) and growth_interval ({}) >= 1",
                  settings.min, settings.init, settings.growth_interval);
}

bool LossScaler::vote_skip(const StepCheck& check) {
  return !std::isfinite(check.loss) || !std::isfinite(check.grad_norm);
}

void LossScaler::decided(const StepCheck& check, bool voted, bool applied) {
  if (voted) {
    MESHTRAIN_CHECK(scale_ > settings_.min,
                    "step {}: gradients overflow in fp16 at the minimum loss scale {} (loss {}, "
                    "gradient norm {}): training diverged",
                    check.step, scale_, check.loss, check.grad_norm);
    scale_ = std::max(settings_.min, scale_ * LossScaleSettings::kBackoff);
    good_steps_ = 0;
    ++overflows_;
    return;
  }
  if (!applied) return;  // skipped by another gate: no evidence either way
  if (++good_steps_ >= settings_.growth_interval) {
    // Doubling past the largest finite float would make every step overflow.
    scale_ = std::min(scale_ * LossScaleSettings::kGrowth,
                      static_cast<double>(std::numeric_limits<float>::max()) / 2);
    good_steps_ = 0;
  }
}

nlohmann::json LossScaler::state() const {
  return {{"scale", scale_}, {"good_steps", good_steps_}, {"overflows", overflows_}};
}

void LossScaler::load_state(const nlohmann::json& state, const std::string& where) {
  auto field = [&](const char* key) -> const nlohmann::json& {
    MESHTRAIN_CHECK(state.is_object() && state.contains(key),
                    "{}: update_gates.loss_scale: missing field '{}'", where, key);
    return state.at(key);
  };
  const nlohmann::json& scale = field("scale");
  MESHTRAIN_CHECK(scale.is_number() && std::isfinite(scale.get<double>()) &&
                      scale.get<double>() >= settings_.min,
                  "{}: update_gates.loss_scale.scale must be a number >= train.loss_scale_min ({})",
                  where, settings_.min);
  for (const char* key : {"good_steps", "overflows"}) {
    const nlohmann::json& n = field(key);
    MESHTRAIN_CHECK(n.is_number_integer() && n.get<int64_t>() >= 0,
                    "{}: update_gates.loss_scale.{} must be a non-negative integer", where, key);
  }
  scale_ = scale.get<double>();
  good_steps_ = state.at("good_steps").get<int64_t>();
  overflows_ = state.at("overflows").get<int64_t>();
}

std::unique_ptr<UpdateGates> make_update_gates(const TrainConfig& config, Communicator* world) {
  auto gates = std::make_unique<UpdateGates>(world);
  if (config.train.precision == Precision::fp16) {
    gates->add(std::make_unique<LossScaler>(config.train.loss_scale));
  }
  return gates;
}

void inject_grad_fault(Model& model, int64_t step, int world_rank) {
  const char* want = std::getenv("MESHTRAIN_INJECT_INF");
  if (want == nullptr) return;
  const std::string spec(want);
  const size_t at = spec.find('@');
  MESHTRAIN_CHECK(at != spec.npos, "MESHTRAIN_INJECT_INF must be <step>@<rank>, got '{}'", spec);
  if (spec.substr(0, at) != std::to_string(step) ||
      spec.substr(at + 1) != std::to_string(world_rank)) {
    return;
  }
  // Every local gradient's first element: whichever of them this rank's norm
  // counts (tp slices, a stage's own layers, not a tied replica) holds an inf.
  bool any = false;
  for (Parameter& p : model.params()) {
    if (!p.grad.defined()) continue;
    p.grad.data<float>()[0] = std::numeric_limits<float>::infinity();
    any = true;
  }
  if (any) return;
  fail("MESHTRAIN_INJECT_INF: rank {} holds no local parameter gradient at step {} (ZeRO "
       "shards them)",
       world_rank, step);
}

}  // namespace meshtrain
