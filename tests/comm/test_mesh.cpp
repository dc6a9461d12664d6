// The mesh layout (global_rank = (pp * dp + dp_rank) * tp + tp_rank), its
// sub-communicators on the real world, and the error every rank gives when
// tp * pp does not divide the world.
#include <gtest/gtest.h>

#include <set>
#include <vector>

#include "meshtrain/comm/mesh.h"
#include "meshtrain/util/error.h"
#include "mpi_test.h"

namespace meshtrain {
namespace {

using testing::mpi_env;

TEST(MeshLayout, RanksAndCoordinatesForSeveralShapes) {
  struct Shape {
    int world, tp, pp, dp;
  };
  for (Shape s : {Shape{1, 1, 1, 1}, Shape{8, 2, 2, 2}, Shape{12, 2, 3, 2}, Shape{16, 4, 1, 4},
                  Shape{6, 1, 3, 2}, Shape{24, 2, 4, 3}}) {
    MeshLayout m(s.world, s.tp, s.pp);
    EXPECT_EQ(m.dp(), s.dp);
    std::set<int> seen;
    for (int r = 0; r < s.world; ++r) {
      MeshCoord c = m.coord(r);
      EXPECT_EQ(r, (c.pp * s.dp + c.dp) * s.tp + c.tp) << m.describe() << " rank " << r;
      EXPECT_EQ(m.rank(c), r);
      seen.insert(r);
    }
    EXPECT_EQ(seen.size(), static_cast<size_t>(s.world));
  }
  // TP is fastest-varying: ranks 0 and 1 are TP neighbours.
  MeshLayout m(8, 2, 2);
  EXPECT_EQ(m.coord(1), (MeshCoord{.dp = 0, .tp = 1, .pp = 0}));
  EXPECT_EQ(m.coord(2), (MeshCoord{.dp = 1, .tp = 0, .pp = 0}));
  EXPECT_EQ(m.coord(4), (MeshCoord{.dp = 0, .tp = 0, .pp = 1}));
  EXPECT_EQ(m.describe(), "dp 2 x tp 2 x pp 2 = 8 ranks");
}

TEST(MeshLayout, NonDividingWorldNamesTheNumbers) {
  try {
    MeshLayout(6, 4, 1);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_STREQ(
        e.what(),
        "mesh: world size 6 is not divisible by tp 4 x pp 1 = 4: run a multiple of 4 ranks");
  }
  EXPECT_THROW(MeshLayout(4, 0, 1), Error);
  EXPECT_THROW(MeshLayout(4, 1, -2), Error);
}

// The world ranks in this rank's group on `axis`, gathered over the group.
std::vector<int32_t> group_members(Communicator& group, int world_rank) {
  std::vector<int32_t> members(static_cast<size_t>(group.size()));
  int32_t me = world_rank;
  group.all_gather(&me, members.data(), 1, CommDType::i32);
  return members;
}

TEST(DeviceMesh, SubCommunicatorsHoldTheRightRanks) {
  MemoryTracker tracker;
  auto world = mpi_env().world(tracker);
  const int n = world->size();
  for (int tp = 1; tp <= n; ++tp) {
    for (int pp = 1; pp * tp <= n; ++pp) {
      if (n % (tp * pp) != 0) continue;
      DeviceMesh mesh(*world, tp, pp);
      const MeshLayout& L = mesh.layout();
      const MeshCoord c = mesh.coord();
      EXPECT_EQ(L.rank(c), world->rank());
      ASSERT_EQ(mesh.dp().size(), L.dp());
      ASSERT_EQ(mesh.tp().size(), tp);
      ASSERT_EQ(mesh.pp().size(), pp);
      EXPECT_EQ(mesh.dp().rank(), c.dp);
      EXPECT_EQ(mesh.tp().rank(), c.tp);
      EXPECT_EQ(mesh.pp().rank(), c.pp);
      std::vector<int32_t> dp = group_members(mesh.dp(), world->rank());
      std::vector<int32_t> tpg = group_members(mesh.tp(), world->rank());
      std::vector<int32_t> ppg = group_members(mesh.pp(), world->rank());
      for (int i = 0; i < L.dp(); ++i)
        EXPECT_EQ(dp[static_cast<size_t>(i)], L.rank({i, c.tp, c.pp}));
      for (int i = 0; i < tp; ++i) EXPECT_EQ(tpg[static_cast<size_t>(i)], L.rank({c.dp, i, c.pp}));
      for (int i = 0; i < pp; ++i) EXPECT_EQ(ppg[static_cast<size_t>(i)], L.rank({c.dp, c.tp, i}));
      EXPECT_EQ(mesh.dp().name(), "dp");
    }
  }
}

// Expert parallelism: ep groups are ep neighbouring dp ranks, the
// expert-data-parallel groups the dp ranks with the same position in theirs.
TEST(DeviceMesh, ExpertGroupsAreDrawnFromTheDataParallelRanks) {
  MemoryTracker tracker;
  auto world = mpi_env().world(tracker);
  const int n = world->size();
  for (int ep = 1; ep <= n; ++ep) {
    if (n % ep != 0) continue;
    DeviceMesh mesh(*world, 1, 1, ep);
    const int d = mesh.coord().dp;
    ASSERT_EQ(mesh.ep().size(), ep);
    ASSERT_EQ(mesh.edp().size(), n / ep);
    EXPECT_EQ(mesh.ep().rank(), d % ep);
    EXPECT_EQ(mesh.edp().rank(), d / ep);
    std::vector<int32_t> epg = group_members(mesh.ep(), world->rank());
    std::vector<int32_t> edp = group_members(mesh.edp(), world->rank());
    for (int i = 0; i < ep; ++i) EXPECT_EQ(epg[static_cast<size_t>(i)], d / ep * ep + i);
    for (int j = 0; j < n / ep; ++j) EXPECT_EQ(edp[static_cast<size_t>(j)], j * ep + d % ep);
  }
  std::string message;
  try {
    DeviceMesh mesh(*world, 1, 1, n + 1);
  } catch (const Error& e) {
    message = e.what();
  }
  EXPECT_EQ(message.rfind("mesh: parallel.ep = " + std::to_string(n + 1) +
                              " must be >= 1 and divide the data-parallel size " +
                              std::to_string(n),
                          0),
            0u)
      << message;
}

TEST(DeviceMesh, NonDividingWorldFailsOnEveryRankWithTheNumbers) {
  MemoryTracker tracker;
  auto world = mpi_env().world(tracker);
  const int n = world->size();
  const int tp = n + 1;  // never divides
  std::string message;
  try {
    DeviceMesh mesh(*world, tp, 1);
  } catch (const Error& e) {
    message = e.what();
  }
  EXPECT_EQ(message, "mesh: world size " + std::to_string(n) + " is not divisible by tp " +
                         std::to_string(tp) + " x pp 1 = " + std::to_string(tp) +
                         ": run a multiple of " + std::to_string(tp) + " ranks");
  EXPECT_TRUE(testing::all_ranks(*world, !message.empty())) << "some rank did not fail";
}

}  // namespace
}  // namespace meshtrain
