// Feed-forward activations. Inputs are f32 matmul outputs; the results feed
// the next matmul and are written in its compute dtype.
#pragma once

#include <cstdint>

#include "meshtrain/tensor/dtype.h"

namespace meshtrain::cpu {

// gate_up: [rows, 2*hidden], each row = [gate (hidden) | up (hidden)].
// out[r, j] = silu(gate[r, j]) * up[r, j].
void swiglu_forward(const float* gate_up, DType out_dtype, void* out, int64_t rows, int64_t hidden);
// d_gate_up: [rows, 2*hidden] in grad_dtype (overwritten).
void swiglu_backward(const float* gate_up, const float* d_out, DType grad_dtype, void* d_gate_up,
                     int64_t rows, int64_t hidden);

// GELU, tanh approximation (GPT-2's).
void gelu_forward(const float* x, DType out_dtype, void* y, int64_t n);
// dx (grad_dtype, overwritten) = dy * gelu'(x).
void gelu_backward(const float* x, const float* dy, DType grad_dtype, void* dx, int64_t n);

// x += y (f32), threaded.
void add_inplace(float* x, const float* y, int64_t n);
// x *= y; x += a * b; out = residual + (y + bias[column]) (bias may be nullptr).
void mul_inplace(float* x, const float* y, int64_t n);
void add_product(float* x, const float* a, const float* b, int64_t n);
void residual_add(const float* residual, const float* y, const float* bias, float* out,
                  int64_t rows, int64_t n);
// One row of it: out[j] = residual[j] + (y[j] + bias[j]).
inline void residual_add_row(const float* __restrict residual, const float* __restrict y,
                             const float* __restrict bias, float* __restrict out, int64_t n) {
  if (bias == nullptr) {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) out[j] = residual[j] + y[j];
  } else {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) out[j] = residual[j] + (y[j] + bias[j]);
  }
}
// dbias[j] += sum_r dy[r, j]  (deterministic order)
void bias_backward(const float* dy, float* dbias, int64_t rows, int64_t n);

}  // namespace meshtrain::cpu
