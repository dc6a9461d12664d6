#include "meshtrain/comm/watchdog.h"

#include <fmt/format.h>
#include <sys/stat.h>

#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>

#include "meshtrain/comm/flight_dump.h"
#include "meshtrain/tensor/memory_tracker.h"
#include "meshtrain/util/error.h"

namespace meshtrain {

namespace fs = std::filesystem;

namespace {

constexpr const char* kMarker = "deadline_passed";

bool exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

}  // namespace

std::string flight_job_name(int64_t unix_seconds, int64_t pid) {
  const std::time_t t = static_cast<std::time_t>(unix_seconds);
  std::tm tm{};
  ::gmtime_r(&t, &tm);
  char text[32];
  std::strftime(text, sizeof(text), "%Y%m%dT%H%M%SZ", &tm);
  return fmt::format("{}-{}", text, pid);
}

Watchdog::Watchdog(const FlightRecorder& recorder, WatchdogOptions options,
                   std::function<void(int)> end_job)
    : recorder_(recorder),
      options_(std::move(options)),
      end_job_(std::move(end_job)),
      thread_([this] { loop(); }) {}

Watchdog::~Watchdog() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  wake_.notify_one();
  thread_.join();
}

void Watchdog::loop() {
  const std::string marker = options_.dir + "/" + kMarker;
  std::unique_lock lock(mutex_);
  while (!wake_.wait_for(lock, options_.poll, [&] { return stop_; })) {
    lock.unlock();
    // A peer's deadline first: a rank stopped and woken again dumps late and
    // does not report its own overdue call (the reporter named it).
    if (!dumped_ && exists(marker)) {
      try {
        dump("peer timeout");
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: watchdog: %s\n", options_.world_rank, e.what());
      }
    }
    if (auto stuck = recorder_.overdue(CommClock::now())) on_deadline(*stuck);
    lock.lock();
  }
}

void Watchdog::dump(const char* reason) {
  dumped_ = true;
  fs::create_directories(options_.dir);
  DumpInfo info{options_.world_rank, options_.world_size, options_.job, reason, 0};
  // Wall clock (the marker may come from another node): how late this dump is.
  struct stat st {};
  if (::stat((options_.dir + "/" + kMarker).c_str(), &st) == 0) {
    timespec now{};
    ::clock_gettime(CLOCK_REALTIME, &now);
    info.marker_age_s = static_cast<double>(now.tv_sec - st.st_mtim.tv_sec) +
                        1e-9 * static_cast<double>(now.tv_nsec - st.st_mtim.tv_nsec);
  }
  late_ = info.marker_age_s > kFlightGatherSeconds;
  write_flight_dump(options_.dir + "/" + flight_dump_name(options_.world_rank),
                    flight_dump_json(recorder_.snapshot(), info));
}

std::string Watchdog::timeout_line(const FlightEntry& stuck, double waited_s) const {
  const FlightSnapshot snap = recorder_.snapshot();
  const CommIdentity& comm = snap.comms[static_cast<size_t>(stuck.comm)];
  std::vector<RankFlight> dumps;
  try {
    dumps = read_flight_dumps(options_.dir);
  } catch (const std::exception&) {
    // A damaged dump of another rank: report without them.
  }
  const CommHang hang = hang_at(dumps, comm, stuck.call.seq);
  return fmt::format(
      "rank {}: timeout: comm {} {} seq {} ({}) not finished after {:.1f} s (comm.timeout_s = "
      "{}); ranks not arrived: {}; flight records in {}/",
      options_.world_rank, comm.name, comm_op_name(stuck.call.op), stuck.call.seq,
      format_bytes(stuck.call.bytes), waited_s, stuck.timeout_s, describe_not_arrived(hang),
      options_.dir);
}

void Watchdog::on_deadline(const FlightEntry& stuck) {
  const double waited_s =
      std::chrono::duration<double>(CommClock::now() - stuck.call.started).count();
  const int code = exit_code(ErrorKind::timeout);
  std::string line;
  try {
    if (options_.abort_comms) options_.abort_comms();
    fs::create_directories(options_.dir);
    if (!exists(options_.dir + "/" + kMarker)) {
      std::ofstream(options_.dir + "/" + kMarker) << options_.world_rank << '\n';
    }
    if (!dumped_) dump("timeout");
    // The others dump within a poll of seeing the marker; stopped or dead ranks never do.
    const auto until = CommClock::now() + options_.gather;
    for (;;) {
      int present = 0;
      for (int r = 0; r < options_.world_size; ++r) {
        present += exists(options_.dir + "/" + flight_dump_name(r)) ? 1 : 0;
      }
      if (present == options_.world_size || CommClock::now() >= until) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    line = timeout_line(stuck, waited_s);
  } catch (const std::exception& e) {
    line = fmt::format("rank {}: timeout: call seq {} not finished after {:.1f} s ({})",
                       options_.world_rank, stuck.call.seq, waited_s, e.what());
  }
  std::fflush(stdout);
  if (!late_) {
    line += '\n';
    std::fputs(line.c_str(), stderr);
    std::fflush(stderr);
  }
  // MPI_Abort may block when the job's launcher is out of reach (a link
  // down between nodes): this process ends on its own regardless.
  std::thread([code] {
    std::this_thread::sleep_for(std::chrono::seconds(5));
    std::_Exit(code);
  }).detach();
  end_job_(code);
  std::_Exit(code);
}

}  // namespace meshtrain
