// NCCL without a GPU: libnccl opens through the loader and makes bootstrap
// ids (what needs no device); the one-rank self test of every call runs on a
// GPU and reports SKIPPED, with the reason, without one. A build without
// NCCL skips all of it, saying so.
#include <gtest/gtest.h>

#include <string>

#ifdef MESHTRAIN_HAVE_NCCL
#include "meshtrain/backend/cuda/runtime.h"
#include "meshtrain/comm/nccl/nccl.h"
#include "meshtrain/comm/nccl/self_test.h"
#endif

namespace meshtrain {
namespace {

#ifdef MESHTRAIN_HAVE_NCCL
TEST(Nccl, OpensTheLibraryAndMakesDistinctIdsWithoutADevice) {
  const std::string version = nccl_version();
  EXPECT_EQ(version.rfind("2.", 0), 0u) << version;
  const NcclId a = nccl_unique_id(), b = nccl_unique_id();
  EXPECT_NE(a.bytes, b.bytes);
  EXPECT_NE(a.bytes, NcclId{}.bytes);
}

TEST(Nccl, OneRankSelfTestOfEveryCall) {
  if (const std::string why = cuda::device_unavailable(); !why.empty()) GTEST_SKIP() << why;
  const NcclCheck check = nccl_self_test(-1);
  for (const std::string& line : check.lines) std::printf("%s\n", line.c_str());
  EXPECT_EQ(check.failed, 0);
  EXPECT_GT(check.lines.size(), 10u);
}
#else
TEST(Nccl, NotInThisBuild) { GTEST_SKIP() << "this build has no NCCL (no CUDA toolkit or nccl.h)"; }
#endif

}  // namespace
}  // namespace meshtrain
