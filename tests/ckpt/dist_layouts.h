// Simulated parallel layouts for the distributed checkpoint tests: hand-built
// ShardMaps of a few odd-sized tensors (dp ZeRO flat splits, tp rows / cols,
// replicas), an in-memory StateAccess, and helpers that run every rank's save
// on its own thread.
#pragma once

#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "meshtrain/ckpt/distributed.h"

namespace meshtrain::dist_test {

using layout::Region;
using layout::ShardMap;
using layout::ShardPiece;
using layout::StateKind;

inline constexpr StateKind kKinds[] = {StateKind::master, StateKind::exp_avg,
                                       StateKind::exp_avg_sq};

// The global tensors every layout cuts: 2-D and 1-D, no size even.
inline std::vector<layout::GlobalTensor> test_tensors(int64_t scale = 1) {
  return {{"model.embed.weight", {7 * scale, 5}, {}},
          {"model.norm.weight", {13 * scale}, {}},
          {"model.proj.weight", {9, 3 * scale}, {}}};
}

// The value of element i of tensor t in state `kind` at `step`: distinct everywhere.
inline float global_value(int64_t step, StateKind kind, size_t t, int64_t i) {
  return static_cast<float>(step) * 0.5f +
         static_cast<float>(static_cast<int>(kind) * 100000 + static_cast<int>(t) * 10000) +
         static_cast<float>(i) * 0.25f;
}

// One rank's local state space, one vector per StateKind.
class MemState : public layout::StateAccess {
 public:
  explicit MemState(int64_t numel, float fill = std::nanf("")) {
    for (auto& v : data) v.assign(static_cast<size_t>(numel), fill);
  }
  void read(StateKind kind, int64_t offset, int64_t count, float* out) override {
    const auto& v = data[static_cast<size_t>(kind)];
    EXPECT_LE(offset + count, static_cast<int64_t>(v.size()));
    std::memcpy(out, v.data() + offset, static_cast<size_t>(count) * 4);
  }
  void write(StateKind kind, int64_t offset, int64_t count, const float* in) override {
    auto& v = data[static_cast<size_t>(kind)];
    ASSERT_LE(offset + count, static_cast<int64_t>(v.size()));
    std::memcpy(v.data() + offset, in, static_cast<size_t>(count) * 4);
  }
  std::array<std::vector<float>, layout::kStateKinds> data;
};

struct Layout {
  std::string name;
  std::vector<ShardMap> ranks;
  int world() const { return static_cast<int>(ranks.size()); }
};

inline void add_piece(ShardMap& map, size_t tensor, Region region, int replica = 0) {
  const int64_t n = region.numel();
  map.pieces.push_back(ShardPiece{tensor, std::move(region), map.local_numel, replica});
  map.local_numel += n;
}

inline ShardMap empty_map(const std::vector<layout::GlobalTensor>& tensors) {
  ShardMap map;
  map.tensors = tensors;
  return map;
}

// [begin, end) of `n` split in `parts`, part p (the first parts one larger).
inline std::pair<int64_t, int64_t> split_range(int64_t n, int parts, int p) {
  const int64_t base = n / parts, extra = n % parts;
  const int64_t begin = p * base + std::min<int64_t>(p, extra);
  return {begin, begin + base + (p < extra ? 1 : 0)};
}

inline Layout single_layout(const std::vector<layout::GlobalTensor>& tensors) {
  Layout l{"single", {empty_map(tensors)}};
  for (size_t t = 0; t < tensors.size(); ++t)
    add_piece(l.ranks[0], t, layout::whole_region(tensors[t].shape));
  return l;
}

// Every rank holds everything; rank 0 is replica 0.
inline Layout replicated_layout(const std::vector<layout::GlobalTensor>& tensors, int world) {
  Layout l{"replicated", {}};
  for (int r = 0; r < world; ++r) {
    l.ranks.push_back(empty_map(tensors));
    for (size_t t = 0; t < tensors.size(); ++t) {
      add_piece(l.ranks[static_cast<size_t>(r)], t, layout::whole_region(tensors[t].shape), r);
    }
  }
  return l;
}

// tp over dimension `dim` of the 2-D tensors; 1-D tensors replicated (dim 0)
// or split (dim 1), like norms and row-parallel biases.
inline Layout tp_layout(const std::vector<layout::GlobalTensor>& tensors, int tp, size_t dim) {
  Layout l{dim == 0 ? "tp_rows" : "tp_cols", {}};
  for (int r = 0; r < tp; ++r) {
    ShardMap map = empty_map(tensors);
    for (size_t t = 0; t < tensors.size(); ++t) {
      const Shape& shape = tensors[t].shape;
      Region region = layout::whole_region(shape);
      if (shape.size() == 1 && dim == 0) {
        add_piece(map, t, region, r);
        continue;
      }
      const size_t d = shape.size() == 1 ? 0 : dim;
      auto [begin, end] = split_range(shape[d], tp, r);
      region.offset[d] = begin;
      region.extent[d] = end - begin;
      region.flat_end = region.box_numel();
      add_piece(map, t, region);
    }
    l.ranks.push_back(std::move(map));
  }
  return l;
}

// tp over fused tensors (GPT-2's c_attn [d, 3d] and its bias [3d]): the last
// dimension seen as [3, last / 3] (Region::view), each of the three blocks
// cut over tp in one box. Tensors whose last dimension does not split so are
// replicated.
inline Layout fused_tp_layout(const std::vector<layout::GlobalTensor>& tensors, int tp) {
  Layout l{"fused_tp", {}};
  for (int r = 0; r < tp; ++r) {
    ShardMap map = empty_map(tensors);
    for (size_t t = 0; t < tensors.size(); ++t) {
      const Shape& shape = tensors[t].shape;
      Region region = layout::whole_region(shape);
      if (shape.back() % 3 != 0 || shape.back() / 3 < tp) {
        add_piece(map, t, region, r);
        continue;
      }
      region.view = Shape(shape.begin(), shape.end() - 1);
      region.view.push_back(3);
      region.view.push_back(shape.back() / 3);
      region.offset.assign(region.view.size(), 0);
      region.extent = region.view;
      auto [begin, end] = split_range(region.view.back(), tp, r);
      region.offset.back() = begin;
      region.extent.back() = end - begin;
      region.flat_end = region.box_numel();
      add_piece(map, t, region);
    }
    l.ranks.push_back(std::move(map));
  }
  return l;
}

// ZeRO over dp on top of `base`: each base rank's local space cut into dp
// flat ranges; rank base_rank * dp + d holds range d (replicas stay replicas).
inline Layout zero_layout(const Layout& base, int dp) {
  Layout l{base.name + "+zero" + std::to_string(dp), {}};
  for (const ShardMap& b : base.ranks) {
    for (int d = 0; d < dp; ++d) {
      auto [begin, end] = split_range(b.local_numel, dp, d);
      ShardMap map = empty_map(b.tensors);
      for (const ShardPiece& p : b.pieces) {
        const int64_t lo = std::max(begin, p.local_offset);
        const int64_t hi = std::min(end, p.local_offset + p.region.numel());
        if (lo >= hi) continue;
        add_piece(map, p.tensor,
                  layout::narrow_region(p.region, lo - p.local_offset, hi - p.local_offset),
                  p.replica);
      }
      l.ranks.push_back(std::move(map));
    }
  }
  return l;
}

// Every layout of the tests, each holding all of `tensors`.
inline std::vector<Layout> all_layouts(const std::vector<layout::GlobalTensor>& tensors) {
  std::vector<Layout> out;
  out.push_back(single_layout(tensors));
  out.push_back(zero_layout(single_layout(tensors), 2));
  out.push_back(tp_layout(tensors, 2, 0));
  out.push_back(tp_layout(tensors, 2, 1));
  out.push_back(replicated_layout(tensors, 2));
  out.push_back(zero_layout(tp_layout(tensors, 2, 1), 2));
  out.push_back(zero_layout(tp_layout(tensors, 3, 0), 2));
  return out;
}

// The global values of `step` placed into one rank's local space.
inline MemState state_for(const ShardMap& map, int64_t step) {
  MemState state(map.local_numel);
  for (const ShardPiece& p : map.pieces) {
    layout::for_each_global_run(map.tensors[p.tensor].shape, p.region,
                                [&](int64_t r, int64_t g, int64_t n) {
                                  for (StateKind kind : kKinds) {
                                    auto& v = state.data[static_cast<size_t>(kind)];
                                    for (int64_t i = 0; i < n; ++i) {
                                      v[static_cast<size_t>(p.local_offset + r + i)] =
                                          global_value(step, kind, p.tensor, g + i);
                                    }
                                  }
                                });
  }
  return state;
}

// Bit-exact check of every piece of `map` (the states its tensors have)
// against the global values of `step`.
inline ::testing::AssertionResult matches_step(const ShardMap& map, const MemState& state,
                                               int64_t step) {
  for (const ShardPiece& p : map.pieces) {
    int64_t bad = -1;
    StateKind bad_kind = StateKind::master;
    layout::for_each_global_run(
        map.tensors[p.tensor].shape, p.region, [&](int64_t r, int64_t g, int64_t n) {
          for (StateKind kind : kKinds) {
            if (!map.tensors[p.tensor].states.has(kind)) continue;  // frozen: no moments
            const auto& v = state.data[static_cast<size_t>(kind)];
            for (int64_t i = 0; i < n && bad < 0; ++i) {
              const float want = global_value(step, kind, p.tensor, g + i);
              const float got = v[static_cast<size_t>(p.local_offset + r + i)];
              if (std::memcmp(&want, &got, 4) != 0) {
                bad = g + i;
                bad_kind = kind;
              }
            }
          }
        });
    if (bad >= 0) {
      return ::testing::AssertionFailure()
             << map.tensors[p.tensor].name << " " << layout::state_kind_name(bad_kind)
             << ": element " << bad << " differs from step " << step;
    }
  }
  return ::testing::AssertionSuccess();
}

inline nlohmann::json layout_json(const Layout& l) {
  return {{"name", l.name}, {"world", l.world()}};
}
inline nlohmann::json meta_json(int64_t step) {
  return {{"step", step}, {"seed", 1234}, {"data", {{"epoch", 0}, {"index", step * 8}}}};
}

// Every rank saves `step` of `l` on its own thread (sync savers), rank r
// counting into trackers[r] when given; returns rank 0's result.
inline std::string save_all(const std::string& out_dir, int64_t step, const Layout& l,
                            dist_ckpt::SaveOptions options = {},
                            std::vector<MemoryTracker>* trackers = nullptr) {
  std::vector<std::thread> threads;
  std::vector<std::string> results(static_cast<size_t>(l.world()));
  std::vector<std::string> errors(static_cast<size_t>(l.world()));
  for (int r = 0; r < l.world(); ++r) {
    threads.emplace_back([&, r] {
      try {
        dist_ckpt::SaveOptions o = options;
        o.rank = r;
        o.world = l.world();
        if (trackers != nullptr) o.tracker = &(*trackers)[static_cast<size_t>(r)];
        dist_ckpt::CheckpointSaver saver(out_dir, o);
        MemState state = state_for(l.ranks[static_cast<size_t>(r)], step);
        results[static_cast<size_t>(r)] = saver.save(step, l.ranks[static_cast<size_t>(r)], state,
                                                     layout_json(l), meta_json(step));
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < l.world(); ++r) EXPECT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
  return results[0];
}

}  // namespace meshtrain::dist_test
