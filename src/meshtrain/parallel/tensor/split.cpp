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
