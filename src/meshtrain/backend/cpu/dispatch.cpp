#include "meshtrain/backend/cpu/dispatch.h"

#include <algorithm>
#include <vector>

#include "meshtrain/util/error.h"

namespace meshtrain::cpu {

void moe_sort(const ops::DispatchDims& d, const int32_t* indices, int32_t* slots, int32_t* rows,
              int32_t* counts) {
  ops::sort_slots(d, indices, slots, rows, counts);
}

void moe_capacity(const ops::DispatchDims& d, int64_t capacity, const float* weights,
                  const int32_t* counts, int32_t* slots, int32_t* rows, int32_t* kept) {
  ops::apply_capacity(d, capacity, weights, counts, slots, rows, kept);
}

void moe_permute(const ops::DispatchDims& d, const int32_t* slots, const float* x, DType out_dtype,
                 void* out) {
  const size_t row_bytes = static_cast<size_t>(d.dim) * dtype_size(out_dtype);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < d.slots(); ++r) {
    convert(DType::f32, x + slots[r] / d.top_k * d.dim, out_dtype,
            static_cast<char*>(out) + static_cast<size_t>(r) * row_bytes,
            static_cast<size_t>(d.dim));
  }
}

namespace {

// out[t] = sum over j (ascending) of w(t, j) * y[rows[t * top_k + j]], w = 1
// without weights: the permute's backward and the combine.
void gather_sum(const ops::DispatchDims& d, const int32_t* rows, const float* weights,
                const float* y, float* out) {
  const int64_t D = d.dim;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < d.tokens; ++t) {
    float* o = out + t * D;
    std::fill(o, o + D, 0.0f);
    for (int64_t j = 0; j < d.top_k; ++j) {
      if (rows[t * d.top_k + j] < 0) continue;  // dropped
      const float w = weights != nullptr ? weights[t * d.top_k + j] : 1.0f;
      const float* src = y + static_cast<int64_t>(rows[t * d.top_k + j]) * D;
      for (int64_t i = 0; i < D; ++i) o[i] += w * src[i];
    }
  }
}

}  // namespace

void moe_permute_backward(const ops::DispatchDims& d, const int32_t* rows, const float* d_out,
                          float* dx) {
  gather_sum(d, rows, nullptr, d_out, dx);
}

void moe_combine(const ops::DispatchDims& d, const int32_t* rows, const float* weights,
                 const float* y, float* out) {
  gather_sum(d, rows, weights, y, out);
}

void moe_combine_backward(const ops::DispatchDims& d, const int32_t* rows, const float* weights,
                          const float* y, const float* d_out, DType grad_dtype, void* d_y,
                          float* d_weights) {
  const int64_t D = d.dim;
  const size_t row_bytes = static_cast<size_t>(D) * dtype_size(grad_dtype);
#pragma omp parallel
  {
    std::vector<float> row(static_cast<size_t>(D));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < d.tokens; ++t) {
      const float* g = d_out + t * D;
      for (int64_t j = 0; j < d.top_k; ++j) {
        const int64_t s = t * d.top_k + j, r = rows[s];
        if (r < 0) {  // dropped: no gradient
          d_weights[s] = 0;
          continue;
        }
        const float w = weights[s];
        const float* src = y + r * D;
        float dot = 0;
        for (int64_t i = 0; i < D; ++i) {
          row[i] = w * g[i];
          dot += g[i] * src[i];
        }
        d_weights[s] = dot;
        convert(DType::f32, row.data(), grad_dtype,
                static_cast<char*>(d_y) + static_cast<size_t>(r) * row_bytes,
                static_cast<size_t>(D));
      }
    }
  }
}

}  // namespace meshtrain::cpu
