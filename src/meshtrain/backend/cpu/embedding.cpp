#include "meshtrain/backend/cpu/embedding.h"

#include <omp.h>

#include <algorithm>
#include <cstring>

namespace meshtrain::cpu {

void embedding_forward(const float* table, const float* positions, const int32_t* ids, float* out,
                       int64_t batch, int64_t seq, int64_t dim, int64_t pos0,
                       const int32_t* pos_ids) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < batch * seq; ++i) {
    const float* row = table + static_cast<int64_t>(ids[i]) * dim;
    float* o = out + i * dim;
    if (positions == nullptr) {
      std::memcpy(o, row, static_cast<size_t>(dim) * sizeof(float));
    } else {
      const float* p = positions + (pos_ids ? pos_ids[i] : pos0 + i % seq) * dim;
#pragma omp simd
      for (int64_t j = 0; j < dim; ++j) o[j] = row[j] + p[j];
    }
  }
}

void embedding_backward(const int32_t* ids, const float* dout, float* dtable, float* dpositions,
                        int64_t batch, int64_t seq, int64_t dim, int64_t vocab_begin,
                        int64_t vocab_end, const int32_t* pos_ids) {
  // Threads own disjoint column ranges and walk the tokens in order, so every
  // element is summed in token order whatever the thread count (no races).
  const int64_t tokens = batch * seq;
#pragma omp parallel
  {
    const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
    // Column ranges in multiples of 16 floats (one cache line).
    const int64_t lines = (dim + 15) / 16;
    const int64_t c0 = std::min(dim, lines * t / nt * 16);
    const int64_t c1 = std::min(dim, lines * (t + 1) / nt * 16);
    if (c0 < c1) {
      for (int64_t i = 0; i < tokens; ++i) {
        const float* d = dout + i * dim;
        const int64_t id = ids[i];
        if (id >= vocab_begin && id < vocab_end) {
          float* row = dtable + (id - vocab_begin) * dim;
#pragma omp simd
          for (int64_t j = c0; j < c1; ++j) row[j] += d[j];
        }
        if (dpositions != nullptr) {
          float* p = dpositions + (pos_ids ? pos_ids[i] : i % seq) * dim;
#pragma omp simd
          for (int64_t j = c0; j < c1; ++j) p[j] += d[j];
        }
      }
    }
  }
}

}  // namespace meshtrain::cpu
