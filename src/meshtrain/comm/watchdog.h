// The hang watchdog: a thread per process that needs no MPI.
//
// A stuck call blocks the communication thread (and, under
// MPI_THREAD_SERIALIZED, MPI itself), so nothing that goes through MPI can
// report it. The watchdog polls the flight recorder for a running call past
// its deadline; the side channel between ranks is files in the job's flight
// directory (out_dir/flight/<job>/), which a stopped peer or a cut link does
// not block:
//   1. the rank whose deadline passed creates `deadline_passed` and writes
//      its dump (rank_<R>.json, atomically);
//   2. every other rank's watchdog sees the marker within a poll and writes
//      its dump too (a stopped or dead rank cannot: its dump stays missing, or
//      comes late, when mpirun's SIGCONT before the kill wakes it: marked so);
//   3. the timed-out rank (its device communicators aborted first,
//      WatchdogOptions::abort_comms) waits up to `gather` for the dumps, names the call
//      (communicator, op, seq, bytes) and the members that have not arrived
//      (no dump, or behind in that communicator's sequence) in one line on
//      stderr, and calls end_job(exit code of ErrorKind::timeout), which must
//      not return (MPI_Abort: mpirun then kills every rank, a stopped one
//      included, since SIGKILL reaches stopped processes); if it does not
//      end the process within 5 s (the launcher out of reach), _Exit does.
// Every rank whose own deadline passes ends this way, so a rank cut off from
// mpirun (a link down) does not outlive the job.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "meshtrain/comm/flight_recorder.h"

namespace meshtrain {

struct WatchdogOptions {
  std::string dir;  // this job's flight directory (created when first needed)
  std::string job;  // the job's name (the same on every rank)
  int world_rank = 0, world_size = 1;
  std::chrono::milliseconds poll{100};
  // How long a timed-out rank waits for the others' dumps (kFlightGatherSeconds).
  std::chrono::milliseconds gather{2000};
  // Called first when this rank's deadline passes, before the dumps and the
  // report: device communicators are aborted here (abort_nccl_communicators)
  // so that no GPU kernel keeps waiting for a peer while the job ends.
  std::function<void()> abort_comms;
};

// A job name shared by the ranks: "<UTC start>-<rank 0's pid>", sortable by time.
std::string flight_job_name(int64_t unix_seconds, int64_t pid);

class Watchdog {
 public:
  // Starts the thread. `recorder` must outlive the watchdog.
  Watchdog(const FlightRecorder& recorder, WatchdogOptions options,
           std::function<void(int exit_code)> end_job);
  ~Watchdog();  // stops the thread (unless it is ending the job)
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // The line a timed-out rank prints (exposed for tests), after the dumps were gathered.
  std::string timeout_line(const FlightEntry& stuck, double waited_s) const;

 private:
  void loop();
  void dump(const char* reason);
  [[noreturn]] void on_deadline(const FlightEntry& stuck);

  const FlightRecorder& recorder_;
  WatchdogOptions options_;
  std::function<void(int)> end_job_;
  bool dumped_ = false;
  bool late_ = false;  // this rank's dump came after the gather: it was the stalled one
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::thread thread_;  // last
};

}  // namespace meshtrain
