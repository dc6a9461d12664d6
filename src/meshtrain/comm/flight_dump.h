// Flight records on disk and the hang diagnosis over them (no MPI).
//
// When a deadline passes, every reachable rank writes its recorder as
// `<out_dir>/flight/<job>/rank_<R>.json` (written to a temp file and renamed,
// so a reader never sees half a dump). `diagnose_hang` reads a set of dumps:
// per communicator (name + member world ranks) the first sequence number
// where the ranks disagree, who is in that call, who is behind or ahead, and
// which members left no dump (stopped, dead or cut off).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "meshtrain/comm/flight_recorder.h"

namespace meshtrain {

// One call as read back from a dump; times are seconds before the dump was
// taken (-1 when the call has not reached that point).
struct DumpedCall {
  int comm = 0;
  uint64_t seq = 0;
  std::string op, dtype;
  uint64_t bytes = 0;
  int peer = -1;
  CallState state = CallState::queued;
  double submitted_ago_s = -1, started_ago_s = -1, finished_ago_s = -1;
  double timeout_s = 0;
};

// How long a timed-out rank waits for the others' dumps. A dump written later
// than this after the deadline marker comes from a rank that was stalled
// until the job was being ended (mpirun's SIGCONT before the kill wakes a
// stopped rank for a moment): it is "late", and counts as not arrived.
inline constexpr double kFlightGatherSeconds = 2.0;

struct RankFlight {
  int rank = 0, world_size = 1;
  std::string job, host, reason;  // reason: "timeout" (this rank's deadline) or "peer timeout"
  int pid = 0;
  double marker_age_s = 0;  // seconds between the deadline marker and this dump
  bool late() const { return marker_age_s > kFlightGatherSeconds; }
  std::vector<CommIdentity> comms;
  std::vector<CommProgress> progress;
  std::vector<DumpedCall> calls;
};

struct DumpInfo {
  int rank = 0, world_size = 1;
  std::string job, reason;
  double marker_age_s = 0;
};

std::string flight_dump_json(const FlightSnapshot& snapshot, const DumpInfo& info);
// Atomic: `path`.tmp then rename. Throws Error (io) naming the file.
void write_flight_dump(const std::string& path, const std::string& json_text);
// Throws Error (corrupt) naming `source` on malformed input.
RankFlight parse_flight_dump(const std::string& json_text, const std::string& source);

// `rank_<R>.json` of a dump directory.
std::string flight_dump_name(int rank);
// Every rank_*.json in `dir`, by rank.
std::vector<RankFlight> read_flight_dumps(const std::string& dir);
// A run's newest dump directory: `run_dir`/flight/<newest job>, or `run_dir`
// itself when it holds rank_*.json. Throws Error naming what is missing.
std::string find_flight_dir(const std::string& run_dir);

// A member that has not issued the call the others wait in.
struct BehindRank {
  int rank = 0;
  uint64_t issued = 0;  // its calls on the communicator (so its last is seq issued - 1)
  bool queued = false;  // it issued the call, which waits behind another of its calls
};

struct CommHang {
  CommIdentity comm;  // rank: unused
  uint64_t seq = 0;   // the first sequence number not finished by every member
  std::string op, dtype;
  uint64_t bytes = 0;
  double waited_s = 0;          // the longest any member has been in it
  std::vector<int> in_call;     // members in that call (issued, not finished)
  std::vector<int> ahead;       // members past it (they finished it; a collective a member
                                // was stopped inside can complete on some of the others)
  std::vector<uint64_t> ahead_at;  // of each: its first unfinished seq (== issued: none pending)
  std::vector<BehindRank> behind;  // members that have not issued it
  std::vector<int> missing;     // members without a dump
  std::vector<int> late;        // members whose dump is late (stalled until the end)
};

struct HangDiagnosis {
  int world_size = 0;
  std::vector<int> dumped, missing;  // world ranks with and without a dump
  std::vector<int> late;             // of dumped: late dumps (stalled ranks woken by the kill)
  std::vector<int> timed_out;        // ranks whose own deadline passed
  std::vector<CommHang> hangs;       // communicators with a pending call, longest wait first
  std::vector<int> suspects;         // the ranks the others wait for (missing and late first)
};

HangDiagnosis diagnose_hang(const std::vector<RankFlight>& dumps);
// Who is where relative to call `seq` of `comm` (the watchdog's own stuck call).
CommHang hang_at(const std::vector<RankFlight>& dumps, const CommIdentity& comm, uint64_t seq);
// The report `meshtrain debug hang` prints (several lines).
std::string format_hang_report(const HangDiagnosis& diagnosis, const std::string& dir);
// For one hang: "3 (no flight record: stopped, dead or unreachable), 2 (behind: at seq 55)".
std::string describe_not_arrived(const CommHang& hang);

}  // namespace meshtrain
