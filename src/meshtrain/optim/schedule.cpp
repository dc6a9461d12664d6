#include "meshtrain/optim/schedule.h"

#include <cmath>

#include "meshtrain/util/error.h"

namespace meshtrain {

LrDecay parse_lr_decay(std::string_view name) {
  if (name == "cosine") return LrDecay::cosine;
  if (name == "constant") return LrDecay::constant;
  fail("lr decay must be \"cosine\" or \"constant\", got \"{}\"", name);
}

float LrSchedule::at(int64_t step) const {
  // Warm-up: (step+1)/warmup of max_lr, so the first update is small but not
  // zero and step warmup-1 reaches max_lr (as llm.c).
  if (step < warmup_steps) {
    return static_cast<float>(static_cast<double>(max_lr) * static_cast<double>(step + 1) /
                              static_cast<double>(warmup_steps));
  }
  if (decay == LrDecay::constant) return max_lr;
  if (step >= total_steps) return min_lr;
  int64_t span = total_steps - warmup_steps;
  if (span <= 0) return min_lr;
  double progress = static_cast<double>(step - warmup_steps) / static_cast<double>(span);
  double coeff = 0.5 * (1.0 + std::cos(M_PI * progress));
  return static_cast<float>(min_lr + coeff * (static_cast<double>(max_lr) - min_lr));
}

}  // namespace meshtrain
