// AdamW update (decoupled weight decay, bias correction) and the reductions
// the optimizer needs. All state is f32.
#pragma once

#include <cstddef>
#include <cstdint>

#include "meshtrain/tensor/dtype.h"

namespace meshtrain::cpu {

struct AdamWHyper {
  float lr = 0, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0;
  int64_t step = 1;        // 1-based, for bias correction
  float grad_scale = 1.0f; // multiplies the gradient first (clipping)
};

// Where the update also writes the parameter in the compute dtype: bf16 or
// f16 compute copies in mixed precision, none (nullptr) in fp32.
struct ComputeCopy {
  ComputeCopy(std::nullptr_t = nullptr) {}
  ComputeCopy(bf16* p) : data(p), dtype(DType::bf16) {}
  ComputeCopy(f16* p) : data(p), dtype(DType::f16) {}
  ComputeCopy(void* p, DType d) : data(d == DType::f32 ? nullptr : p), dtype(d) {}
  void* data = nullptr;
  DType dtype = DType::bf16;
};

// p -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * p), with m, v updated from grad * grad_scale.
// With a compute copy, also writes the updated parameter there.
void adamw_update(const AdamWHyper& hyper, float* param, const float* grad, float* m, float* v,
                  ComputeCopy compute, int64_t n);

// sum of x[i]^2 in double, deterministic for a given n (fixed blocking, any thread count).
double sum_squares(const float* x, int64_t n);

}  // namespace meshtrain::cpu
