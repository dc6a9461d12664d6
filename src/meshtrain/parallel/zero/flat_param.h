// ZeRO's flat parameters: each model unit (embed, layers.<i>, head) split by
// compute dtype into at most two flat buffers, padded to a multiple of the
// data-parallel size and cut into equal contiguous shards.
//
// Invariants:
// - A flat parameter's members are registry parameters of one unit with one
//   compute dtype, in registry order and packed without gaps, so q|k|v and
//   gate|up stay adjacent (the model runs each group as one GEMM).
// - padded = round_up(numel, dp), shard = padded / dp; rank r owns elements
//   [r * shard, (r + 1) * shard). Padding holds zeros and is never updated.
// - Flat parameters are ordered by unit, the f32 ("wide") group before the
//   compute dtype's (bf16 or f16, "narrow") one; every parameter is in exactly one.
// - Trainable and frozen parameters (ParamSpec::trainable; LoRA's base) are in
//   separate flat parameters (per unit and dtype: the trainable, then the
//   frozen). A frozen flat has values only: no gradients, master or optimizer
//   shard.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "meshtrain/model/params.h"

namespace meshtrain::zero {

struct FlatMember {
  size_t param = 0;    // registry index
  int64_t offset = 0;  // first element within the flat parameter
  int64_t numel = 0;
};

// The part of one parameter that lies in one rank's shard.
struct ShardSegment {
  size_t param = 0;          // registry index
  int64_t shard_offset = 0;  // first element within the shard
  int64_t param_offset = 0;  // first element within the parameter
  int64_t numel = 0;
};

struct FlatParam {
  size_t unit = 0;
  DType dtype = DType::f32;  // the members' compute dtype
  bool trainable = true;     // the members' ParamSpec::trainable
  std::vector<FlatMember> members;
  int64_t numel = 0, padded = 0, shard = 0;

  int64_t shard_begin(int rank) const { return static_cast<int64_t>(rank) * shard; }
  // Members intersected with rank's shard, in registry order.
  std::vector<ShardSegment> segments(int rank) const;
};

struct ZeroLayout {
  int dp = 1;
  std::vector<FlatParam> flats;
  std::vector<std::vector<size_t>> unit_flats;  // unit -> indices into flats
  std::vector<size_t> param_flat;               // registry index -> index into flats
  std::vector<int64_t> param_offset;            // registry index -> offset in its flat

  int64_t padding() const;  // elements of padding, over all flat parameters
};

ZeroLayout make_zero_layout(const std::vector<ParamSpec>& specs,
                            const std::vector<ParamUnit>& units, Precision precision, int dp);

}  // namespace meshtrain::zero
