// NCCL without a GPU: libnccl opens through the loader and makes bootstrap
// ids (what needs no device); the one-rank self test of every call runs on a
// GPU and reports SKIPPED, with the reason, without one. A build without
// NCCL skips all of it, saying so.
#include <gtest/gtest.h>

#include <string>

#ifdef MESHTRAIN_HAVE_NCCL
#include "meshtrain/backend/cuda/runtime.h"
#include "meshtrain/comm/nccl/device_world.h"
#include "meshtrain/comm/nccl/nccl.h"
#include "meshtrain/comm/nccl/self_test.h"
#include "meshtrain/util/error.h"
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

// comm.backend for a job: NCCL unless a node shares a GPU between ranks.
TEST(Nccl, CommBackendAutoTakesNcclUnlessRanksShareAGpu) {
  EXPECT_EQ(resolve_comm_backend("auto", false), "nccl");
  EXPECT_EQ(resolve_comm_backend("auto", true), "mpi");
  EXPECT_EQ(resolve_comm_backend("mpi", false), "mpi");
  EXPECT_EQ(resolve_comm_backend("nccl", false), "nccl");
  try {
    resolve_comm_backend("nccl", true);
    ADD_FAILURE() << "NCCL chosen for ranks sharing a GPU";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::config);
    EXPECT_NE(std::string(e.what()).find("comm.backend = \"nccl\" but a node runs more ranks"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(resolve_comm_backend("gloo", false), Error);
}

// Without a driver every non-null address is host memory (the runtime knows no device memory).
TEST(Nccl, TheCudaLocatorPlacesHostBuffersWithoutADevice) {
  const CudaMemoryLocator locator;
  const float x = 0;
  EXPECT_EQ(locator.side(nullptr), MemorySide::none);
  EXPECT_EQ(locator.side(&x), MemorySide::host);
}

TEST(Nccl, TheCudaLocatorPlacesDeviceAndPinnedBuffers) {
  const CudaMemoryLocator locator;
  if (const std::string why = cuda::device_unavailable(); !why.empty()) GTEST_SKIP() << why;
  void* device = nullptr;
  ASSERT_EQ(cudaMalloc(&device, 64), cudaSuccess);
  EXPECT_EQ(locator.side(device), MemorySide::device);
  void* pinned = nullptr;
  ASSERT_EQ(cudaMallocHost(&pinned, 64), cudaSuccess);
  EXPECT_EQ(locator.side(pinned), MemorySide::host);
  cudaFree(device);
  cudaFreeHost(pinned);
}
#else
TEST(Nccl, NotInThisBuild) { GTEST_SKIP() << "this build has no NCCL (no CUDA toolkit or nccl.h)"; }
#endif

}  // namespace
}  // namespace meshtrain
