#include "meshtrain/backend/cpu/dispatch.h"

#include <algorithm>
#include <vector>

#include "meshtrain/util/error.h"

namespace meshtrain::cpu {

// A counting sort of the slots by expert: stable, so slot order within one.
void moe_sort(const ops::DispatchDims& d, const int32_t* indices, int32_t* slots, int32_t* rows,
              int32_t* counts) {
  const int64_t n = d.slots();
  std::fill(counts, counts + d.experts, 0);
  for (int64_t s = 0; s < n; ++s) {
    MESHTRAIN_CHECK(indices[s] >= 0 && indices[s] < d.experts,
                    "moe dispatch: token {} chose expert {}, outside [0, {})", s / d.top_k,
                    indices[s], d.experts);
    ++counts[indices[s]];
  }
  std::vector<int64_t> next(static_cast<size_t>(d.experts), 0);
  for (int64_t e = 1; e < d.experts; ++e) next[e] = next[e - 1] + counts[e - 1];
  for (int64_t s = 0; s < n; ++s) {
    const int64_t r = next[indices[s]]++;
    slots[r] = static_cast<int32_t>(s);
    rows[s] = static_cast<int32_t>(r);
  }
}

void moe_capacity(const ops::DispatchDims& d, int64_t capacity, const float* weights,
                  const int32_t* counts, int32_t* slots, int32_t* rows, int32_t* kept) {
  MESHTRAIN_CHECK(capacity >= 0, "moe dispatch: capacity {} must be >= 0", capacity);
  const int64_t n = d.slots();
  std::vector<int32_t> order(slots, slots + n), dropped, segment;
  int64_t first = 0, out = 0;
  for (int64_t e = 0; e < d.experts; ++e) {
    const int64_t c = counts[e];
    segment.assign(order.begin() + first, order.begin() + first + c);
    if (c > capacity) {
      // The `capacity` highest weights (ties: the lower slot), back in slot order.
      std::stable_sort(segment.begin(), segment.end(),
                       [weights](int32_t a, int32_t b) { return weights[a] > weights[b]; });
      dropped.insert(dropped.end(), segment.begin() + capacity, segment.end());
      segment.resize(static_cast<size_t>(capacity));
      std::sort(segment.begin(), segment.end());
    }
    kept[e] = static_cast<int32_t>(segment.size());
    for (int32_t s : segment) {
      slots[out] = s;
      rows[s] = static_cast<int32_t>(out++);
    }
    first += c;
  }
  std::sort(dropped.begin(), dropped.end());
  for (int32_t s : dropped) {
    slots[out++] = s;
    rows[s] = -1;
  }
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
