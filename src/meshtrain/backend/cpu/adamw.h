// AdamW update (decoupled weight decay, bias correction) and the reductions
// the optimizer needs. All state is f32.
#pragma once

#include <cstdint>

#include "meshtrain/tensor/dtype.h"

namespace meshtrain::cpu {

struct AdamWHyper {
  float lr = 0, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0;
  int64_t step = 1;        // 1-based, for bias correction
  float grad_scale = 1.0f; // multiplies the gradient first (clipping)
};

// p -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * p), with m, v updated from grad * grad_scale.
// When compute != nullptr, also writes the updated parameter there as bf16.
void adamw_update(const AdamWHyper& hyper, float* param, const float* grad, float* m, float* v,
                  bf16* compute, int64_t n);

// sum of x[i]^2 in double, deterministic for a given n (fixed blocking, any thread count).
double sum_squares(const float* x, int64_t n);

}  // namespace meshtrain::cpu
