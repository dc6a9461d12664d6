#include "meshtrain/optim/clip.h"

#include <cmath>

#include "meshtrain/backend/backend.h"

namespace meshtrain {

double global_grad_norm(const Model& model) {
  // Registry order, each parameter's sum in a fixed blocking: the same bits
  // for any thread count.
  double total = 0.0;
  for (const Parameter& p : model.params()) {
    if (!p.spec.trainable) continue;  // frozen: no gradient
    total += model.backend().sum_squares(p.grad.data<float>(), p.spec.numel());
  }
  return std::sqrt(total);
}

float clip_factor(double grad_norm, float max_norm) {
  if (max_norm <= 0.0f || !std::isfinite(grad_norm) || grad_norm <= max_norm) return 1.0f;
  // Same epsilon as torch.nn.utils.clip_grad_norm_.
  return static_cast<float>(static_cast<double>(max_norm) / (grad_norm + 1e-6));
}

}  // namespace meshtrain
