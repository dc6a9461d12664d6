// AdamW update (decoupled weight decay, bias correction) and the reductions
// the optimizer needs. All state is f32.
#pragma once

#include <cstddef>
#include <cstdint>

#include "meshtrain/backend/ops.h"
#include "meshtrain/tensor/dtype.h"

namespace meshtrain::cpu {

using ops::AdamWHyper;

using ops::ComputeCopy;

// p -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * p), with m, v updated from grad * grad_scale.
// With a compute copy, also writes the updated parameter there; with
// hyper.clear_grad, leaves grad at 0.
void adamw_update(const AdamWHyper& hyper, float* param, float* grad, float* m, float* v,
                  ComputeCopy compute, int64_t n);

// sum of x[i]^2 in double, deterministic for a given n (fixed blocking, any thread count).
double sum_squares(const float* x, int64_t n);

}  // namespace meshtrain::cpu
