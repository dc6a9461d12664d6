// NCCL's bootstrap over the MPI world, run up to the point that needs a GPU:
// every rank holds rank 0's id; creating the communicator then needs a
// device (one per rank: NCCL refuses two ranks on one GPU), and without one
// it is a resource error naming the reason, and the test says SKIPPED; ranks
// sharing one GPU go through MPI with the CUDA copier (SKIPPED without one).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "mpi_test.h"

#ifdef MESHTRAIN_HAVE_NCCL
#include "meshtrain/backend/cuda/runtime.h"
#include "meshtrain/comm/nccl/cuda_copier.h"
#include "meshtrain/comm/nccl/device_world.h"
#include "meshtrain/comm/nccl/nccl.h"
#include "meshtrain/util/error.h"
#endif

namespace meshtrain {
namespace {

#ifdef MESHTRAIN_HAVE_NCCL
TEST(NcclBootstrap, EveryRankHoldsRankZerosId) {
  MemoryTracker tracker;
  const auto world = testing::mpi_env().world(tracker);
  const NcclId id = share_nccl_id(*world);
  EXPECT_NE(id.bytes, NcclId{}.bytes);
  const int n = world->size();
  std::vector<char> all(id.bytes.size() * static_cast<size_t>(n));
  world->all_gather(id.bytes.data(), all.data(), static_cast<int64_t>(id.bytes.size() / 4),
                    CommDType::i32);
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(std::string(all.data() + r * id.bytes.size(), id.bytes.size()),
              std::string(id.bytes.data(), id.bytes.size()))
        << "rank " << r;
  }
}

TEST(NcclBootstrap, TheCommunicatorNeedsOneDevicePerRank) {
  MemoryTracker tracker;
  const auto world = testing::mpi_env().world(tracker);
  const NcclId id = share_nccl_id(*world);
  const std::string why = cuda::device_unavailable();
  if (!why.empty()) {
    try {
      NcclCommunicator::create(id, world->rank(), world->size(), "world", {});
      ADD_FAILURE() << "created an NCCL communicator without a device";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::resource) << e.what();
    }
    GTEST_SKIP() << why;
  }
  int devices = 0;
  cudaGetDeviceCount(&devices);
  if (devices < world->size()) GTEST_SKIP() << "NCCL needs a GPU per rank: " << devices << " for " << world->size();
  NcclCommunicator::Options options;
  options.device = world->rank();
  const auto comm = NcclCommunicator::create(id, world->rank(), world->size(), "world", options);
  float* x = nullptr;
  ASSERT_EQ(cudaMalloc(&x, sizeof(float)), cudaSuccess);
  const float one = 1;
  cudaMemcpy(x, &one, sizeof one, cudaMemcpyHostToDevice);
  comm->all_reduce(x, 1, CommDType::f32, ReduceOp::sum);
  float sum = 0;
  cudaMemcpy(&sum, x, sizeof sum, cudaMemcpyDeviceToHost);
  cudaFree(x);
  EXPECT_EQ(sum, static_cast<float>(world->size()));
}
// Ranks sharing one GPU (what NCCL refuses): MPI on the host with the CUDA copier.
TEST(NcclBootstrap, RanksSharingOneGpuStageThroughTheHost) {
  if (const std::string why = cuda::device_unavailable(); !why.empty()) GTEST_SKIP() << why;
  MemoryTracker tracker;
  const CudaCopier copier(0, nullptr);
  StagedCommunicator world(testing::mpi_env().world(tracker), copier, tracker);
  float* x = nullptr;
  ASSERT_EQ(cudaMalloc(&x, 4 * sizeof(float)), cudaSuccess);
  const float mine[4] = {1, 2, 3, static_cast<float>(world.rank())};
  cudaMemcpy(x, mine, sizeof mine, cudaMemcpyHostToDevice);
  world.all_reduce(x, 4, CommDType::f32, ReduceOp::sum);
  float sum[4] = {};
  cudaMemcpy(sum, x, sizeof sum, cudaMemcpyDeviceToHost);
  cudaFree(x);
  const float n = static_cast<float>(world.size());
  EXPECT_EQ(sum[0], n);
  EXPECT_EQ(sum[2], 3 * n);
  EXPECT_EQ(sum[3], n * (n - 1) / 2);
}

// The world a multi-rank CUDA run's mesh splits: tensors through NCCL (a GPU
// per rank) or staged through MPI (ranks sharing a GPU), host data through
// MPI, each on its own side.
TEST(NcclBootstrap, TheCudaWorldRoutesTensorsAndHostData) {
  MemoryTracker tracker;
  const auto host_world = testing::mpi_env().world(tracker);
  if (const std::string why = cuda::device_unavailable(); !why.empty()) GTEST_SKIP() << why;
  int devices = 0;
  cudaGetDeviceCount(&devices);
  const CudaWorld w = make_cuda_world(*host_world, "auto", host_world->size(), tracker,
                                      testing::mpi_env().flight());
  EXPECT_EQ(w.backend, host_world->size() > devices ? "mpi" : "nccl");
  auto& routed = dynamic_cast<RoutedCommunicator&>(*w.world);
  float* x = nullptr;
  ASSERT_EQ(cudaMalloc(&x, sizeof(float)), cudaSuccess);
  const float one = 1;
  cudaMemcpy(x, &one, sizeof one, cudaMemcpyHostToDevice);
  w.world->all_reduce(x, 1, CommDType::f32, ReduceOp::sum);
  float sum = 0;
  cudaMemcpy(&sum, x, sizeof sum, cudaMemcpyDeviceToHost);
  cudaFree(x);
  int64_t votes = 1;
  w.world->all_reduce(&votes, 1, CommDType::i64, ReduceOp::sum);
  const float n = static_cast<float>(host_world->size());
  EXPECT_EQ(sum, n);
  EXPECT_EQ(static_cast<float>(votes), n);
  EXPECT_EQ(routed.device().calls_issued(), 1u);
  EXPECT_EQ(routed.host().calls_issued(), 1u);
}
#else
TEST(NcclBootstrap, NotInThisBuild) { GTEST_SKIP() << "this build has no NCCL"; }
#endif

}  // namespace
}  // namespace meshtrain
