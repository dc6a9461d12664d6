#include "meshtrain/parallel/tensor/vocab_parallel.h"

#include <omp.h>

#include <algorithm>
#include <cstring>

namespace meshtrain {

void vocab_embedding_forward(const void* table, DType dtype, int64_t begin, int64_t end,
                             const int32_t* ids, int64_t rows, int64_t dim, float* out) {
  const size_t esize = dtype_size(dtype);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < rows; ++i) {
    float* o = out + i * dim;
    const int64_t id = ids[i];
    if (id < begin || id >= end) {
      std::memset(o, 0, static_cast<size_t>(dim) * sizeof(float));
      continue;
    }
    const void* row = static_cast<const char*>(table) + static_cast<size_t>((id - begin) * dim) * esize;
    convert(dtype, row, DType::f32, o, static_cast<size_t>(dim));
  }
}

void vocab_embedding_backward(const int32_t* ids, const float* dout, int64_t rows, int64_t dim,
                              int64_t begin, int64_t end, float* dtable, float* dpositions,
                              int64_t seq) {
#pragma omp parallel
  {
    const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t lines = (dim + 15) / 16;  // column ranges of whole cache lines
    const int64_t c0 = std::min(dim, lines * t / nt * 16);
    const int64_t c1 = std::min(dim, lines * (t + 1) / nt * 16);
    for (int64_t i = 0; c0 < c1 && i < rows; ++i) {
      const float* d = dout + i * dim;
      const int64_t id = ids[i];
      if (id >= begin && id < end) {
        float* row = dtable + (id - begin) * dim;
#pragma omp simd
        for (int64_t j = c0; j < c1; ++j) row[j] += d[j];
      }
      if (dpositions != nullptr) {
        float* p = dpositions + (i % seq) * dim;
#pragma omp simd
        for (int64_t j = c0; j < c1; ++j) p[j] += d[j];
      }
    }
  }
}

}  // namespace meshtrain
