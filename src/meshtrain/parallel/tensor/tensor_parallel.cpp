#include "meshtrain/parallel/tensor/tensor_parallel.h"

#include <vector>

#include "meshtrain/util/error.h"

namespace meshtrain {

Work tp_all_reduce_sum_async(const TensorParallel& tp, float* data, int64_t count) {
  if (!tp.active()) return Work();
  return tp.comm->all_reduce_async(data, count, CommDType::f32, ReduceOp::sum);
}

Work tp_all_gather_rows_async(const TensorParallel& tp, void* full, int64_t rows_per_rank,
                              int64_t width, DType dtype) {
  if (!tp.active()) return Work();
  const int64_t part = rows_per_rank * width;
  const void* mine = static_cast<const char*>(full) +
                     static_cast<size_t>(tp.rank() * part) * dtype_size(dtype);
  const std::vector<int64_t> counts(static_cast<size_t>(tp.size()), part);
  return tp.comm->all_gather_async(mine, full, counts, comm_dtype(dtype));
}

Work tp_reduce_scatter_rows_async(const TensorParallel& tp, const float* full, float* shard,
                                  int64_t rows_per_rank, int64_t width) {
  MESHTRAIN_CHECK(tp.active(), "tp_reduce_scatter_rows needs tp > 1");
  const std::vector<int64_t> counts(static_cast<size_t>(tp.size()), rows_per_rank * width);
  return tp.comm->reduce_scatter_async(full, shard, counts, CommDType::f32, ReduceOp::sum);
}

double tp_sum(const TensorParallel& tp, double value) {
  if (tp.active()) tp.comm->all_reduce(&value, 1, CommDType::f64, ReduceOp::sum);
  return value;
}

int64_t local_flat_numel(const std::vector<TensorSplit>& splits) {
  int64_t n = 0;
  for (const TensorSplit& s : splits) n += s.local_numel();
  return n;
}

int64_t full_flat_numel(const std::vector<TensorSplit>& splits) {
  int64_t n = 0;
  for (const TensorSplit& s : splits) n += shape_numel(s.global_shape);
  return n;
}

void gather_tp_flat(const TensorParallel& tp, const std::vector<TensorSplit>& splits,
                    const float* local, float* full) {
  const int64_t local_n = local_flat_numel(splits);
  std::vector<float> all(static_cast<size_t>(local_n * tp.size()));
  if (tp.active()) {
    tp.comm->all_gather(local, all.data(), local_n, CommDType::f32);
  } else {
    std::copy(local, local + local_n, all.begin());
  }
  int64_t local_offset = 0, full_offset = 0;
  for (const TensorSplit& s : splits) {
    const int ranks = s.split() ? tp.size() : 1;
    for (int r = 0; r < ranks; ++r) {
      copy_local_to_global(s.for_rank(r), all.data() + r * local_n + local_offset,
                           full + full_offset);
    }
    local_offset += s.local_numel();
    full_offset += shape_numel(s.global_shape);
  }
}

void scatter_tp_flat(const std::vector<TensorSplit>& splits, const float* full, float* local) {
  int64_t local_offset = 0, full_offset = 0;
  for (const TensorSplit& s : splits) {
    copy_global_to_local(s, full + full_offset, local + local_offset);
    local_offset += s.local_numel();
    full_offset += shape_numel(s.global_shape);
  }
}

}  // namespace meshtrain
