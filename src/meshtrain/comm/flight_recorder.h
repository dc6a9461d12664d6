// The flight recorder: every rank's last N communication calls (any
// communicator), pending ones included, with their state and deadline, and
// the membership of each communicator in world ranks. The watchdog
// (comm/watchdog.h) reads it to find a call past its deadline and dumps it as
// JSON (comm/flight_dump.h) for `meshtrain debug hang`.
//
// Invariants:
// - A call is recorded when issued (state queued), marked running when the
//   communication thread starts it and done/failed when it completes. Pending
//   calls are kept apart from the ring, so a call that never completes is never
//   pushed out by later ones; the ring holds the last `capacity` completed ones.
// - Each call carries the deadline in force when it was issued (set_timeout):
//   it is measured from the call's start, never from its queueing (a call
//   queued behind a stuck one is not the culprit).
// - Thread safe: calls are issued on compute threads, progressed on the
//   communication thread, read by the watchdog thread.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "meshtrain/comm/communicator.h"

namespace meshtrain {

enum class CallState : uint8_t { queued, running, done, failed };
std::string_view call_state_name(CallState state);

// A communicator as the recorder knows it: its name, its members' world ranks
// (in communicator rank order) and this process's rank in it.
struct CommIdentity {
  std::string name;
  std::vector<int> members;
  int rank = 0;
};

struct FlightEntry {
  uint64_t id = 0;  // issue order within this process, over all communicators
  int comm = 0;     // index into FlightSnapshot::comms
  CallRecord call;  // seq, op, bytes, peer; started/finished valid by state
  CallState state = CallState::queued;
  double timeout_s = 0;  // deadline after the start; 0 = none
};

// Per communicator: calls issued and the first one not yet finished here.
struct CommProgress {
  uint64_t issued = 0;
  uint64_t first_unfinished = 0;  // == issued when none is pending
};

struct FlightSnapshot {
  CommClock::time_point taken;
  std::vector<CommIdentity> comms;
  std::vector<CommProgress> progress;  // one per comm
  std::vector<FlightEntry> calls;      // completed (oldest first), then pending by id
};

class FlightRecorder {
 public:
  explicit FlightRecorder(size_t capacity = 1024) : capacity_(capacity) {}

  // Completed calls kept; 0 turns recording off (issue() returns 0 and the
  // other calls ignore id 0), which also leaves the watchdog nothing to watch.
  void set_capacity(size_t capacity);
  bool enabled() const;
  // The deadline of calls issued from now on (seconds after their start; 0 = none).
  void set_timeout(double seconds);
  double timeout() const;

  int add_comm(CommIdentity identity);  // returns its index
  // Records a call (its seq is set); returns its id (0 when off).
  uint64_t issue(int comm, const CallRecord& call);
  void start(uint64_t id, CommClock::time_point when);
  void finish(uint64_t id, const CallRecord& record, bool failed);

  FlightSnapshot snapshot() const;
  // The running call whose deadline passed longest ago at `now`, if any.
  std::optional<FlightEntry> overdue(CommClock::time_point now) const;

 private:
  mutable std::mutex mutex_;
  size_t capacity_;
  double timeout_s_ = 0;
  uint64_t next_id_ = 1;
  std::vector<CommIdentity> comms_;
  std::vector<CommProgress> progress_;
  std::map<uint64_t, FlightEntry> pending_;
  std::vector<FlightEntry> ring_;  // circular once full
  size_t ring_next_ = 0;
};

}  // namespace meshtrain
