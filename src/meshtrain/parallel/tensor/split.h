// How a parameter is divided over the tensor-parallel (tp) ranks: the split
// arithmetic shared by the model registry, initialisation and checkpoints.
//
// A split cuts one dimension (rows = dim 0, cols = dim 1; a vector uses rows)
// of the global tensor. That dimension holds `parts` equal blocks (GPT-2's
// c_attn: q|k|v, parts = 3; otherwise 1); each block is cut into `size`
// contiguous chunks of ceil(block / size) and rank r holds chunk r of every
// block, in block order. When the block does not divide (the vocabulary), the
// last chunks are padded: padding elements map to no global element, hold
// zeros and get zero gradients.
//
// Invariants: every global element lies in exactly one rank's slice; a
// replicated parameter (kind none) is the whole tensor on every rank.
#pragma once

#include <cstdint>
#include <functional>

#include "meshtrain/parallel/layout/shard_map.h"
#include "meshtrain/tensor/tensor.h"

namespace meshtrain {

enum class SplitKind { none, rows, cols };

struct TensorSplit {
  SplitKind kind = SplitKind::none;
  Shape global_shape;  // as Hugging Face stores the tensor
  int parts = 1;
  int rank = 0, size = 1;

  bool split() const { return kind != SplitKind::none && size > 1; }
  int dim() const { return kind == SplitKind::cols ? 1 : 0; }
  // Elements of the split dimension per chunk (= per rank and block).
  int64_t chunk() const;
  // Elements of the split dimension that are real (not padding) in this rank's chunk of a block.
  int64_t chunk_valid() const;
  Shape local_shape() const;
  int64_t local_numel() const { return shape_numel(local_shape()); }
  // The same split as seen by another rank.
  TensorSplit for_rank(int r) const;
};

// Contiguous runs of this rank's slice in the flattened (row-major) local and
// global tensors: fn(local_offset, global_offset, count). Padding is skipped.
void for_each_local_run(const TensorSplit& split,
                        const std::function<void(int64_t, int64_t, int64_t)>& fn);

// The layout narrowing of tensor parallelism: this rank's slice as regions of
// the global tensor, each stored contiguously in the local tensor from
// `local_offset` (elements). One region per slice when the chunks are full
// (a fused tensor's blocks through a view [.., parts, block, ..]); padded
// chunks (the vocabulary) give their valid part. Replicated: the whole tensor.
struct LocalRegion {
  layout::Region region;
  int64_t local_offset = 0;
};
std::vector<LocalRegion> split_regions(const TensorSplit& split);

// local = this rank's slice of global (padding zeroed).
void copy_global_to_local(const TensorSplit& split, const float* global, float* local);
// global gets this rank's slice from local.
void copy_local_to_global(const TensorSplit& split, const float* local, float* global);

}  // namespace meshtrain
