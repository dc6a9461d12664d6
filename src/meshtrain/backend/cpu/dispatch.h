// Token dispatch to the experts and the weighted combine on the CPU
// (ops::DispatchDims; the contracts are Backend's).
#pragma once

#include <cstdint>

#include "meshtrain/backend/ops.h"
#include "meshtrain/tensor/dtype.h"

namespace meshtrain::cpu {

void moe_sort(const ops::DispatchDims& dims, const int32_t* indices, int32_t* slots, int32_t* rows,
              int32_t* counts);
void moe_capacity(const ops::DispatchDims& dims, int64_t capacity, const float* weights,
                  const int32_t* counts, int32_t* slots, int32_t* rows, int32_t* kept);
void moe_permute(const ops::DispatchDims& dims, const int32_t* slots, const float* x,
                 DType out_dtype, void* out);
void moe_permute_backward(const ops::DispatchDims& dims, const int32_t* rows, const float* d_out,
                          float* dx);
void moe_combine(const ops::DispatchDims& dims, const int32_t* rows, const float* weights,
                 const float* y, float* out);
void moe_combine_backward(const ops::DispatchDims& dims, const int32_t* rows, const float* weights,
                          const float* y, const float* d_out, DType grad_dtype, void* d_y,
                          float* d_weights);

}  // namespace meshtrain::cpu
