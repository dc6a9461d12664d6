#include "meshtrain/train/preference.h"

#include <algorithm>
#include <cmath>

namespace meshtrain {
namespace {

// log σ(x) without overflow: exp of a non-positive number only.
double log_sigmoid(double x) {
  return x >= 0 ? -std::log1p(std::exp(-x)) : x - std::log1p(std::exp(x));
}

// σ(−x) = d log σ(x) / dx, accurate to a few ulps for either sign.
double sigmoid_of_minus(double x) {
  if (x >= 0) {
    const double e = std::exp(-x);
    return e / (1 + e);
  }
  return 1 / (1 + std::exp(x));
}

}  // namespace

PairLoss dpo_pair_loss(const DpoSettings& settings, const PairLogps& pair) {
  const double beta = settings.beta;
  // The operations in TRL's order (chosen_logratios, rejected_logratios, their difference), so
  // the float64 reference agrees to rounding.
  const double chosen_logratio = pair.policy_chosen - pair.reference_chosen;
  const double rejected_logratio = pair.policy_rejected - pair.reference_rejected;
  PairLoss out;
  out.chosen_reward = beta * chosen_logratio;
  out.rejected_reward = beta * rejected_logratio;
  if (settings.loss == DpoLoss::sigmoid) {
    const double eps = settings.label_smoothing;
    const double x = beta * (chosen_logratio - rejected_logratio);
    out.loss = -(1 - eps) * log_sigmoid(x) - eps * log_sigmoid(-x);
    // d/dx: −(1 − ε) σ(−x) + ε σ(x); z = x / β moves with +policy_chosen and −policy_rejected.
    const double d_x = -(1 - eps) * sigmoid_of_minus(x) + eps * sigmoid_of_minus(-x);
    out.d_policy_chosen = beta * d_x;
    out.d_policy_rejected = -beta * d_x;
  } else {
    // TRL divides by the completion's token count clamped to at least 1.
    const auto chosen_n = static_cast<double>(std::max<int64_t>(pair.chosen_tokens, 1));
    const auto rejected_n = static_cast<double>(std::max<int64_t>(pair.rejected_tokens, 1));
    const double gap = chosen_logratio / chosen_n - rejected_logratio / rejected_n - 1 / (2 * beta);
    out.loss = gap * gap;
    out.d_policy_chosen = 2 * gap / chosen_n;
    out.d_policy_rejected = -2 * gap / rejected_n;
  }
  return out;
}

}  // namespace meshtrain
