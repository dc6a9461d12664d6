// Asynchronous calls: issue order = execution order = completion order,
// sequence numbers, per-op stats and the bounded log of recent calls; no
// spinning while waiting for peers.
#include <gtest/gtest.h>

#include <chrono>
#include <ctime>
#include <thread>
#include <vector>

#include "meshtrain/util/error.h"
#include "mpi_test.h"

namespace meshtrain {
namespace {

using testing::mpi_env;

TEST(Async, CallsRunInIssueOrderWithConsecutiveSequenceNumbers) {
  MemoryTracker tracker;
  auto world = mpi_env().world(tracker);
  const int n = 12;
  std::vector<std::vector<float>> bufs(n, std::vector<float>(20000));
  std::vector<Work> works;
  const uint64_t first = world->calls_issued();
  EXPECT_EQ(first, 0u) << "a fresh communicator numbers from 0";
  for (int k = 0; k < n; ++k) {
    for (float& x : bufs[static_cast<size_t>(k)]) x = static_cast<float>(k + world->rank());
    works.push_back(world->all_reduce_async(bufs[static_cast<size_t>(k)].data(), 20000,
                                            CommDType::f32, ReduceOp::sum));
  }
  // Wait on the last one only: every earlier call has completed by then.
  works.back().wait();
  for (int k = 0; k < n; ++k) {
    EXPECT_TRUE(works[static_cast<size_t>(k)].test()) << k;
    EXPECT_EQ(works[static_cast<size_t>(k)].seq(), first + static_cast<uint64_t>(k));
  }
  const float ranks_sum = static_cast<float>(world->size() * (world->size() - 1) / 2);
  for (int k = 0; k < n; ++k) {
    EXPECT_EQ(bufs[static_cast<size_t>(k)][123], static_cast<float>(k * world->size()) + ranks_sum);
  }
  for (int k = 1; k < n; ++k) {
    CallRecord prev = works[static_cast<size_t>(k - 1)].record(),
               cur = works[static_cast<size_t>(k)].record();
    EXPECT_LE(prev.finished, cur.started)
        << "call " << k << " started before call " << k - 1 << " ended";
    EXPECT_LE(cur.submitted, cur.started);
    EXPECT_LE(cur.started, cur.finished);
    EXPECT_EQ(cur.bytes, 20000u * 4);
    EXPECT_EQ(cur.op, CommOp::all_reduce);
  }
  EXPECT_EQ(world->calls_issued(), first + n);
  world->barrier();
  CommStats s = world->stats();
  EXPECT_EQ(s[CommOp::all_reduce].calls, static_cast<uint64_t>(n));
  EXPECT_EQ(s[CommOp::all_reduce].bytes, static_cast<uint64_t>(n) * 20000 * 4);
  EXPECT_GT(s[CommOp::all_reduce].busy_seconds, 0.0);
  EXPECT_EQ(s[CommOp::barrier].calls, 1u);
  EXPECT_EQ(s.total().calls, static_cast<uint64_t>(n) + 1);
  std::vector<CallRecord> log = world->recent_calls();
  ASSERT_EQ(log.size(), static_cast<size_t>(n) + 1);
  for (size_t i = 0; i < log.size(); ++i) EXPECT_EQ(log[i].seq, first + i);
  EXPECT_EQ(log.back().op, CommOp::barrier);
}

TEST(Async, ErrorsReachTheWaiter) {
  MemoryTracker tracker;
  auto world = mpi_env().world(tracker);
  if (world->size() < 2) GTEST_SKIP() << "needs a peer";
  std::vector<float> buf(8);
  if (world->rank() == 0) {
    world->send(buf.data(), 8, CommDType::f32, 1, 3);
  } else if (world->rank() == 1) {
    Work w = world->recv_async(buf.data(), 4, CommDType::f32, 0, 3);  // too small: truncated
    EXPECT_THROW(w.wait(), Error);
  }
  world->barrier();
}

// Waiting for a late peer costs almost no CPU: the communication thread
// sleeps between tests of a request instead of spinning inside MPI. Rank 0
// issues an all-reduce the others join 400 ms later; meanwhile its process
// uses far less than 400 ms of CPU (spinning would use about all of it).
TEST(Async, WaitingForALatePeerDoesNotSpin) {
  MemoryTracker tracker;
  auto world = mpi_env().world(tracker);
  if (world->size() < 2) GTEST_SKIP() << "needs a peer";
  std::vector<float> buf(size_t{1} << 18, 1.0f);  // 1 MiB: above the handshake size
  world->barrier();
  if (world->rank() == 0) {
    const std::clock_t before = std::clock();
    Work w = world->all_reduce_async(buf.data(), static_cast<int64_t>(buf.size()), CommDType::f32,
                                     ReduceOp::sum);
    std::this_thread::sleep_for(std::chrono::milliseconds(400));
    const double cpu = static_cast<double>(std::clock() - before) / CLOCKS_PER_SEC;
    w.wait();
    EXPECT_LT(cpu, 0.1) << "the process used " << cpu << " s of CPU while waiting 0.4 s for peers";
  } else {
    std::this_thread::sleep_for(std::chrono::milliseconds(400));
    world->all_reduce(buf.data(), static_cast<int64_t>(buf.size()), CommDType::f32, ReduceOp::sum);
  }
  EXPECT_EQ(buf[7], static_cast<float>(world->size()));
}

TEST(CommTrace, KeepsTheMostRecentCallsAndCountsAll) {
  CommTrace trace(4);
  for (uint64_t i = 0; i < 10; ++i) {
    CallRecord r;
    r.seq = i;
    r.op = i % 2 ? CommOp::broadcast : CommOp::all_gather;
    r.bytes = 100;
    r.started = CommClock::time_point(std::chrono::milliseconds(i));
    r.finished = r.started + std::chrono::milliseconds(2);
    trace.record(r);
  }
  std::vector<CallRecord> recent = trace.recent();
  ASSERT_EQ(recent.size(), 4u);
  EXPECT_EQ(recent.front().seq, 6u);
  EXPECT_EQ(recent.back().seq, 9u);
  CommStats s = trace.stats();
  EXPECT_EQ(s[CommOp::broadcast].calls, 5u);
  EXPECT_EQ(s[CommOp::all_gather].bytes, 500u);
  EXPECT_NEAR(s.total().busy_seconds, 0.020, 1e-9);
  trace.reset();
  EXPECT_TRUE(trace.recent().empty());
  EXPECT_EQ(trace.stats().total().calls, 0u);
}

// A call queued 5 ms behind another and busy 1 ms, waited for from its
// submission: the wait (6 ms) exceeds its busy time, never its time in flight.
TEST(CommTimeline, ExposedIsPartOfTheTimeInFlight) {
  using std::chrono::milliseconds;
  const CommClock::time_point t0 = CommClock::now();
  CallRecord queued;
  queued.submitted = t0;
  queued.started = t0 + milliseconds(5);
  queued.finished = t0 + milliseconds(6);
  CommTimeline timeline;
  timeline.add(queued, t0, t0 + milliseconds(7));  // woken 1 ms after it finished
  EXPECT_NEAR(timeline.in_flight_seconds(), 6e-3, 1e-9);
  EXPECT_NEAR(timeline.exposed_seconds(), 6e-3, 1e-9);
  EXPECT_GT(timeline.exposed_seconds(), queued.busy_seconds());

  // A second call overlapping the first, finished before anyone waited: in
  // flight is the union of the two, exposed unchanged.
  CallRecord early;
  early.submitted = t0 + milliseconds(2);
  early.started = t0 + milliseconds(6);
  early.finished = t0 + milliseconds(9);
  timeline.add(early, t0 + milliseconds(10), t0 + milliseconds(10));
  EXPECT_NEAR(timeline.in_flight_seconds(), 9e-3, 1e-9);
  EXPECT_NEAR(timeline.exposed_seconds(), 6e-3, 1e-9);
  EXPECT_LE(timeline.exposed_seconds(), timeline.in_flight_seconds());
}

}  // namespace
}  // namespace meshtrain
