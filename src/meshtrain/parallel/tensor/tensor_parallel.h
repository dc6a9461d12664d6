// Tensor parallelism (Megatron-style) over a tp communicator: the context the
// model runs with, and the collectives it needs on row-major [rows, width]
// activations.
//
// Contract: every rank of the tp group holds the same tokens; a rank's
// activation shard under sequence parallelism is rows [rank * rows/tp,
// (rank + 1) * rows/tp) of the full [rows, width] tensor. All calls are
// collective over the tp group and must be issued in the same order on every
// member.
#pragma once

#include <cstdint>
#include <vector>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/parallel/tensor/split.h"

namespace meshtrain {

struct TensorParallel {
  Communicator* comm = nullptr;    // the tp group; nullptr means tp = 1
  bool sequence_parallel = false;  // norms and residual stream sharded along the rows

  int rank() const { return comm != nullptr ? comm->rank() : 0; }
  int size() const { return comm != nullptr ? comm->size() : 1; }
  bool active() const { return size() > 1; }
};

// In place: data = sum over the tp ranks (f32).
Work tp_all_reduce_sum_async(const TensorParallel& tp, float* data, int64_t count);
// In place: full [rows_per_rank * tp, width] gets every rank's rows; this
// rank's rows must already be at their slot.
Work tp_all_gather_rows_async(const TensorParallel& tp, void* full, int64_t rows_per_rank,
                              int64_t width, DType dtype);
// shard [rows_per_rank, width] = this rank's rows of the sum over ranks of full.
Work tp_reduce_scatter_rows_async(const TensorParallel& tp, const float* full, float* shard,
                                  int64_t rows_per_rank, int64_t width);
// The blocking forms.
inline void tp_all_reduce_sum(const TensorParallel& tp, float* data, int64_t count) {
  tp_all_reduce_sum_async(tp, data, count).wait();
}
inline void tp_all_gather_rows(const TensorParallel& tp, void* full, int64_t rows_per_rank,
                               int64_t width, DType dtype) {
  tp_all_gather_rows_async(tp, full, rows_per_rank, width, dtype).wait();
}
inline void tp_reduce_scatter_rows(const TensorParallel& tp, const float* full, float* shard,
                                   int64_t rows_per_rank, int64_t width) {
  tp_reduce_scatter_rows_async(tp, full, shard, rows_per_rank, width).wait();
}

// Whether this rank counts a parameter in whole-model sums (the gradient
// norm): its slice if split, a replicated parameter on tp rank 0 only.
inline bool tp_counts_once(const TensorParallel& tp, const TensorSplit& split) {
  return split.split() || tp.rank() == 0;
}
// In place: a double summed over the tp group.
double tp_sum(const TensorParallel& tp, double value);

// Flat layouts of a parameter list in registry order: "local" holds each
// parameter's tp slice (split.local_numel()), "full" the whole tensors
// (numel of global_shape), both packed without gaps.
int64_t local_flat_numel(const std::vector<TensorSplit>& splits);
int64_t full_flat_numel(const std::vector<TensorSplit>& splits);
// Collective: full (on every rank) = the tp group's local flats assembled;
// replicated parameters are taken from tp rank 0.
void gather_tp_flat(const TensorParallel& tp, const std::vector<TensorSplit>& splits,
                    const float* local, float* full);
// local = this rank's slices of full (no communication).
void scatter_tp_flat(const std::vector<TensorSplit>& splits, const float* full, float* local);

}  // namespace meshtrain
