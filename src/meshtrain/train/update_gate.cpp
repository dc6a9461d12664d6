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
  for (const auto& gate : gates_) votes.push_back(gate->vote(check));
  // The one collective: a gate's verdict is its largest code on any rank.
  if (world_ != nullptr && world_->size() > 1) {
    world_->all_reduce(votes.data(), static_cast<int64_t>(votes.size()), CommDType::i64,
                       ReduceOp::max);
  }
  std::vector<std::string> reasons;
  for (size_t i = 0; i < gates_.size(); ++i) {
    if (votes[i] != 0) reasons.push_back(gates_[i]->skip_reason(votes[i]));
  }
  decision.apply = reasons.empty();
  decision.reason = fmt::format("{}", fmt::join(reasons, "; "));
  if (!decision.apply) ++skipped_steps_;
  for (size_t i = 0; i < gates_.size(); ++i) gates_[i]->decided(check, votes[i], decision.apply);
  for (const auto& gate : gates_) {
    std::optional<RollbackRequest> rollback = gate->take_rollback();
    if (rollback && !decision.rollback) decision.rollback = std::move(rollback);
  }
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

int64_t LossScaler::vote(const StepCheck& check) {
  return !std::isfinite(check.loss) || !std::isfinite(check.grad_norm) ? 1 : 0;
}

