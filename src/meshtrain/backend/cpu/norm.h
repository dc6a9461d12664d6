// RMSNorm (Llama) and LayerNorm (GPT-2), row-wise over the last dimension.
// Inputs are the f32 residual stream; outputs are written in `out_dtype` (the
// compute dtype of the matmul that consumes them). Backward ADDS into dx, so
// the residual branch's gradient can already be there (fused residual add),
// and adds into the weight/bias gradients.
#pragma once

#include <cstdint>

#include "meshtrain/backend/ops.h"
#include "meshtrain/tensor/dtype.h"

namespace meshtrain::cpu {

// y = x / sqrt(mean(x^2) + eps) * w; saves rstd[rows].
void rmsnorm_forward(const float* x, const float* w, DType out_dtype, void* y, float* rstd,
                     int64_t rows, int64_t dim, float eps);
void rmsnorm_backward(const float* x, const float* w, const float* rstd, const float* dy, float* dx,
                      float* dw, int64_t rows, int64_t dim);

// y = (x - mean) * rstd * w + b; saves mean[rows], rstd[rows].
void layernorm_forward(const float* x, const float* w, const float* b, DType out_dtype, void* y,
                       float* mean, float* rstd, int64_t rows, int64_t dim, float eps);
void layernorm_backward(const float* x, const float* w, const float* mean, const float* rstd,
                        const float* dy, float* dx, float* dw, float* db, int64_t rows, int64_t dim);

// Backend::residual_add_norm: sum = residual + (y + bias), then its norm.
void residual_add_norm(const float* residual, const float* y, const float* bias, float* sum,
                       const ops::NormArgs& norm, DType out_dtype, void* out, int64_t rows,
                       int64_t dim);

// Backend::group_rmsnorm_forward / _backward (ops::GroupNormDims).
void group_rmsnorm_forward(const ops::GroupNormDims& dims, float* x, const float* w, float* saved,
                           float* rstd);
void group_rmsnorm_backward(const ops::GroupNormDims& dims, const float* saved, const float* w,
                            const float* rstd, DType grad_dtype, void* dy, float* dw);

}  // namespace meshtrain::cpu
