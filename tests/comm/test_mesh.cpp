// The mesh layout (global_rank = ((pp * dp + dp_rank) * cp + cp_rank) * tp +
// tp_rank), its sub-communicators on the real world, and the error every rank
// gives when cp * tp * pp does not divide the world.
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

// Context parallelism sits between tp and dp: cp ranks are neighbours after
// tp, and the replicas (dp x cp) number dp-major.
TEST(MeshLayout, ContextParallelRanksSitBetweenTensorAndData) {
  MeshLayout m(16, 2, 2, 2);
  EXPECT_EQ(m.dp(), 2);
  EXPECT_EQ(m.replicas(), 4);
  EXPECT_EQ(m.coord(2), (MeshCoord{.dp = 0, .tp = 0, .pp = 0, .cp = 1}));
  EXPECT_EQ(m.coord(4), (MeshCoord{.dp = 1, .tp = 0, .pp = 0, .cp = 0}));
  EXPECT_EQ(m.coord(8), (MeshCoord{.dp = 0, .tp = 0, .pp = 1, .cp = 0}));
  for (int r = 0; r < 16; ++r) {
    const MeshCoord c = m.coord(r);
    EXPECT_EQ(r, ((c.pp * 2 + c.dp) * 2 + c.cp) * 2 + c.tp);
    EXPECT_EQ(m.rank(c), r);
    EXPECT_EQ(m.replica(c), c.dp * 2 + c.cp);
  }
  EXPECT_EQ(m.describe(), "dp 2 x cp 2 x tp 2 x pp 2 = 16 ranks");
  try {
    MeshLayout(6, 1, 1, 4);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(),
                 "mesh: world size 6 is not divisible by cp 4 x tp 1 x pp 1 = 4: run a multiple "
                 "of 4 ranks");
  }
  EXPECT_THROW(MeshLayout(4, 1, 1, 0), Error);
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
  for (int cp = 1; cp <= n; ++cp) {
    for (int tp = 1; tp * cp <= n; ++tp) {
      for (int pp = 1; pp * tp * cp <= n; ++pp) {
        if (n % (cp * tp * pp) != 0) continue;
        DeviceMesh mesh(*world, tp, pp, 1, cp);
        const MeshLayout& L = mesh.layout();
        const MeshCoord c = mesh.coord();
        EXPECT_EQ(L.rank(c), world->rank());
        ASSERT_EQ(mesh.replicas().size(), L.dp() * cp);
        ASSERT_EQ(mesh.cp().size(), cp);
        ASSERT_EQ(mesh.tp().size(), tp);
        ASSERT_EQ(mesh.pp().size(), pp);
        EXPECT_EQ(mesh.replicas().rank(), L.replica(c));
        EXPECT_EQ(mesh.cp().rank(), c.cp);
        EXPECT_EQ(mesh.tp().rank(), c.tp);
        EXPECT_EQ(mesh.pp().rank(), c.pp);
        std::vector<int32_t> rep = group_members(mesh.replicas(), world->rank());
        std::vector<int32_t> cpg = group_members(mesh.cp(), world->rank());
        std::vector<int32_t> tpg = group_members(mesh.tp(), world->rank());
        std::vector<int32_t> ppg = group_members(mesh.pp(), world->rank());
        auto at = [&](MeshCoord x) { return L.rank(x); };
        for (int i = 0; i < L.replicas(); ++i)
          EXPECT_EQ(rep[static_cast<size_t>(i)],
                    at({.dp = i / cp, .tp = c.tp, .pp = c.pp, .cp = i % cp}));
        for (int i = 0; i < cp; ++i)
          EXPECT_EQ(cpg[static_cast<size_t>(i)], at({.dp = c.dp, .tp = c.tp, .pp = c.pp, .cp = i}));
        for (int i = 0; i < tp; ++i)
          EXPECT_EQ(tpg[static_cast<size_t>(i)], at({.dp = c.dp, .tp = i, .pp = c.pp, .cp = c.cp}));
        for (int i = 0; i < pp; ++i)
          EXPECT_EQ(ppg[static_cast<size_t>(i)], at({.dp = c.dp, .tp = c.tp, .pp = i, .cp = c.cp}));
        EXPECT_EQ(mesh.replicas().name(), cp > 1 ? "dp_cp" : "dp");
      }
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
