#include "meshtrain/parallel/layout/shard_map.h"

#include <algorithm>

#include "meshtrain/util/error.h"

namespace meshtrain::layout {

int64_t Region::box_numel() const {
  int64_t n = 1;
  for (int64_t e : extent) n *= e;
  return n;
}

const Shape& region_shape(const Shape& tensor_shape, const Region& region) {
  return region.view.empty() ? tensor_shape : region.view;
}

Region whole_region(const Shape& shape) {
  Region r;
  r.offset.assign(shape.size(), 0);
  r.extent.assign(shape.begin(), shape.end());
  r.flat_end = r.box_numel();
  return r;
}

int64_t ShardMap::owned_numel() const {
  int64_t n = 0;
  for (const ShardPiece& p : pieces) n += p.replica == 0 ? p.region.numel() : 0;
  return n;
}

int64_t ShardMap::owned_state_numel() const {
  int64_t n = 0;
  for (const ShardPiece& p : pieces) {
    if (p.replica == 0) n += p.region.numel() * static_cast<int64_t>(tensors[p.tensor].states.size());
  }
  return n;
}

void ShardMap::validate() const {
  for (const ShardPiece& p : pieces) {
    MESHTRAIN_CHECK(p.tensor < tensors.size(), "shard map: piece of unknown tensor {}", p.tensor);
    const GlobalTensor& t = tensors[p.tensor];
    MESHTRAIN_CHECK(t.states.has(StateKind::master) && (t.states.bits & ~7) == 0,
                    "shard map: '{}': states must include master weights", t.name);
    const Region& r = p.region;
    const Shape& shape = region_shape(t.shape, r);
    MESHTRAIN_CHECK(shape_numel(shape) == shape_numel(t.shape),
                    "shard map: '{}': view {} of a tensor of shape {}", t.name, shape_str(shape),
                    shape_str(t.shape));
    MESHTRAIN_CHECK(r.offset.size() == shape.size() && r.extent.size() == shape.size(),
                    "shard map: '{}': region of rank {} for a view of rank {}", t.name,
                    r.offset.size(), shape.size());
    for (size_t d = 0; d < shape.size(); ++d) {
      MESHTRAIN_CHECK(r.offset[d] >= 0 && r.extent[d] > 0 && r.offset[d] + r.extent[d] <= shape[d],
                      "shard map: '{}': dimension {} region [{}, {}) outside [0, {})", t.name, d,
                      r.offset[d], r.offset[d] + r.extent[d], shape[d]);
    }
    MESHTRAIN_CHECK(0 <= r.flat_begin && r.flat_begin < r.flat_end && r.flat_end <= r.box_numel(),
                    "shard map: '{}': flat range [{}, {}) outside its box of {} elements", t.name,
                    r.flat_begin, r.flat_end, r.box_numel());
    MESHTRAIN_CHECK(p.local_offset >= 0 && p.local_offset + r.numel() <= local_numel,
                    "shard map: '{}': local range [{}, {}) outside the {} local elements", t.name,
                    p.local_offset, p.local_offset + r.numel(), local_numel);
  }
}

ShardMap master_weights_only(ShardMap map) {
  for (GlobalTensor& t : map.tensors) t.states = StateSet::master_only();
  return map;
}

void for_each_global_run(const Shape& tensor_shape, const Region& region,
                         const std::function<void(int64_t, int64_t, int64_t)>& fn) {
  const Shape& shape = region_shape(tensor_shape, region);
  const size_t dims = shape.size();
  // Row-major strides of the global tensor.
  std::vector<int64_t> stride(dims, 1);
  for (size_t d = dims; d-- > 1;) stride[d - 1] = stride[d] * shape[d];
  // A run is contiguous in the global tensor over the trailing dimensions the
  // box covers in full, plus the first one it does not.
  int64_t run = 1;
  size_t outer = dims;  // dimensions [0, outer) step between runs
  while (outer > 0) {
    --outer;
    run *= region.extent[outer];
    if (region.extent[outer] != shape[outer]) break;
  }
  std::vector<int64_t> index(dims, 0);  // position of the current run's start in the box
  for (int64_t box = 0; box < region.flat_end; box += run) {
    const int64_t begin = std::max(box, region.flat_begin);
    const int64_t end = std::min(box + run, region.flat_end);
    if (begin < end) {
      int64_t global = 0;
      for (size_t d = 0; d < dims; ++d) global += (region.offset[d] + index[d]) * stride[d];
      fn(begin - region.flat_begin, global + (begin - box), end - begin);
    }
    // Next run: advance the odometer over dimensions [0, outer).
    for (size_t d = outer; d-- > 0;) {
      if (++index[d] < region.extent[d]) break;
      index[d] = 0;
    }
  }
}

Region narrow_region(const Region& region, int64_t begin, int64_t end) {
  MESHTRAIN_CHECK(0 <= begin && begin < end && end <= region.numel(),
                  "shard map: narrowing [{}, {}) of a region of {} elements", begin, end,
                  region.numel());
  Region r = region;
  r.flat_begin = region.flat_begin + begin;
  r.flat_end = region.flat_begin + end;
  return r;
}

const char* state_kind_name(StateKind kind) {
  switch (kind) {
    case StateKind::master: return "master";
    case StateKind::exp_avg: return "exp_avg";
    case StateKind::exp_avg_sq: return "exp_avg_sq";
  }
  return "?";
}

std::string state_set_str(StateSet states) {
  std::string out;
  for (size_t k = 0; k < kStateKinds; ++k) {
    if (!states.has(static_cast<StateKind>(k))) continue;
    out += (out.empty() ? "" : ", ") + std::string(state_kind_name(static_cast<StateKind>(k)));
  }
  return out;
}

}  // namespace meshtrain::layout
