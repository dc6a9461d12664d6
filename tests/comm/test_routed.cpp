// The routed communicator (host buffers to one side, device buffers to the
// other) at every world size the comm tests run. Both sides are MPI worlds
// here and "device memory" is a set of host buffers the test's locator calls
// device, so each call's side is read from the two sides' call counts: a
// call sent to the wrong side, or a mixed call let through, fails them.
#include <gtest/gtest.h>

#include <numeric>
#include <set>
#include <vector>

#include "meshtrain/comm/routed.h"
#include "meshtrain/util/error.h"
#include "mpi_test.h"

namespace meshtrain {
namespace {

using testing::mpi_env;

// Device memory is whatever buffer was registered as such.
class SetLocator final : public MemoryLocator {
 public:
  MemorySide side(const void* data) const override {
    if (data == nullptr) return MemorySide::none;
    return device_.count(data) != 0 ? MemorySide::device : MemorySide::host;
  }
  void add(const void* data) { device_.insert(data); }

 private:
  std::set<const void*> device_;
};

struct Fixture {
  MemoryTracker tracker;
  SetLocator locator;
  RoutedCommunicator world{mpi_env().world(tracker, "w"), mpi_env().world(tracker, "w.device"),
                           locator};
  int rank = world.rank(), size = world.size();
  uint64_t host_calls() { return world.host().calls_issued(); }
  uint64_t device_calls() { return world.device().calls_issued(); }
};

TEST(Routed, EachCallGoesWhereItsBuffersAre) {
  Fixture f;
  std::vector<float> device(4, static_cast<float>(f.rank + 1)), host(4, 2.0f);
  f.locator.add(device.data());
  f.world.all_reduce(device.data(), 4, CommDType::f32, ReduceOp::sum);
  EXPECT_EQ(f.device_calls(), 1u);
  EXPECT_EQ(f.host_calls(), 0u);
  EXPECT_EQ(device[3], static_cast<float>(f.size * (f.size + 1) / 2));
  f.world.all_reduce(host.data(), 4, CommDType::f32, ReduceOp::sum);
  f.world.barrier();
  EXPECT_EQ(f.host_calls(), 2u);
  EXPECT_EQ(f.device_calls(), 1u);
  EXPECT_EQ(host[0], 2.0f * static_cast<float>(f.size));
  // The sums over both sides.
  EXPECT_EQ(f.world.calls_issued(), 3u);
  EXPECT_EQ(f.world.stats()[CommOp::all_reduce].calls, 2u);
  EXPECT_EQ(f.world.stats()[CommOp::all_reduce].bytes, 2 * 4 * sizeof(float));
  EXPECT_EQ(f.world.recent_calls().size(), 3u);
}

TEST(Routed, GathersAndAllToAllOnTheDeviceSide) {
  Fixture f;
  const auto n = static_cast<size_t>(f.size);
  std::vector<int32_t> mine{f.rank}, all(n, -1);
  f.locator.add(mine.data());
  f.locator.add(all.data());
  f.world.all_gather(mine.data(), all.data(), 1, CommDType::i32);
  std::vector<int32_t> expected(n);
  std::iota(expected.begin(), expected.end(), 0);
  EXPECT_EQ(all, expected);
  // A rank's all-to-all with nothing to move passes null buffers: still the device side.
  const std::vector<int64_t> none(n, 0);
  f.world.all_to_all(nullptr, none, nullptr, none, CommDType::f32);
  EXPECT_EQ(f.device_calls(), 2u);
  EXPECT_EQ(f.host_calls(), 0u);
}

TEST(Routed, AMixedCallIsRefusedBeforeAnythingIsIssued) {
  Fixture f;
  std::vector<float> device(1, 1.0f), host(static_cast<size_t>(f.size));
  f.locator.add(device.data());
  try {
    f.world.all_gather(device.data(), host.data(), 1, CommDType::f32);
    ADD_FAILURE() << "a gather from device memory into host memory was issued";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("comm w: all_gather: one buffer is in host memory"),
              std::string::npos)
        << e.what();
  }
  std::vector<P2POp> batch{{true, device.data(), 1, CommDType::f32, f.rank, 0},
                           {false, host.data(), 1, CommDType::f32, f.rank, 0}};
  EXPECT_THROW(f.world.send_recv_async(batch), Error);
  EXPECT_EQ(f.world.calls_issued(), 0u);
}

TEST(Routed, PointToPointBatchesAndSplitsKeepTheirSide) {
  Fixture f;
  const int next = (f.rank + 1) % f.size, prev = (f.rank + f.size - 1) % f.size;
  std::vector<float> out(2, static_cast<float>(f.rank)), in(2, -1.0f);
  f.locator.add(out.data());
  f.locator.add(in.data());
  f.world.send_recv_async({{true, out.data(), 2, CommDType::f32, next, 0},
                           {false, in.data(), 2, CommDType::f32, prev, 0}})
      .wait();
  EXPECT_EQ(in[1], static_cast<float>(prev));
  EXPECT_EQ(f.device_calls(), 1u);

  const auto half = f.world.split(f.rank % 2, f.rank, "half");
  auto& routed = dynamic_cast<RoutedCommunicator&>(*half);
  EXPECT_EQ(routed.host().name(), "half");
  EXPECT_EQ(routed.device().name(), "half.device");
  float x = 1;
  f.locator.add(&x);
  half->all_reduce(&x, 1, CommDType::f32, ReduceOp::sum);
  EXPECT_EQ(x, static_cast<float>(half->size()));
  EXPECT_EQ(routed.device().calls_issued(), 1u);
  EXPECT_EQ(routed.host().calls_issued(), 0u);
}

}  // namespace
}  // namespace meshtrain
