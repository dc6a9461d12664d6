// The flight recorder's ring and deadlines, the dump format and the hang
// diagnosis, without MPI (the SIGSTOP tests under mpirun: tests/watchdog.cmake).
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>

#include "meshtrain/comm/flight_dump.h"
#include "meshtrain/comm/flight_recorder.h"
#include "meshtrain/comm/watchdog.h"
#include "meshtrain/util/error.h"

namespace meshtrain {
namespace {

using namespace std::chrono_literals;

CallRecord call(uint64_t seq, CommOp op = CommOp::all_reduce, size_t bytes = 4096) {
  CallRecord r;
  r.seq = seq;
  r.op = op;
  r.bytes = bytes;
  return r;
}

// Issues, starts and finishes calls 0..n-1 on `comm`.
void complete(FlightRecorder& rec, int comm, uint64_t from, uint64_t to) {
  for (uint64_t s = from; s < to; ++s) {
    CallRecord r = call(s);
    const uint64_t id = rec.issue(comm, r);
    r.started = CommClock::now();
    rec.start(id, r.started);
    r.finished = CommClock::now();
    rec.finish(id, r, false);
  }
}

TEST(FlightRecorder, RingKeepsTheLastCompletedCallsAndEveryPendingOne) {
  FlightRecorder rec(4);
  const int dp = rec.add_comm({"dp", {0, 1}, 0});
  CallRecord stuck = call(0);
  const uint64_t stuck_id = rec.issue(dp, stuck);
  rec.start(stuck_id, CommClock::now());
  // send_recv batches may complete after later calls: the pending one stays.
  complete(rec, dp, 1, 11);
  const FlightSnapshot s = rec.snapshot();
  ASSERT_EQ(s.calls.size(), 5u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(s.calls[i].call.seq, 7 + i);
    EXPECT_EQ(s.calls[i].state, CallState::done);
  }
  EXPECT_EQ(s.calls[4].call.seq, 0u);
  EXPECT_EQ(s.calls[4].state, CallState::running);
  EXPECT_EQ(s.progress[0].issued, 11u);
  EXPECT_EQ(s.progress[0].first_unfinished, 0u);
  ASSERT_EQ(s.comms[0].members, (std::vector<int>{0, 1}));
}

TEST(FlightRecorder, ShrinkingKeepsTheNewestAndZeroTurnsItOff) {
  FlightRecorder rec(8);
  const int world = rec.add_comm({"world", {0, 1, 2}, 1});
  complete(rec, world, 0, 6);
  rec.set_capacity(3);
  FlightSnapshot s = rec.snapshot();
  ASSERT_EQ(s.calls.size(), 3u);
  EXPECT_EQ(s.calls.front().call.seq, 3u);
  EXPECT_EQ(s.calls.back().call.seq, 5u);
  complete(rec, world, 6, 8);
  s = rec.snapshot();
  EXPECT_EQ(s.calls.front().call.seq, 5u);
  EXPECT_EQ(s.calls.back().call.seq, 7u);
  rec.set_capacity(0);
  EXPECT_FALSE(rec.enabled());
  EXPECT_EQ(rec.issue(world, call(8)), 0u);
  EXPECT_TRUE(rec.snapshot().calls.empty());
}

TEST(FlightRecorder, DeadlineIsTheOneInForceAtIssueCountedFromTheStart) {
  FlightRecorder rec(16);
  const int dp = rec.add_comm({"dp", {0, 1}, 0});
  rec.set_timeout(0);
  const uint64_t unbounded = rec.issue(dp, call(0));
  rec.set_timeout(2.0);
  const uint64_t bounded = rec.issue(dp, call(1));
  const uint64_t queued = rec.issue(dp, call(2));
  const auto t0 = CommClock::now();
  rec.start(unbounded, t0);
  rec.start(bounded, t0 + 1s);
  EXPECT_FALSE(rec.overdue(t0 + 2900ms).has_value());  // 1.9 s after its start
  const auto late = rec.overdue(t0 + 3100ms);
  ASSERT_TRUE(late.has_value());
  EXPECT_EQ(late->call.seq, 1u);
  EXPECT_EQ(late->timeout_s, 2.0);
  // A queued call never times out: the call ahead of it is the culprit.
  EXPECT_FALSE(rec.overdue(t0 + 1000s)->call.seq == 2u);
  (void)queued;
}

// A dump as a rank would write it: `issued` calls on each communicator, the
// last `pending` of them not finished (running, or queued when `queued`).
struct CommSpec {
  std::string name;
  std::vector<int> members;
  uint64_t issued = 0;
  int pending = 0;
  bool queued = false;
  CommOp op = CommOp::all_reduce;
};

RankFlight flight_of(int rank, int world, const std::vector<CommSpec>& specs,
                     const char* reason = "peer timeout", double marker_age_s = 0.1) {
  FlightRecorder rec(64);
  for (const CommSpec& c : specs) {
    const auto it = std::find(c.members.begin(), c.members.end(), rank);
    const int index = rec.add_comm({c.name, c.members, static_cast<int>(it - c.members.begin())});
    for (uint64_t s = 0; s < c.issued; ++s) {
      CallRecord r = call(s, c.op, 4 << 20);
      const uint64_t id = rec.issue(index, r);
      if (s + static_cast<uint64_t>(c.pending) >= c.issued) {
        if (!c.queued) rec.start(id, CommClock::now() - 10s);
        continue;
      }
      r.started = r.finished = CommClock::now();
      rec.start(id, r.started);
      rec.finish(id, r, false);
    }
  }
  const std::string text =
      flight_dump_json(rec.snapshot(), {rank, world, "job", reason, marker_age_s});
  return parse_flight_dump(text, "rank_" + std::to_string(rank) + ".json");
}

TEST(FlightDump, RoundTripsThroughJson) {
  const RankFlight f = flight_of(2, 4, {{"dp", {0, 1, 2, 3}, 58, 1}}, "timeout");
  EXPECT_EQ(f.rank, 2);
  EXPECT_EQ(f.world_size, 4);
  EXPECT_EQ(f.reason, "timeout");
  ASSERT_EQ(f.comms.size(), 1u);
  EXPECT_EQ(f.comms[0].rank, 2);
  EXPECT_EQ(f.progress[0].issued, 58u);
  EXPECT_EQ(f.progress[0].first_unfinished, 57u);
  const DumpedCall& last = f.calls.back();
  EXPECT_EQ(last.seq, 57u);
  EXPECT_EQ(last.op, "all_reduce");
  EXPECT_EQ(last.state, CallState::running);
  EXPECT_GE(last.started_ago_s, 9.9);
  EXPECT_EQ(last.finished_ago_s, -1);
  EXPECT_THROW(parse_flight_dump("{\"format\": 3}", "x.json"), Error);
  try {
    parse_flight_dump("not json", "bad.json");
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::corrupt);
    EXPECT_NE(std::string(e.what()).find("bad.json"), std::string::npos);
  }
}

TEST(HangDiagnosis, StoppedRankIsTheOneWithoutADump) {
  // Rank 3 stopped before all_reduce seq 57: the others are in it.
  std::vector<RankFlight> dumps;
  for (int r : {0, 1, 2}) dumps.push_back(flight_of(r, 4, {{"dp", {0, 1, 2, 3}, 58, 1}}));
  const HangDiagnosis d = diagnose_hang(dumps);
  EXPECT_EQ(d.missing, std::vector<int>{3});
  EXPECT_EQ(d.suspects, std::vector<int>{3});
  ASSERT_EQ(d.hangs.size(), 1u);
  const CommHang& h = d.hangs[0];
  EXPECT_EQ(h.seq, 57u);
  EXPECT_EQ(h.op, "all_reduce");
  EXPECT_EQ(h.bytes, 4u << 20);
  EXPECT_EQ(h.in_call, (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(h.missing, std::vector<int>{3});
  const std::string report = format_hang_report(d, "runs/x/flight/job");
  EXPECT_NE(report.find("diagnosis: stuck in comm dp all_reduce seq 57; waiting for rank(s) 3"),
            std::string::npos)
      << report;
  EXPECT_NE(report.find("4.00 MiB"), std::string::npos) << report;
}

TEST(HangDiagnosis, ALateDumpIsAStalledRank) {
  // mpirun's SIGCONT before the kill woke the stopped rank 1 long enough to
  // dump, 2.5 s after the marker: it was behind (computing), and is the culprit.
  std::vector<RankFlight> dumps;
  dumps.push_back(flight_of(0, 2, {{"dp", {0, 1}, 55, 1}}, "timeout", 0));
  dumps.push_back(flight_of(1, 2, {{"dp", {0, 1}, 54, 0}}, "peer timeout", 2.5));
  const HangDiagnosis d = diagnose_hang(dumps);
  EXPECT_TRUE(d.missing.empty());
  EXPECT_EQ(d.late, std::vector<int>{1});
  EXPECT_EQ(d.suspects, std::vector<int>{1});
  EXPECT_EQ(describe_not_arrived(d.hangs.at(0)),
            "1 (stalled: its flight record came only as the job ended)");
  // The same dump in time is a live rank behind.
  dumps[1] = flight_of(1, 2, {{"dp", {0, 1}, 54, 0}}, "peer timeout", 0.3);
  EXPECT_EQ(describe_not_arrived(diagnose_hang(dumps).hangs.at(0)), "1 (behind: at seq 53)");
}

TEST(HangDiagnosis, ALiveRankBehindIsNamedWithItsSequence) {
  // Rank 1 never issued seq 57 on dp (it is stuck in a tp call the others are
  // not part of); everyone dumped.
  std::vector<RankFlight> dumps;
  dumps.push_back(flight_of(0, 2, {{"dp", {0, 1}, 58, 1}, {"tp", {0}, 5, 0}}));
  dumps.push_back(flight_of(1, 2, {{"dp", {0, 1}, 57, 0}, {"tp", {1}, 6, 1}}));
  const HangDiagnosis d = diagnose_hang(dumps);
  EXPECT_TRUE(d.missing.empty());
  ASSERT_EQ(d.hangs.size(), 2u);
  const CommHang* dp = d.hangs[0].comm.name == "dp" ? &d.hangs[0] : &d.hangs[1];
  EXPECT_EQ(dp->seq, 57u);
  ASSERT_EQ(dp->behind.size(), 1u);
  EXPECT_EQ(dp->behind[0].rank, 1);
  EXPECT_EQ(describe_not_arrived(*dp), "1 (behind: at seq 56)");
  const CommHang at = hang_at(dumps, {"dp", {0, 1}, 0}, 57);
  EXPECT_EQ(describe_not_arrived(at), "1 (behind: at seq 56)");
}

TEST(HangDiagnosis, RanksPastACollectiveTheVictimStoppedInsideAreAhead) {
  // Rank 3 stopped inside seq 43 after sending its part: ranks 0 and 2
  // finished it and wait in seq 44, rank 1 is still in 43.
  std::vector<RankFlight> dumps;
  dumps.push_back(flight_of(0, 4, {{"dp", {0, 1, 2, 3}, 45, 1}}, "timeout"));
  dumps.push_back(flight_of(1, 4, {{"dp", {0, 1, 2, 3}, 44, 1}}));
  dumps.push_back(flight_of(2, 4, {{"dp", {0, 1, 2, 3}, 45, 1}}));
  const HangDiagnosis d = diagnose_hang(dumps);
  const CommHang& h = d.hangs.at(0);
  EXPECT_EQ(h.seq, 43u);
  EXPECT_EQ(h.in_call, std::vector<int>{1});
  EXPECT_EQ(h.ahead, (std::vector<int>{0, 2}));
  EXPECT_EQ(h.ahead_at, (std::vector<uint64_t>{44, 44}));
  EXPECT_NE(format_hang_report(d, "d").find("ahead: 0 (at seq 44), 2 (at seq 44)"),
            std::string::npos);
  // Rank 0's own call, seq 44: rank 1 has not issued it.
  EXPECT_EQ(describe_not_arrived(hang_at(dumps, {"dp", {0, 1, 2, 3}, 0}, 44)),
            "3 (no flight record: stopped, dead or unreachable), 1 (behind: at seq 43)");
}

TEST(HangDiagnosis, QueuedCallCountsAsNotArrived) {
  std::vector<RankFlight> dumps;
  dumps.push_back(flight_of(0, 2, {{"dp", {0, 1}, 10, 1}}));
  dumps.push_back(flight_of(1, 2, {{"dp", {0, 1}, 10, 1, /*queued=*/true}}));
  const CommHang h = diagnose_hang(dumps).hangs.at(0);
  EXPECT_EQ(h.in_call, std::vector<int>{0});
  EXPECT_EQ(describe_not_arrived(h), "1 (behind: its seq 9 is queued after another call)");
}

TEST(HangDiagnosis, EveryoneInTheCallMeansTheDataDoesNotArrive) {
  // A link down: all ranks entered the collective and dumped.
  std::vector<RankFlight> dumps;
  for (int r : {0, 1}) dumps.push_back(flight_of(r, 2, {{"world", {0, 1}, 20, 1}}));
  const HangDiagnosis d = diagnose_hang(dumps);
  EXPECT_TRUE(d.suspects.empty());
  EXPECT_NE(describe_not_arrived(d.hangs.at(0)).find("link down"), std::string::npos);
}

TEST(HangDiagnosis, PointToPointNamesOnlyTheMissingPeer) {
  // Pipeline: rank 0's send_recv seq 40 waits for rank 1 (stopped); p2p
  // sequence numbers do not pair up, so a different count is no evidence.
  std::vector<RankFlight> dumps;
  dumps.push_back(flight_of(0, 4, {{"pp", {0, 1}, 41, 1, false, CommOp::send_recv}}));
  dumps.push_back(flight_of(2, 4, {{"pp", {2, 3}, 45, 1, false, CommOp::send_recv}}));
  dumps.push_back(flight_of(3, 4, {{"pp", {2, 3}, 43, 1, false, CommOp::send_recv}}));
  const HangDiagnosis d = diagnose_hang(dumps);
  EXPECT_EQ(d.suspects, std::vector<int>{1});
  for (const CommHang& h : d.hangs) {
    if (h.comm.members == std::vector<int>{0, 1}) {
      EXPECT_EQ(h.missing, std::vector<int>{1});
    } else {
      EXPECT_TRUE(h.behind.empty());
    }
  }
}

TEST(FlightDump, FilesAreFoundByJobAndReadBack) {
  const std::filesystem::path run =
      std::filesystem::path(::testing::TempDir()) / "meshtrain_flight_test";
  std::filesystem::remove_all(run);
  EXPECT_THROW(find_flight_dir(run.string()), Error);
  const std::string old_job = flight_job_name(1700000000, 11);
  const std::string new_job = flight_job_name(1800000000, 7);
  EXPECT_LT(old_job, new_job);
  for (const std::string& job : {old_job, new_job}) {
    const auto dir = run / "flight" / job;
    std::filesystem::create_directories(dir);
    FlightRecorder rec(4);
    rec.add_comm({"world", {0, 1}, 0});
    write_flight_dump((dir / flight_dump_name(0)).string(),
                      flight_dump_json(rec.snapshot(), {0, 2, job, "timeout"}));
  }
  const std::string dir = find_flight_dir(run.string());
  EXPECT_EQ(std::filesystem::path(dir).filename().string(), new_job);
  const std::vector<RankFlight> dumps = read_flight_dumps(dir);
  ASSERT_EQ(dumps.size(), 1u);
  EXPECT_EQ(dumps[0].job, new_job);
  EXPECT_FALSE(std::filesystem::exists(dir + "/rank_0.json.tmp"));
  std::filesystem::remove_all(run);
}

std::filesystem::path fresh_dir(const char* name) {
  const auto dir = std::filesystem::path(::testing::TempDir()) / name;
  std::filesystem::remove_all(dir);
  return dir;
}

TEST(WatchdogDeathTest, PastTheDeadlineItDumpsNamesTheCallAndEndsTheProcess) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const auto dir = fresh_dir("meshtrain_watchdog_deadline");
  EXPECT_EXIT(
      {
        FlightRecorder rec(16);
        const int dp = rec.add_comm({"dp", {0, 1}, 0});
        complete(rec, dp, 0, 3);
        rec.set_timeout(0.2);
        rec.start(rec.issue(dp, call(3)), CommClock::now());
        WatchdogOptions o;
        o.dir = dir.string();
        o.job = "job";
        o.world_size = 2;
        o.poll = std::chrono::milliseconds(20);
        o.gather = std::chrono::milliseconds(200);
        // What an NCCL run passes (abort_nccl_communicators): called before the report.
        o.abort_comms = [] { std::fputs("device communicators aborted\n", stderr); };
        Watchdog watchdog(rec, o, [](int code) { std::_Exit(code); });
        std::this_thread::sleep_for(std::chrono::seconds(20));
        std::_Exit(0);
      },
      ::testing::ExitedWithCode(7),
      "device communicators aborted\n"
      "rank 0: timeout: comm dp all_reduce seq 3 \\(4.00 KiB\\) not finished after 0\\.[0-9] s "
      "\\(comm.timeout_s = 0.2\\); ranks not arrived: 1 \\(no flight record");
  EXPECT_TRUE(std::filesystem::exists(dir / "deadline_passed"));
  const std::vector<RankFlight> dumps = read_flight_dumps(dir.string());
  ASSERT_EQ(dumps.size(), 1u);
  EXPECT_EQ(dumps[0].reason, "timeout");
  EXPECT_EQ(dumps[0].calls.back().state, CallState::running);
}

TEST(Watchdog, ARankSeeingThePeersMarkerDumpsWithinAPoll) {
  const auto dir = fresh_dir("meshtrain_watchdog_marker");
  FlightRecorder rec(16);
  const int dp = rec.add_comm({"dp", {0, 1}, 1});
  complete(rec, dp, 0, 5);
  WatchdogOptions o;
  o.dir = dir.string();
  o.job = "job";
  o.world_rank = 1;
  o.world_size = 2;
  o.poll = std::chrono::milliseconds(20);
  Watchdog watchdog(rec, o, [](int) { FAIL() << "no deadline passed here"; });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_FALSE(std::filesystem::exists(dir / "rank_1.json"));  // nothing to report yet
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "deadline_passed") << 0 << '\n';
  for (int i = 0; i < 100 && !std::filesystem::exists(dir / "rank_1.json"); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const std::vector<RankFlight> dumps = read_flight_dumps(dir.string());
  ASSERT_EQ(dumps.size(), 1u);
  EXPECT_EQ(dumps[0].rank, 1);
  EXPECT_EQ(dumps[0].reason, "peer timeout");
  EXPECT_FALSE(dumps[0].late());
  EXPECT_EQ(dumps[0].progress[0].issued, 5u);
}

}  // namespace
}  // namespace meshtrain
