// The parallel layout as data: what this rank holds of every global tensor.
//
// A ShardMap lists, for one rank, every piece of training state it holds as
// a region of a global tensor (Megatron-Core's ShardedTensor: global name,
// global shape, a box [offset, offset + extent) per dimension, and within the
// box's row-major flattening the element range [flat_begin, flat_end)), and
// where that region lives in the rank's local state space (one contiguous
// run of local elements, starting at local_offset).
//
// The map is built by narrowing, one parallel module at a time, none knowing
// about the others: the model's registry (whole tensors at their flat
// offsets; a pipeline stage lists only its own parameters), then the
// tensor-parallel split (boxes of the tp slice; vocabulary padding belongs to
// no region), then the ZeRO shard (flat ranges of those boxes, local offsets
// in the shard space). Checkpoints, gathers and exports read the map; nobody
// rewrites the mapping by hand.
//
// Invariants:
// - Every region lies inside its tensor's global shape and holds
//   flat_end - flat_begin > 0 elements, stored contiguously in local order.
// - Over all ranks of a job, the pieces with replica == 0 cover every element
//   of every tensor exactly once: replica 0 is the one writer. Other
//   replicas (DDP copies, tp-replicated norms, the tied output layer on the
//   last pipeline stage) hold the same values and are not written.
// - The optimizer states (AdamW's exp_avg, exp_avg_sq) and the f32 master
//   weights share one map: they have the same layout on every rank. Which
//   states a tensor has is part of the map (GlobalTensor::states): a frozen
//   parameter (LoRA's base) has master weights only, so nobody saves, loads
//   or gathers moments it does not have.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "meshtrain/tensor/tensor.h"

namespace meshtrain::layout {

// The states a checkpoint holds, all in one ShardMap's layout.
enum class StateKind : uint8_t { master, exp_avg, exp_avg_sq };
inline constexpr size_t kStateKinds = 3;
const char* state_kind_name(StateKind kind);  // "master", "exp_avg", "exp_avg_sq"

// A set of StateKinds (bit 1 << kind).
struct StateSet {
  uint8_t bits = 0b111;  // all three: a trainable parameter
  bool has(StateKind kind) const { return (bits >> static_cast<int>(kind)) & 1; }
  size_t size() const { return static_cast<size_t>(has(StateKind::master)) +
                               has(StateKind::exp_avg) + has(StateKind::exp_avg_sq); }
  static StateSet master_only() { return StateSet{1}; }
  bool operator==(const StateSet&) const = default;
};
// "master, exp_avg, exp_avg_sq" (those held, in kind order).
std::string state_set_str(StateSet states);

struct Region {
  // The shape the box refers to: empty = the tensor's global shape, else a
  // reshaping of it with the same element count (GPT-2's fused c_attn
  // [d, 3d] seen as [d, 3, d], so a tp slice of its three blocks is one box).
  Shape view;
  std::vector<int64_t> offset, extent;  // the box, one entry per dimension of the view
  int64_t flat_begin = 0, flat_end = 0;  // within the box's row-major flattening
  int64_t box_numel() const;
  int64_t numel() const { return flat_end - flat_begin; }
};

// The shape region's box refers to (view, or the tensor's shape).
const Shape& region_shape(const Shape& tensor_shape, const Region& region);

// The whole tensor as one region.
Region whole_region(const Shape& shape);

struct GlobalTensor {
  std::string name;  // the registry name, e.g. "model.layers.3.self_attn.q_proj.weight"
  Shape shape;       // global shape (as Hugging Face stores the tensor)
  StateSet states;   // what is held for it: all three, or master only (frozen)
};

struct ShardPiece {
  size_t tensor = 0;  // index into ShardMap::tensors
  Region region;
  int64_t local_offset = 0;  // first local element of the region
  int replica = 0;           // 0: this rank is the one writer
};

struct ShardMap {
  std::vector<GlobalTensor> tensors;  // registry order
  std::vector<ShardPiece> pieces;     // ordered by tensor, then region
  int64_t local_numel = 0;            // size of the local state space (padding included)

  // Elements held with replica == 0.
  int64_t owned_numel() const;
  // Of those, summed over the states each tensor has: what a save writes.
  int64_t owned_state_numel() const;
  // Throws Error unless every piece satisfies the invariants above (inside its
  // tensor, non-empty, inside [0, local_numel)).
  void validate() const;
};

// The same map with master weights only for every tensor: what loading
// weights alone (init_from, exports, evaluation) reads and fills.
ShardMap master_weights_only(ShardMap map);

// Contiguous runs of a region in the global tensor (of shape `shape`; the
// region's view if it has one), in region order:
// fn(region_offset, global_flat_offset, count).
void for_each_global_run(const Shape& shape, const Region& region,
                         const std::function<void(int64_t, int64_t, int64_t)>& fn);

// A region's sub-range [begin, end) of its elements, as a region.
Region narrow_region(const Region& region, int64_t begin, int64_t end);

// Reads and writes this rank's local state space (f32), element ranges
// [local_offset, local_offset + count) of a ShardMap. Implemented by whoever
// owns the state (the flat model + AdamW, or ZeRO's shards and offload store).
class StateAccess {
 public:
  virtual ~StateAccess() = default;
  virtual void read(StateKind kind, int64_t local_offset, int64_t count, float* out) = 0;
  virtual void write(StateKind kind, int64_t local_offset, int64_t count, const float* in) = 0;
};

}  // namespace meshtrain::layout
