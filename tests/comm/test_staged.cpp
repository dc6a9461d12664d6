// The staged communicator (device buffers through MPI on the host) against
// the same calls made directly on host buffers, bit for bit, at every world
// size the comm tests run: each call of the contract, uneven and in-place
// parts, bf16. The "device" is host memory behind a copier that counts what
// it moves, so a call that forgot to stage its input or land its result fails.
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <vector>

#include "meshtrain/comm/staged.h"
#include "mpi_test.h"

namespace meshtrain {
namespace {

using testing::mpi_env;

class CountingCopier final : public DeviceCopier {
 public:
  void to_host(void* host, const void* device, size_t bytes) const override {
    std::memcpy(host, device, bytes);
    to_host_bytes += bytes;
  }
  void to_device(void* device, const void* host, size_t bytes) const override {
    std::memcpy(device, host, bytes);
    to_device_bytes += bytes;
  }
  mutable size_t to_host_bytes = 0, to_device_bytes = 0;
};

std::vector<float> values(int rank, int64_t n) {
  std::vector<float> v(static_cast<size_t>(n));
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>((rank * 5 + 3 * static_cast<int>(i)) % 13) - 6;
  return v;
}

struct Fixture {
  MemoryTracker tracker;
  std::unique_ptr<MpiCommunicator> direct = mpi_env().world(tracker, "direct");
  CountingCopier copier;
  StagedCommunicator staged{mpi_env().world(tracker, "staged"), copier, tracker};
  int rank = direct->rank(), size = direct->size();
};

TEST(Staged, AllReduceLandsAtWaitAndStagesTheInputAtIssue) {
  Fixture f;
  const int64_t n = 1000;
  std::vector<float> expected = values(f.rank, n), device = expected;
  f.direct->all_reduce(expected.data(), n, CommDType::f32, ReduceOp::sum);
  Work work = f.staged.all_reduce_async(device.data(), n, CommDType::f32, ReduceOp::sum);
  EXPECT_EQ(f.copier.to_host_bytes, n * sizeof(float));
  const std::vector<float> before = device;
  work.wait();
  EXPECT_EQ(device, expected);
  if (f.size > 1) {
    EXPECT_NE(device, before);
  }
  EXPECT_EQ(f.copier.to_device_bytes, n * sizeof(float));
  work.wait();  // lands once
  EXPECT_EQ(f.copier.to_device_bytes, n * sizeof(float));
}

TEST(Staged, Bf16AllReduceMatchesTheHostCall) {
  Fixture f;
  const int64_t n = 333;
  std::vector<bf16> expected(static_cast<size_t>(n)), device;
  const std::vector<float> v = values(f.rank, n);
  for (size_t i = 0; i < v.size(); ++i) expected[i] = float_to_bf16(v[i] / 3);
  device = expected;
  f.direct->all_reduce(expected.data(), n, CommDType::bf16, ReduceOp::avg);
  f.staged.all_reduce(device.data(), n, CommDType::bf16, ReduceOp::avg);
  EXPECT_EQ(0, std::memcmp(device.data(), expected.data(), expected.size() * sizeof(bf16)));
}

TEST(Staged, UnevenReduceScatterAndInPlaceAllGather) {
  Fixture f;
  std::vector<int64_t> counts(static_cast<size_t>(f.size));
  for (int r = 0; r < f.size; ++r) counts[static_cast<size_t>(r)] = 3 + 2 * r;
  const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  const int64_t mine = counts[static_cast<size_t>(f.rank)];
  const std::vector<float> in = values(f.rank, total);
  std::vector<float> expected(static_cast<size_t>(mine)), device(static_cast<size_t>(mine));
  f.direct->reduce_scatter(in.data(), expected.data(), counts, CommDType::f32, ReduceOp::max);
  f.staged.reduce_scatter(in.data(), device.data(), counts, CommDType::f32, ReduceOp::max);
  EXPECT_EQ(device, expected);

  int64_t offset = 0;
  for (int r = 0; r < f.rank; ++r) offset += counts[static_cast<size_t>(r)];
  std::vector<float> gathered_expected(static_cast<size_t>(total), -99), gathered(gathered_expected);
  for (int64_t i = 0; i < mine; ++i) {
    gathered_expected[static_cast<size_t>(offset + i)] = gathered[static_cast<size_t>(offset + i)] =
        expected[static_cast<size_t>(i)];
  }
  f.direct->all_gather(gathered_expected.data() + offset, gathered_expected.data(), counts, CommDType::f32);
  f.staged.all_gather(gathered.data() + offset, gathered.data(), counts, CommDType::f32);
  EXPECT_EQ(gathered, gathered_expected);
}

TEST(Staged, BroadcastAllToAllAndPointToPoint) {
  Fixture f;
  const int root = f.size - 1;
  std::vector<float> b = f.rank == root ? values(7, 50) : std::vector<float>(50, 0);
  f.staged.broadcast(b.data(), 50, CommDType::f32, root);
  EXPECT_EQ(b, values(7, 50));

  // Rank r sends r + d + 1 values to rank d.
  std::vector<int64_t> out(static_cast<size_t>(f.size)), in(static_cast<size_t>(f.size));
  for (int d = 0; d < f.size; ++d) {
    out[static_cast<size_t>(d)] = f.rank + d + 1;
    in[static_cast<size_t>(d)] = d + f.rank + 1;
  }
  const std::vector<float> send = values(f.rank, std::accumulate(out.begin(), out.end(), int64_t{0}));
  const int64_t received = std::accumulate(in.begin(), in.end(), int64_t{0});
  std::vector<float> expected(static_cast<size_t>(received)), device(static_cast<size_t>(received));
  f.direct->all_to_all(send.data(), out, expected.data(), in, CommDType::f32);
  f.staged.all_to_all(send.data(), out, device.data(), in, CommDType::f32);
  EXPECT_EQ(device, expected);

  // A ring: send to the next rank, receive from the previous, in one batch and one by one.
  const int next = (f.rank + 1) % f.size, prev = (f.rank + f.size - 1) % f.size;
  std::vector<float> mine = values(f.rank, 20), from_prev(20, 0);
  f.staged.send_recv_async({{.send = true, .data = mine.data(), .count = 20, .peer = next},
                            {.send = false, .data = from_prev.data(), .count = 20, .peer = prev}})
      .wait();
  EXPECT_EQ(from_prev, values(prev, 20));
  if (f.size % 2 == 0) {  // calls run in issue order: even ranks send first, odd ones receive first
    std::vector<float> again(20, 0);
    if (f.rank % 2 == 0) {
      f.staged.send(mine.data(), 20, CommDType::f32, next, 3);
      f.staged.recv(again.data(), 20, CommDType::f32, prev, 3);
    } else {
      f.staged.recv(again.data(), 20, CommDType::f32, prev, 3);
      f.staged.send(mine.data(), 20, CommDType::f32, next, 3);
    }
    EXPECT_EQ(again, values(prev, 20));
  }
}

TEST(Staged, SplitStagesItsCallsToo) {
  Fixture f;
  const std::unique_ptr<Communicator> half = f.staged.split(f.rank % 2, f.rank, "half");
  std::vector<float> x(10, 1.0f);
  const size_t before = f.copier.to_device_bytes;
  half->all_reduce(x.data(), 10, CommDType::f32, ReduceOp::sum);
  EXPECT_EQ(x, std::vector<float>(10, static_cast<float>(half->size())));
  EXPECT_EQ(f.copier.to_device_bytes - before, 10 * sizeof(float));
}

// Host memory that counts what it hands out and takes back (page-locked
// memory on a GPU: what the staging buffers must come from).
class CountingStaging final : public Allocator {
 public:
  Device device() const override { return {}; }
  void* allocate(size_t bytes) const override {
    ++allocations;
    live += bytes;
    return host_allocator().allocate(bytes);
  }
  void release(void* data, size_t bytes) const override {
    live -= bytes;
    host_allocator().release(data, bytes);
  }
  void fill_zero(void* data, size_t bytes) const override {
    host_allocator().fill_zero(data, bytes);
  }
  void copy(DType from, const void* src, DType to, void* dst, size_t n) const override {
    host_allocator().copy(from, src, to, dst, n);
  }
  mutable int allocations = 0;
  mutable size_t live = 0;
};

TEST(Staged, BuffersComeFromTheStagingAllocatorAndAreReused) {
  MemoryTracker tracker;
  CountingCopier copier;
  CountingStaging pinned;
  {
    StagedCommunicator staged(mpi_env().world(tracker, "pinned"), copier, tracker, pinned);
    const std::unique_ptr<Communicator> half = staged.split(staged.rank() % 2, staged.rank(), "h");
    const size_t comm_before = tracker.live(MemCategory::comm);
    std::vector<float> x(1000);
    for (int step = 0; step < 5; ++step) {
      // A step's calls: sizes that recur, two buffers alive at once, and the
      // split's calls from the same blocks.
      x.assign(1000, 1.0f);
      staged.all_reduce(x.data(), 1000, CommDType::f32, ReduceOp::sum);
      EXPECT_EQ(x, std::vector<float>(1000, static_cast<float>(staged.size())));
      Work a = staged.all_reduce_async(x.data(), 600, CommDType::f32, ReduceOp::max);
      Work b = half->all_reduce_async(x.data() + 600, 400, CommDType::f32, ReduceOp::max);
      a.wait();
      b.wait();
      EXPECT_EQ(x, std::vector<float>(1000, static_cast<float>(staged.size())));
      if (step == 0) {
        // 4000 and 2400 bytes share the 4 KiB class: two blocks, both live at once.
        EXPECT_EQ(pinned.allocations, 2);
      }
    }
    EXPECT_EQ(pinned.allocations, 2) << "later steps allocate nothing";
    EXPECT_EQ(tracker.live(MemCategory::comm), comm_before) << "idle blocks are not tensors";
  }
  EXPECT_EQ(pinned.live, 0u) << "the last communicator gives every block back";
}

}  // namespace
}  // namespace meshtrain
