#include "meshtrain/parallel/tensor/split.h"

#include <cstring>

#include "meshtrain/util/error.h"

namespace meshtrain {

namespace {

int64_t block_extent(const TensorSplit& s) {
  MESHTRAIN_CHECK(static_cast<size_t>(s.dim()) < s.global_shape.size() && s.parts > 0 &&
                      s.global_shape[static_cast<size_t>(s.dim())] % s.parts == 0,
                  "tensor split: shape {} cannot be cut into {} blocks along dim {}",
                  shape_str(s.global_shape), s.parts, s.dim());
  return s.global_shape[static_cast<size_t>(s.dim())] / s.parts;
}

}  // namespace

int64_t TensorSplit::chunk() const {
  const int64_t block = block_extent(*this);
  return (block + size - 1) / size;
}

int64_t TensorSplit::chunk_valid() const {
  const int64_t block = block_extent(*this), c = chunk();
  const int64_t begin = static_cast<int64_t>(rank) * c;
  return begin >= block ? 0 : (begin + c <= block ? c : block - begin);
}

Shape TensorSplit::local_shape() const {
  if (!split()) return global_shape;
  Shape s = global_shape;
  s[static_cast<size_t>(dim())] = parts * chunk();
  return s;
}

TensorSplit TensorSplit::for_rank(int r) const {
  TensorSplit s = *this;
  s.rank = r;
  return s;
}

void for_each_local_run(const TensorSplit& s,
                        const std::function<void(int64_t, int64_t, int64_t)>& fn) {
  if (!s.split()) {
    fn(0, 0, shape_numel(s.global_shape));
    return;
  }
  const int64_t block = block_extent(s), chunk = s.chunk(), valid = s.chunk_valid();
  const int64_t begin = static_cast<int64_t>(s.rank) * chunk;
  const int64_t local_extent = s.parts * chunk;
  // rows: each valid local row is a run of `inner` elements; cols: each row of
  // the tensor holds `parts` runs of `valid` columns.
  const int64_t inner = s.global_shape.size() > 1 ? shape_numel(s.global_shape) / s.global_shape[0]
                                                   : 1;
  if (s.kind == SplitKind::rows) {
    for (int64_t p = 0; p < s.parts; ++p) {
      if (valid == 0) continue;
      fn(p * chunk * inner, (p * block + begin) * inner, valid * inner);
    }
    return;
  }
  const int64_t rows = s.global_shape[0], cols = s.global_shape[1];
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t p = 0; p < s.parts; ++p) {
      if (valid == 0) continue;
      fn(r * local_extent + p * chunk, r * cols + p * block + begin, valid);
    }
  }
}

std::vector<LocalRegion> split_regions(const TensorSplit& s) {
  if (!s.split()) return {{layout::whole_region(s.global_shape), 0}};
  const int64_t block = block_extent(s), chunk = s.chunk(), valid = s.chunk_valid();
  if (valid == 0) return {};
  // The view puts the blocks in their own dimension: rows [parts, block, ..],
  // cols [rows, parts, block]; the local tensor is the same view with chunk
  // in place of block.
  size_t split_dim = s.kind == SplitKind::rows ? 1 : 2;
  Shape view;
  if (s.parts == 1) {  // no fused blocks: the tensor's own shape
    split_dim = static_cast<size_t>(s.dim());
    view = s.global_shape;
  } else if (s.kind == SplitKind::rows) {
    view = {s.parts, block};
    view.insert(view.end(), s.global_shape.begin() + 1, s.global_shape.end());
  } else {
    MESHTRAIN_CHECK(s.global_shape.size() == 2, "tensor split: column split of shape {}",
                    shape_str(s.global_shape));
    view = {s.global_shape[0], s.parts, block};
  }
  layout::Region box;
  if (s.parts > 1) box.view = view;
  box.offset.assign(view.size(), 0);
  box.extent.assign(view.begin(), view.end());
  box.offset[split_dim] = static_cast<int64_t>(s.rank) * chunk;
  box.extent[split_dim] = valid;
  box.flat_end = box.box_numel();
  if (valid == chunk) return {{box, 0}};
  // A padded chunk: its valid part is contiguous locally only within one
  // index of the dimensions before the split one.
  Shape local = view;
  local[split_dim] = chunk;
  int64_t inner = 1;  // local elements per index of the outer dimensions
  for (size_t d = split_dim; d < local.size(); ++d) inner *= local[d];
  int64_t outer = 1;
  for (size_t d = 0; d < split_dim; ++d) outer *= view[d];
  std::vector<LocalRegion> regions;
  for (int64_t o = 0; o < outer; ++o) {
    layout::Region r = box;
    int64_t rest = o;
    for (size_t d = split_dim; d-- > 0;) {
      r.offset[d] = rest % view[d];
      r.extent[d] = 1;
      rest /= view[d];
    }
    r.flat_end = r.box_numel();
    regions.push_back({std::move(r), o * inner});
  }
  return regions;
}

void copy_global_to_local(const TensorSplit& split, const float* global, float* local) {
  std::memset(local, 0, static_cast<size_t>(split.local_numel()) * sizeof(float));
  for_each_local_run(split, [&](int64_t l, int64_t g, int64_t n) {
    std::memcpy(local + l, global + g, static_cast<size_t>(n) * sizeof(float));
  });
}

void copy_local_to_global(const TensorSplit& split, const float* local, float* global) {
  for_each_local_run(split, [&](int64_t l, int64_t g, int64_t n) {
    std::memcpy(global + g, local + l, static_cast<size_t>(n) * sizeof(float));
  });
}

}  // namespace meshtrain
