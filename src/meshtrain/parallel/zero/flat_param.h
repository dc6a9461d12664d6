// ZeRO's flat parameters: each model unit (embed, layers.<i>, head) split by
// compute dtype into at most two flat buffers, padded to a multiple of the
// data-parallel size and cut into equal contiguous shards.
//
// Invariants:
// - A flat parameter's members are registry parameters of one unit with one
//   compute dtype, in registry order and packed without gaps, so q|k|v and
//   gate|up stay adjacent (the model runs each group as one GEMM).
// - padded = round_up(numel, ranks), shard = padded / ranks; rank r of the
//   flat's group owns elements [r * shard, (r + 1) * shard). Padding holds
//   zeros and is never updated. The group is dp, or under expert parallelism
//   (expert_dp > 0) for routed experts' parameters (ParamSpec::expert, in
//   flats of their own) the expert-data-parallel group: ranks = expert_dp.
// - Flat parameters are ordered by unit, the f32 ("wide") group before the
//   compute dtype's (bf16 or f16, "narrow") one, then the unit's packed one;
//   every parameter is in exactly one.
// - QLoRA's NF4 base (ParamSpec::nf4) is in a packed flat per unit (`packed`,
//   frozen, dtype i32): its members are the weights' packed bytes
//   (nf4_layout(spec).bytes) counted in 4-byte words, sharded and gathered
//   like any frozen flat but never in the shard space of states (a packed
//   weight is not checkpoint state: zero/state_layout.cpp gives it no room).
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
  int64_t numel = 0;   // the parameter's elements (a packed flat's: its words)
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
  bool expert = false;       // the members' ParamSpec::expert (expert_dp > 0 only)
  bool packed = false;       // NF4 weights: elements are i32 words of packed bytes
  int ranks = 1;             // the group it is sharded over: dp or expert_dp
  std::vector<FlatMember> members;
  int64_t numel = 0, padded = 0, shard = 0;

  int64_t shard_begin(int rank) const { return static_cast<int64_t>(rank) * shard; }
  // Members intersected with rank's shard, in registry order.
  std::vector<ShardSegment> segments(int rank) const;
};

struct ZeroLayout {
  int dp = 1;
  int expert_dp = 0;  // > 0: experts in their own flats, over this many ranks
  std::vector<FlatParam> flats;
  std::vector<std::vector<size_t>> unit_flats;  // unit -> indices into flats
  std::vector<size_t> param_flat;               // registry index -> index into flats
  std::vector<int64_t> param_offset;            // registry index -> offset in its flat

  int64_t padding() const;  // elements of padding, over all flat parameters
  // Data-parallel rank dp_rank's rank in flat `flat`'s group: itself, or for
  // an expert flat its rank in the expert-data-parallel group (comm/mesh.h:
  // dp_rank = edp_rank * ep + ep_rank).
  int group_rank(size_t flat, int dp_rank) const;
};

// expert_dp > 0 (expert parallelism): routed experts' parameters get flats
// of their own, sharded over expert_dp ranks (it must divide dp).
ZeroLayout make_zero_layout(const std::vector<ParamSpec>& specs,
                            const std::vector<ParamUnit>& units, Precision precision, int dp,
                            int expert_dp = 0);

}  // namespace meshtrain::zero
