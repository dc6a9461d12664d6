// The layout as data: regions and their global runs, and the tensor-parallel
// narrowing (split_regions) against the split arithmetic the model uses.
#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "meshtrain/model/params.h"
#include "meshtrain/parallel/layout/shard_map.h"
#include "meshtrain/parallel/tensor/split.h"
#include "meshtrain/util/error.h"

namespace meshtrain {
namespace {

using layout::Region;

// Every element of `region` in region order, as global flat offsets.
std::vector<int64_t> global_offsets(const Shape& shape, const Region& region) {
  std::vector<int64_t> out(static_cast<size_t>(region.numel()), -1);
  layout::for_each_global_run(shape, region, [&](int64_t at, int64_t global, int64_t n) {
    for (int64_t i = 0; i < n; ++i) out[static_cast<size_t>(at + i)] = global + i;
  });
  return out;
}

TEST(Region, RunsOfABoxAndAFlatRange) {
  const Shape shape{4, 6};
  Region box;
  box.offset = {1, 2};
  box.extent = {2, 3};
  box.flat_begin = 1;
  box.flat_end = 5;  // box elements 1..4: (1,3) (1,4) (2,2) (2,3)
  EXPECT_EQ(global_offsets(shape, box), (std::vector<int64_t>{9, 10, 14, 15}));
  int runs = 0;
  layout::for_each_global_run(shape, box, [&](int64_t, int64_t, int64_t) { ++runs; });
  EXPECT_EQ(runs, 2);
  // Full rows: one run.
  Region rows = layout::whole_region({2, 6});
  rows.offset = {1, 0};
  rows.extent = {2, 6};
  rows.flat_end = 12;
  runs = 0;
  layout::for_each_global_run(shape, rows, [&](int64_t at, int64_t global, int64_t n) {
    ++runs;
    EXPECT_EQ(at, 0);
    EXPECT_EQ(global, 6);
    EXPECT_EQ(n, 12);
  });
  EXPECT_EQ(runs, 1);
}

TEST(Region, NarrowAndValidate) {
  layout::ShardMap map;
  map.tensors.push_back({"w", {3, 5}, {}});
  map.local_numel = 15;
  map.pieces.push_back({0, layout::narrow_region(layout::whole_region({3, 5}), 4, 11), 4, 0});
  map.validate();
  EXPECT_EQ(global_offsets({3, 5}, map.pieces[0].region),
            (std::vector<int64_t>{4, 5, 6, 7, 8, 9, 10}));
  map.pieces[0].local_offset = 10;  // runs past the local space
  EXPECT_THROW(map.validate(), Error);
}

// For every tp size and rank: the regions of each parameter's slice hold
// exactly the elements copy_global_to_local puts at those local offsets, and
// over the ranks they cover every global element once (padding in none).
void expect_regions_match_split(const ModelConfig& config, int tp) {
  const std::vector<ParamSpec> whole = build_param_specs(config);
  std::vector<std::vector<int>> covered(whole.size());
  for (size_t i = 0; i < whole.size(); ++i) covered[i].assign(static_cast<size_t>(whole[i].numel()), 0);
  for (int r = 0; r < tp; ++r) {
    const std::vector<ParamSpec> specs = build_param_specs(config, r, tp);
    ASSERT_EQ(specs.size(), whole.size());
    for (size_t i = 0; i < specs.size(); ++i) {
      const TensorSplit& split = specs[i].split;
      std::vector<float> global(static_cast<size_t>(whole[i].numel()));
      std::iota(global.begin(), global.end(), 0.0f);
      std::vector<float> local(static_cast<size_t>(split.local_numel()));
      copy_global_to_local(split, global.data(), local.data());
      for (const LocalRegion& lr : split_regions(split)) {
        const std::vector<int64_t> g = global_offsets(split.global_shape, lr.region);
        for (size_t k = 0; k < g.size(); ++k) {
          ASSERT_EQ(local[static_cast<size_t>(lr.local_offset) + k], static_cast<float>(g[k]))
              << specs[i].name << " tp " << tp << " rank " << r;
          // Replicated tensors are written by tp rank 0 only.
          if (split.split() || r == 0) ++covered[i][static_cast<size_t>(g[k])];
        }
      }
    }
  }
  for (size_t i = 0; i < whole.size(); ++i) {
    for (size_t k = 0; k < covered[i].size(); ++k) {
      ASSERT_EQ(covered[i][k], 1) << whole[i].name << " element " << k << " tp " << tp;
    }
  }
}

TEST(SplitRegions, CoverEveryElementOnceLlamaGqaOddVocab) {
  ModelConfig c = llama_shape(32, 2, 4, 2, 64, 61, 16, /*tied=*/false);
  for (int tp : {1, 2, 4}) expect_regions_match_split(c, tp);
}

TEST(SplitRegions, CoverEveryElementOnceGpt2FusedQkv) {
  ModelConfig c = gpt2_shape(32, 2, 4, 61, 16);
  for (int tp : {1, 2, 4}) expect_regions_match_split(c, tp);
}

TEST(SplitRegions, FusedBlocksAreOneRegionThroughAView) {
  TensorSplit s;
  s.kind = SplitKind::cols;
  s.global_shape = {8, 24};
  s.parts = 3;
  s.rank = 1;
  s.size = 2;
  const std::vector<LocalRegion> regions = split_regions(s);
  ASSERT_EQ(regions.size(), 1u);
  EXPECT_EQ(regions[0].region.view, (Shape{8, 3, 8}));
  EXPECT_EQ(regions[0].region.offset, (std::vector<int64_t>{0, 0, 4}));
  EXPECT_EQ(regions[0].region.extent, (std::vector<int64_t>{8, 3, 4}));
}

}  // namespace
}  // namespace meshtrain
