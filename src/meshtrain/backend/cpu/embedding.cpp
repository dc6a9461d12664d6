#include "meshtrain/backend/cpu/embedding.h"

#include <omp.h>

#include <algorithm>
#include <cstring>

namespace meshtrain::cpu {

void embedding_forward(const EmbeddingDims& dims, const void* table, DType table_dtype,
                       const float* positions, const int32_t* ids, float* out) {
  const int64_t dim = dims.dim;
  const size_t row_bytes = static_cast<size_t>(dim) * dtype_size(table_dtype);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < dims.batch * dims.seq; ++i) {
    float* o = out + i * dim;
    if (dims.holds(ids[i])) {
      const char* row = static_cast<const char*>(table) +
                        static_cast<size_t>(ids[i] - dims.vocab_begin) * row_bytes;
      convert(table_dtype, row, DType::f32, o, static_cast<size_t>(dim));
    } else {
      std::memset(o, 0, static_cast<size_t>(dim) * sizeof(float));
    }
    if (positions == nullptr) continue;
    const float* p = positions + dims.position(i) * dim;
#pragma omp simd
    for (int64_t j = 0; j < dim; ++j) o[j] += p[j];
  }
}

void embedding_backward(const EmbeddingDims& dims, const int32_t* ids, const float* dout,
                        float* dtable, float* dpositions) {
  const int64_t dim = dims.dim;
  // Threads own disjoint column ranges and walk the tokens in order, so every
  // element is summed in token order whatever the thread count (no races).
  const int64_t tokens = dims.batch * dims.seq;
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
        if (dims.holds(ids[i])) {
          float* row = dtable + (ids[i] - dims.vocab_begin) * dim;
#pragma omp simd
          for (int64_t j = c0; j < c1; ++j) row[j] += d[j];
        }
        if (dpositions != nullptr) {
          float* p = dpositions + dims.position(i) * dim;
#pragma omp simd
          for (int64_t j = c0; j < c1; ++j) p[j] += d[j];
        }
      }
    }
  }
}

}  // namespace meshtrain::cpu
