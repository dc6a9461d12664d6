#include "meshtrain/parallel/tensor/vocab_parallel.h"

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

}  // namespace meshtrain
