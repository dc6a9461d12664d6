// Ulysses' layouts as copy lists (ops.h: head_group_copies,
// context_sequence_copies), the plans every backend runs with its own copy:
// their shape (one strided copy per group and part; one run per stretch of
// consecutive positions of a rank's sequence) and, run with memcpy, the CPU backend's
// permutation (the ops suite compares that with float64).
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <vector>

#include "meshtrain/backend/ops.h"

namespace meshtrain {
namespace {

void apply(const ops::CopyPlan& plan) {
  for (const ops::Copy2D& c : plan.copies) {
    for (int64_t r = 0; r < c.rows; ++r) {
      std::memcpy(static_cast<char*>(plan.dst) + c.dst_offset + r * c.dst_pitch,
                  static_cast<const char*>(plan.src) + c.src_offset + r * c.src_pitch,
                  static_cast<size_t>(c.bytes));
    }
  }
}

TEST(CopyPlans, HeadGroupsCopyEachPartsSliceOfEveryRowAndBack) {
  const ops::HeadGroups g{3, 2, {4, 2, 2}};  // q 4 wide, k and v 2 wide, 2 groups
  std::vector<int32_t> rows(3 * 8), groups(3 * 8, -1), back(3 * 8, -1);
  std::iota(rows.begin(), rows.end(), 0);
  const ops::CopyPlan plan = ops::head_group_copies(g, DType::i32, rows.data(), groups.data(), true);
  EXPECT_EQ(plan.copies.size(), 6u);  // groups x parts, each over every row
  apply(plan);
  // group 1, row 2: q columns 2..3, k column 5, v column 7 of row 2
  EXPECT_EQ(std::vector<int32_t>(groups.begin() + 12 + 8, groups.begin() + 12 + 12),
            (std::vector<int32_t>{18, 19, 21, 23}));
  apply(ops::head_group_copies(g, DType::i32, back.data(), groups.data(), false));
  EXPECT_EQ(back, rows);
}

TEST(CopyPlans, ContextSequenceMovesOneRunPerChunk) {
  // 2 ranks, 2 batch rows, 4 local tokens: chunks of 2, rank 0 holds chunks 0 and 3.
  ops::ContextDims d;
  d.batch = 2;
  d.local_seq = 4;
  d.split = ContextSplit{0, 2};
  std::vector<int32_t> by_rank(2 * 2 * 4), seq(2 * 8, -1);
  std::iota(by_rank.begin(), by_rank.end(), 0);
  const ops::CopyPlan plan =
      ops::context_sequence_copies(d, 1, DType::i32, by_rank.data(), seq.data(), true);
  // Per batch row: rank 0's chunks 0 and 3 (two runs), rank 1's chunks 1 and 2 (adjacent: one).
  EXPECT_EQ(plan.copies.size(), 2u * 3u);
  apply(plan);
  // batch row 0: chunk 0 = rank 0's tokens 0-1, chunk 1 = rank 1's 0-1, chunk 2 = rank 1's
  // 2-3, chunk 3 = rank 0's 2-3 (rank r's rows start at (r * 2 + b) * 4).
  EXPECT_EQ(std::vector<int32_t>(seq.begin(), seq.begin() + 8),
            (std::vector<int32_t>{0, 1, 8, 9, 10, 11, 2, 3}));
  std::vector<int32_t> back(by_rank.size(), -1);
  apply(ops::context_sequence_copies(d, 1, DType::i32, back.data(), seq.data(), false));
  EXPECT_EQ(back, by_rank);
}

}  // namespace
}  // namespace meshtrain
