// ZeRO's narrowing of the layout and its shard space as a StateAccess.
#include <algorithm>

#include "meshtrain/parallel/zero/sharded.h"
#include "meshtrain/util/error.h"

namespace meshtrain::zero {

namespace {

std::vector<int64_t> shard_bases_of(const ZeroLayout& layout) {
  std::vector<int64_t> bases;
  int64_t base = 0;
  for (const FlatParam& fp : layout.flats) {
    bases.push_back(base);
    if (!fp.packed) base += fp.shard;  // packed NF4 bytes are not state
  }
  bases.push_back(base);
  return bases;
}

}  // namespace

std::vector<int64_t> ShardedDataParallel::shard_bases() const { return shard_bases_of(layout_); }

layout::ShardMap narrow_to_shard(const ZeroLayout& layout, const std::vector<int64_t>& param_offsets,
                                 const layout::ShardMap& model_map, int rank) {
  const std::vector<int64_t> bases = shard_bases_of(layout);
  layout::ShardMap map;
  map.tensors = model_map.tensors;
  map.local_numel = bases.back();
  for (const layout::ShardPiece& piece : model_map.pieces) {
    // The parameter whose flat range holds the piece (params are in offset order).
    auto it = std::upper_bound(param_offsets.begin(), param_offsets.end(), piece.local_offset);
    MESHTRAIN_CHECK(it != param_offsets.begin(), "zero: piece at local offset {} before every parameter",
                    piece.local_offset);
    const auto i = static_cast<size_t>(std::prev(it) - param_offsets.begin());
    const FlatParam& fp = layout.flats[layout.param_flat[i]];
    const int64_t shard_begin = fp.shard_begin(layout.group_rank(layout.param_flat[i], rank));
    // The piece's elements in the flat parameter, cut to this rank's shard.
    const int64_t first = layout.param_offset[i] + (piece.local_offset - param_offsets[i]);
    const int64_t lo = std::max(first, shard_begin);
    const int64_t hi = std::min(first + piece.region.numel(), shard_begin + fp.shard);
    if (lo >= hi) continue;
    layout::ShardPiece narrowed = piece;
    narrowed.region = layout::narrow_region(piece.region, lo - first, hi - first);
    narrowed.local_offset = bases[layout.param_flat[i]] + (lo - shard_begin);
    map.pieces.push_back(std::move(narrowed));
  }
  return map;
}

layout::ShardMap ShardedDataParallel::shard_map(const layout::ShardMap& model_map) const {
  std::vector<int64_t> offsets;
  for (const Parameter& p : model_.params()) offsets.push_back(p.offset);
  return narrow_to_shard(layout_, offsets, model_map, rank_);
}

void ShardedDataParallel::access_shard_space(int64_t offset, int64_t count,
                                             const std::function<void(size_t, int64_t, int64_t, int64_t)>& fn) const {
  const std::vector<int64_t> bases = shard_bases();
  MESHTRAIN_CHECK(offset >= 0 && count >= 0 && offset + count <= bases.back(),
                  "zero: shard-space range [{}, {}) outside the {} local elements", offset,
                  offset + count, bases.back());
  int64_t done = 0;
  while (done < count) {
    const int64_t at = offset + done;
    const auto flat = static_cast<size_t>(std::upper_bound(bases.begin(), bases.end(), at) -
                                          bases.begin() - 1);
    const int64_t begin = at - bases[flat];
    const int64_t end = std::min(layout_.flats[flat].shard, begin + (count - done));
    fn(flat, begin, end, done);
    done += end - begin;
  }
}

void ShardedDataParallel::read(layout::StateKind kind, int64_t offset, int64_t count, float* out) {
  quiesce();
  access_shard_space(offset, count, [&](size_t flat, int64_t begin, int64_t end, int64_t done) {
    read_state(flat, kind, begin, end, out + done);
  });
}

void ShardedDataParallel::write(layout::StateKind kind, int64_t offset, int64_t count,
                                const float* in) {
  quiesce();
  access_shard_space(offset, count, [&](size_t flat, int64_t begin, int64_t end, int64_t done) {
    write_state(flat, kind, begin, end, in + done);
  });
}

void ShardedDataParallel::finish_load() {
  quiesce();
  if (options_.stage <= 2) all_gather_updated(true);
}

}  // namespace meshtrain::zero
