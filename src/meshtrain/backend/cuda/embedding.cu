// Token (and learned position) embeddings; the backward adds gradient rows
// grouped by destination row, each group in token order: no atomics, the same
// sums as the CPU backend's loop over tokens.
#include "meshtrain/backend/cuda/device.cuh"

namespace meshtrain::cuda {
namespace {

template <typename E>
__global__ void embedding_forward_kernel(EmbeddingShape e, const typename E::T* table,
                                         const float* positions, const int32_t* ids, float* out) {
  MESHTRAIN_GRID_STRIDE(idx, e.batch * e.seq * e.dim) {
    const int64_t i = idx / e.dim, d = idx % e.dim;
    const int64_t id = ids[i];
    float value = 0.0f;
    if (id >= e.vocab_begin && id < e.vocab_end) value = E::load(table[(id - e.vocab_begin) * e.dim + d]);
    if (positions != nullptr) {
      const int64_t p = e.pos_ids != nullptr ? e.pos_ids[i] : e.pos0 + i % e.seq;
      value += positions[p * e.dim + d];
    }
    out[idx] = value;
  }
}

// Block g adds its tokens' rows to row rows[g]; threads over the columns.
__global__ void add_rows_kernel(const int32_t* order, const int32_t* starts, const int32_t* rows,
                                const float* dout, int64_t dim, float* table) {
  const int64_t g = blockIdx.x;
  float* dst = table + static_cast<int64_t>(rows[g]) * dim;
  for (int64_t d = threadIdx.x; d < dim; d += kThreads) {
    float acc = dst[d];
    for (int32_t k = starts[g]; k < starts[g + 1]; ++k) acc += dout[static_cast<int64_t>(order[k]) * dim + d];
    dst[d] = acc;
  }
}

}  // namespace

void launch_embedding_forward(cudaStream_t s, const EmbeddingShape& e, const void* table,
                              Elem table_dtype, const float* positions, const int32_t* ids,
                              float* out) {
  const int64_t n = e.batch * e.seq * e.dim;
  if (n == 0) return;
  with_elem(table_dtype, [&](auto tag) {
    using E = decltype(tag);
    embedding_forward_kernel<E><<<blocks_for(n), kThreads, 0, s>>>(
        e, static_cast<const typename E::T*>(table), positions, ids, out);
  });
  check_launch("embedding_forward");
}

void launch_add_rows(cudaStream_t s, const int32_t* order, const int32_t* starts,
                     const int32_t* rows, int64_t groups, const float* dout, int64_t dim,
                     float* table) {
  if (groups == 0) return;
  add_rows_kernel<<<static_cast<unsigned>(groups), kThreads, 0, s>>>(order, starts, rows, dout,
                                                                     dim, table);
  check_launch("embedding_backward");
}

}  // namespace meshtrain::cuda