void LossScaler::decided(const StepCheck& check, int64_t verdict, bool applied) {
  if (verdict != 0) {
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

namespace {

// How many standard deviations `x` lies above the mean of `window`. The
// deviation has a floor (a flat window would make any change infinite).
double z_score(const std::deque<double>& window, double x) {
  double mean = 0;
  for (double v : window) mean += v;
  mean /= static_cast<double>(window.size());
  double var = 0;
  for (double v : window) var += (v - mean) * (v - mean);
  const double std_dev = std::sqrt(var / static_cast<double>(window.size()));
  return (x - mean) / std::max(std_dev, 1e-6 * std::abs(mean) + 1e-12);
}

std::deque<double> read_window(const nlohmann::json& state, const char* key,
                               const std::string& where) {
  MESHTRAIN_CHECK_AS(ErrorKind::corrupt, state.is_object() && state.contains(key) &&
                                             state.at(key).is_array(),
                     "{}: update_gates.guard.{} must be an array of numbers", where, key);
  std::deque<double> out;
  for (const nlohmann::json& v : state.at(key)) {
    MESHTRAIN_CHECK_AS(ErrorKind::corrupt, v.is_number() && std::isfinite(v.get<double>()),
                       "{}: update_gates.guard.{} must hold finite numbers", where, key);
    out.push_back(v.get<double>());
  }
  return out;
}

}  // namespace

StabilityGuard::StabilityGuard(const GuardSettings& settings, bool judge_non_finite)
    : settings_(settings), judge_non_finite_(judge_non_finite) {}

std::string StabilityGuard::skip_reason(int64_t code) const {
  switch (code) {
    case kGradSpike: return "gradient-norm spike";
    case kLossSpike: return "loss spike";
    case kNonFinite: return "non-finite loss or gradient norm";
  }
  return "guard";
}

int64_t StabilityGuard::vote(const StepCheck& check) {
  loss_z_ = grad_z_ = 0;
  const bool finite = std::isfinite(check.loss) && std::isfinite(check.grad_norm);
  if (!finite) return judge_non_finite_ ? int64_t{kNonFinite} : 0;  // fp16: the loss scaler's
  if (static_cast<int64_t>(losses_.size()) < settings_.min_steps) return 0;
  if (settings_.loss_z > 0) loss_z_ = z_score(losses_, check.loss);
  if (settings_.grad_z > 0) grad_z_ = z_score(norms_, check.grad_norm);
  if (settings_.loss_z > 0 && loss_z_ > settings_.loss_z) return kLossSpike;
  if (settings_.grad_z > 0 && grad_z_ > settings_.grad_z) return kGradSpike;
  return 0;
}

void StabilityGuard::decided(const StepCheck& check, int64_t verdict, bool applied) {
  if (verdict == 0) {
    if (!applied) return;  // skipped by another gate: no evidence either way
    consecutive_ = 0;
    losses_.push_back(check.loss);
    norms_.push_back(check.grad_norm);
    while (static_cast<int64_t>(losses_.size()) > settings_.window) {
      losses_.pop_front();
      norms_.pop_front();
    }
    return;
  }
  ++consecutive_;
  if (verdict == kNonFinite) {
    ++non_finite_;
  } else {
    ++spikes_;
  }
  std::string why;
  if (verdict != kNonFinite && settings_.policy == GuardPolicy::rollback) {
    why = fmt::format("{} at step {}", skip_reason(verdict), check.step);
  } else if (consecutive_ >= settings_.max_skips) {
    why = fmt::format("{} consecutive skipped steps (guard.max_skips), the last at step {}: {}",
                      consecutive_, check.step, skip_reason(verdict));
  } else {
    return;
  }
  MESHTRAIN_CHECK_AS(ErrorKind::diverged, rollbacks_ < settings_.max_rollbacks,
                     "step {}: {}; already rolled back {} times (guard.max_rollbacks): training "
                     "diverged",
                     check.step, why, rollbacks_);
  ++rollbacks_;
  consecutive_ = 0;
  rollback_ = RollbackRequest{why, settings_.rollback_skip_batches};
}

std::optional<RollbackRequest> StabilityGuard::take_rollback() {
  std::optional<RollbackRequest> out = std::move(rollback_);
  rollback_.reset();
  return out;
}

nlohmann::json StabilityGuard::state() const {
  return {{"losses", losses_},          {"norms", norms_},   {"consecutive_skips", consecutive_},
          {"spikes", spikes_},          {"non_finite", non_finite_}};
}

void StabilityGuard::load_state(const nlohmann::json& state, const std::string& where) {
  std::deque<double> losses = read_window(state, "losses", where);
  std::deque<double> norms = read_window(state, "norms", where);
  MESHTRAIN_CHECK_AS(ErrorKind::corrupt, losses.size() == norms.size(),
                     "{}: update_gates.guard: losses ({}) and norms ({}) differ in length", where,
                     losses.size(), norms.size());
  for (const char* key : {"consecutive_skips", "spikes", "non_finite"}) {
    MESHTRAIN_CHECK_AS(ErrorKind::corrupt,
                       state.contains(key) && state.at(key).is_number_integer() &&
                           state.at(key).get<int64_t>() >= 0,
                       "{}: update_gates.guard.{} must be a non-negative integer", where, key);
  }
  // A shorter guard.window than the saved run's keeps the newest values.
  while (static_cast<int64_t>(losses.size()) > settings_.window) {
    losses.pop_front();
    norms.pop_front();
  }
  losses_ = std::move(losses);
  norms_ = std::move(norms);
  consecutive_ = state.at("consecutive_skips").get<int64_t>();
  spikes_ = state.at("spikes").get<int64_t>();
  non_finite_ = state.at("non_finite").get<int64_t>();
}

std::unique_ptr<UpdateGates> make_update_gates(const TrainConfig& config, Communicator* world) {
  auto gates = std::make_unique<UpdateGates>(world);
  if (config.train.precision == Precision::fp16) {
    gates->add(std::make_unique<LossScaler>(config.train.loss_scale));
  }
  if (config.guard.enabled) {
    gates->add(std::make_unique<StabilityGuard>(config.guard,
                                                config.train.precision != Precision::fp16));
  }
  return gates;
}

namespace {

// MESHTRAIN_INJECT_*=<first>[-<last>]@<rank>: whether it names this batch and rank.
bool fault_here(const char* var, int64_t batch, int world_rank) {
  const char* want = std::getenv(var);
  if (want == nullptr) return false;
  const std::string spec(want);
  const size_t at = spec.find('@');
  MESHTRAIN_CHECK(at != spec.npos, "{} must be <step>[-<last>]@<rank>, got '{}'", var, spec);
  const std::string steps = spec.substr(0, at);
  const size_t dash = steps.find('-');
  int64_t first = 0, last = 0;
  try {
    first = std::stoll(steps.substr(0, dash));
    last = dash == steps.npos ? first : std::stoll(steps.substr(dash + 1));
  } catch (const std::exception&) {
    fail("{} must be <step>[-<last>]@<rank>, got '{}'", var, spec);
  }
  return batch >= first && batch <= last && spec.substr(at + 1) == std::to_string(world_rank);
}

}  // namespace

void inject_grad_fault(DataParallel& dp, int64_t batch, int world_rank) {
  float value = 0;
  bool scale = false;
  if (fault_here("MESHTRAIN_INJECT_INF", batch, world_rank)) {
    value = std::numeric_limits<float>::infinity();
  } else if (fault_here("MESHTRAIN_INJECT_NAN", batch, world_rank)) {
    value = std::numeric_limits<float>::quiet_NaN();
  } else if (fault_here("MESHTRAIN_INJECT_SPIKE", batch, world_rank)) {
    scale = true;
  } else {
    return;
  }
  // Every local gradient (or shard): whichever of them this rank's norm
  // counts (tp slices, a stage's own layers, not a tied replica) holds the fault.
  for (std::span<float> g : dp.local_gradients()) {
    if (g.empty()) continue;
    if (scale) {
      for (float& v : g) v *= 1000.0f;
    } else {
      g[0] = value;
    }
  }
}

}  // namespace meshtrain
