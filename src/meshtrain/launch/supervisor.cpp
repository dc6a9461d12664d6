#include "meshtrain/launch/supervisor.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <deque>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>

#include <fmt/format.h>

#include "meshtrain/launch/policy.h"
#include "meshtrain/util/error.h"
#include "meshtrain/util/line_log.h"
#include "meshtrain/util/out_dir_lock.h"

namespace meshtrain::launch {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

// How long a relaunch waits for ranks of the attempt before to let go of out_dir.
constexpr double kOldRanksWaitS = 60;

// The signal handler's view (a signal handler can reach nothing else): how
// many SIGTERM/SIGINT arrived, and a pipe that wakes poll().
volatile sig_atomic_t g_signals = 0;
int g_wake_write = -1;

void on_signal(int) {
  g_signals = g_signals + 1;
  if (g_wake_write >= 0) {
    const char byte = 1;
    [[maybe_unused]] ssize_t n = ::write(g_wake_write, &byte, 1);
  }
}

// Installs the handlers for the supervisor's lifetime; restores the old ones.
class SignalScope {
 public:
  SignalScope() {
    int fds[2];
    MESHTRAIN_CHECK_AS(ErrorKind::resource, ::pipe2(fds, O_CLOEXEC | O_NONBLOCK) == 0,
                       "launch: pipe: {}", std::strerror(errno));
    wake_read_ = fds[0];
    g_wake_write = fds[1];
    struct sigaction action {};
    action.sa_handler = on_signal;
    sigemptyset(&action.sa_mask);
    ::sigaction(SIGTERM, &action, &old_term_);
    ::sigaction(SIGINT, &action, &old_int_);
  }
  ~SignalScope() {
    ::sigaction(SIGTERM, &old_term_, nullptr);
    ::sigaction(SIGINT, &old_int_, nullptr);
    ::close(wake_read_);
    ::close(g_wake_write);
    g_wake_write = -1;
  }
  int wake_fd() const { return wake_read_; }
  void drain() const {
    char buf[64];
    while (::read(wake_read_, buf, sizeof buf) > 0) {
    }
  }

 private:
  int wake_read_ = -1;
  struct sigaction old_term_ {}, old_int_ {};
};

double unix_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

struct SessionProcess {
  pid_t pid;
  std::string name;
};

// The processes whose session is `sid` (the child made itself a session
// leader, so this is the job and everything it started on this host).
std::vector<SessionProcess> session_processes(pid_t sid) {
  std::vector<SessionProcess> out;
  DIR* proc = ::opendir("/proc");
  if (proc == nullptr) return out;
  while (dirent* entry = ::readdir(proc)) {
    char* end = nullptr;
    const long pid = std::strtol(entry->d_name, &end, 10);
    if (end == entry->d_name || *end != '\0') continue;
    std::ifstream in(fmt::format("/proc/{}/stat", pid));
    std::string stat((std::istreambuf_iterator<char>(in)), {});
    // "pid (comm) state ppid pgrp session ...": comm may hold spaces and parentheses.
    const size_t open = stat.find('('), close = stat.rfind(')');
    if (open == std::string::npos || close == std::string::npos) continue;
    std::istringstream rest(stat.substr(close + 1));
    std::string state;
    long ppid = 0, pgrp = 0, session = 0;
    if (!(rest >> state >> ppid >> pgrp >> session)) continue;
    if (session == sid && state != "Z") {
      out.push_back({static_cast<pid_t>(pid), stat.substr(open + 1, close - open - 1)});
    }
  }
  ::closedir(proc);
  return out;
}

// A signal for the job: to every process of its session except Open MPI's
// launcher and daemons (mpirun answers SIGTERM by killing every rank a second
// later, odls_base_sigkill_timeout, too soon for a checkpoint); to the leader
// when nothing else is there yet (or it is srun, which forwards it).
void signal_job(pid_t leader, int sig) {
  int sent = 0;
  for (const SessionProcess& p : session_processes(leader)) {
    if (is_mpi_launcher(p.name)) continue;
    if (::kill(p.pid, sig) == 0) ++sent;
  }
  if (sent == 0) ::kill(leader, sig);
}

struct AttemptResult {
  int code = 0;
  std::vector<std::string> stderr_lines;  // the last ones
  double start = 0, end = 0;              // unix seconds
};

constexpr size_t kKeptLines = 200;

// Runs `argv` in a new session with its stderr through us (copied to ours,
// last lines kept); forwards SIGTERM/SIGINT; when the leader has exited,
// kills what it left behind in its session.
AttemptResult run_attempt(const Argv& argv, const SignalScope& signals, int* forwarded) {
  AttemptResult result;
  int err[2];
  MESHTRAIN_CHECK_AS(ErrorKind::resource, ::pipe2(err, O_CLOEXEC) == 0, "launch: pipe: {}",
                     std::strerror(errno));
  std::vector<char*> cargv;
  for (const std::string& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  result.start = unix_now();
  const pid_t pid = ::fork();
  MESHTRAIN_CHECK_AS(ErrorKind::resource, pid >= 0, "launch: fork: {}", std::strerror(errno));
  if (pid == 0) {
    ::setsid();
    ::dup2(err[1], STDERR_FILENO);
    ::signal(SIGTERM, SIG_DFL);
    ::signal(SIGINT, SIG_DFL);
    ::execvp(cargv[0], cargv.data());
    const std::string line =
        fmt::format("meshtrain launch: cannot run '{}': {}\n", argv[0], std::strerror(errno));
    [[maybe_unused]] ssize_t n = ::write(STDERR_FILENO, line.data(), line.size());
    ::_exit(127);
  }
  ::close(err[1]);
  std::deque<std::string> lines;
  std::string partial;
  bool exited = false, eof = false;
  int status = 0;
  Clock::time_point exited_at;
  auto keep = [&](std::string line) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    lines.push_back(std::move(line));
    if (lines.size() > kKeptLines) lines.pop_front();
  };
  while (true) {
    pollfd fds[2] = {{eof ? -1 : err[0], POLLIN, 0}, {signals.wake_fd(), POLLIN, 0}};
    ::poll(fds, 2, 100);
    if (!eof && (fds[0].revents & (POLLIN | POLLHUP | POLLERR))) {
      char buf[8192];
      const ssize_t n = ::read(err[0], buf, sizeof buf);
      if (n > 0) {
        [[maybe_unused]] ssize_t w = ::write(STDERR_FILENO, buf, static_cast<size_t>(n));
        partial.append(buf, static_cast<size_t>(n));
        for (size_t nl; (nl = partial.find('\n')) != std::string::npos;) {
          keep(partial.substr(0, nl));
          partial.erase(0, nl + 1);
        }
      } else if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
        eof = true;
      }
    }
    if (fds[1].revents & POLLIN) signals.drain();
    while (*forwarded < g_signals) {
      ++*forwarded;
      // As SIGTERM whichever came: srun answers SIGINT with a status report, not a forward.
      if (!exited) signal_job(pid, SIGTERM);
    }
    if (!exited && ::waitpid(pid, &status, WNOHANG) == pid) {
      exited = true;
      exited_at = Clock::now();
      result.end = unix_now();
    }
    if (exited) {
      // No rank left behind: what outlives the leader by 2 s is killed.
      const auto waited = Clock::now() - exited_at;
      if (waited > std::chrono::seconds(2)) {
        for (const SessionProcess& p : session_processes(pid)) ::kill(p.pid, SIGKILL);
      }
      if (eof || waited > std::chrono::seconds(5)) break;
    }
  }
  ::close(err[0]);
  if (!partial.empty()) keep(partial);
  result.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  result.stderr_lines.assign(lines.begin(), lines.end());
  return result;
}

std::string read_latest(const std::string& out_dir) {
  if (out_dir.empty()) return {};
  std::ifstream in(out_dir + "/latest");
  std::string name;
  std::getline(in, name);
  return name;
}

class LaunchLog {
 public:
  LaunchLog(const std::string& path, bool console) : console_(console) {
    if (!path.empty()) out_ = std::make_unique<LineLog>(path, false, "the launch log");
  }
  void record(const json& entry) {
    if (out_) out_->append(entry.dump());
  }
  void say(const std::string& line) {
    if (!console_) return;
    std::fflush(stdout);
    std::fprintf(stderr, "launch: %s\n", line.c_str());
    std::fflush(stderr);
  }

 private:
  std::unique_ptr<LineLog> out_;  // null: no log
  bool console_;
};

std::string describe_code(int code, const Decision& d) {
  if (d.kind == "signal") return fmt::format("exit {} (signal {}, {})", code, code - 128, strsignal(code - 128));
  return fmt::format("exit {} ({})", code, d.kind);
}

// Waits up to `seconds` unless a signal arrives; false when one did.
bool wait_unless_signalled(double seconds, const SignalScope& signals, int forwarded) {
  const auto until = Clock::now() + std::chrono::microseconds(static_cast<int64_t>(seconds * 1e6));
  while (Clock::now() < until) {
    if (g_signals > forwarded) return false;
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now()).count();
    pollfd fd{signals.wake_fd(), POLLIN, 0};
    ::poll(&fd, 1, static_cast<int>(std::clamp<int64_t>(left, 1, 100)));
    if (fd.revents & POLLIN) signals.drain();
  }
  return g_signals <= forwarded;
}

// A rank of the last attempt may outlive its leader (on another host, or stuck
// in I/O): a job started beside it would be refused (busy), so wait for it
// first. False when a signal came while waiting.
bool wait_for_old_ranks(const std::string& out_dir, LaunchLog& log, const SignalScope& signals,
                        int forwarded) {
  if (out_dir.empty()) return true;
  std::string holder = wait_out_dir_free(out_dir, 0);
  if (holder.empty()) return true;
  log.say(fmt::format("ranks of an earlier attempt still hold {} ({}): waiting up to {:.0f} s "
                      "before the relaunch",
                      out_dir, holder, kOldRanksWaitS));
  const auto until = Clock::now() + std::chrono::seconds(static_cast<int64_t>(kOldRanksWaitS));
  while (!holder.empty() && Clock::now() < until) {
    if (!wait_unless_signalled(0.2, signals, forwarded)) return false;
    holder = wait_out_dir_free(out_dir, 0);
  }
  return true;  // still held: the job says so itself (busy), and launch stops
}

}  // namespace

int failing_rank(const std::vector<std::string>& lines) {
  static const std::regex mpirun(R"(process rank (\d+) with PID .* exited on signal)");
  static const std::regex rank_line(R"(^rank (\d+): )");
  std::smatch m;
  for (const std::string& line : lines) {
    if (std::regex_search(line, m, mpirun)) return std::stoi(m[1].str());
  }
  for (const std::string& line : lines) {
    if (std::regex_search(line, m, rank_line)) return std::stoi(m[1].str());
  }
  return -1;
}

std::string cause_line(const std::vector<std::string>& lines) {
  static const std::regex ours(R"(^(rank \d+|meshtrain|meshtrain launch): )");
  for (auto it = lines.rbegin(); it != lines.rend(); ++it) {
    if (std::regex_search(*it, ours)) return *it;
  }
  for (auto it = lines.rbegin(); it != lines.rend(); ++it) {
    const bool blank = it->find_first_not_of(" \t-") == std::string::npos;
    if (!blank) return *it;
  }
  return {};
}

int shrunk_dp(int dp, int batch_size) {
  for (int d = dp - 1; d >= 1; --d) {
    if (batch_size > 0 && batch_size % d == 0) return d;
  }
  return 0;
}

int supervise(const Argv& command, const LaunchOptions& options) {
  MESHTRAIN_CHECK(!command.empty(), "launch: no command given (meshtrain launch [options] -- CMD...)");
  SignalScope signals;
  // out_dir is this launch's for its life (before its log is opened there).
  std::string no_locks;
  FileLock owner = options.out_dir.empty() ? FileLock() : lock_launch(options.out_dir, &no_locks);
  LaunchLog log(options.log_path, options.console);
  if (!no_locks.empty()) log.say(no_locks);
  const bool trains = !train_positions(command).empty();
  if (!trains) log.say("no `meshtrain train` in the command: a relaunch runs it unchanged");
  const std::vector<std::string> exported = {"MESHTRAIN_LAUNCH_ATTEMPT", "MESHTRAIN_LAUNCH_TIME"};
  Argv base = command;
  int forwarded = 0, restarts = 0, streak = 0, same_rank = 0, last_rank = -1;
  for (int attempt = 1;; ++attempt) {
    Argv argv = with_exported_env(attempt == 1 ? base : with_resume_auto(base), exported);
    const std::string latest_before = read_latest(options.out_dir);
    const double start = unix_now();
    ::setenv("MESHTRAIN_LAUNCH_ATTEMPT", std::to_string(attempt).c_str(), 1);
    ::setenv("MESHTRAIN_LAUNCH_TIME", fmt::format("{:.6f}", start).c_str(), 1);
    log.record({{"event", "start"}, {"attempt", attempt}, {"time", start}, {"command", argv}});
    log.say(fmt::format("attempt {}: {}", attempt, fmt::join(argv, " ")));
    AttemptResult r = run_attempt(argv, signals, &forwarded);
    const Decision d = decide(r.code);
    const std::string cause = r.code == 0 ? "" : cause_line(r.stderr_lines);
    const int rank = r.code == 0 ? -1 : failing_rank(r.stderr_lines);
    const std::string latest_after = read_latest(options.out_dir);
    const bool progress = latest_after != latest_before && !latest_after.empty();
    json end{{"event", "end"},      {"attempt", attempt}, {"time", r.end},
             {"duration_s", r.end - r.start}, {"exit_code", r.code}, {"kind", d.kind},
             {"cause", cause},      {"failing_rank", rank}, {"checkpoint", latest_after},
             {"progress", progress}};
    if (d.kind == "signal") end["signal"] = r.code - 128;
    const bool asked_to_stop = forwarded > 0;
    std::string verdict;
    double backoff = 0;
    if (d.action == Action::done) {
      verdict = "done";
    } else if (asked_to_stop) {
      verdict = "stop: launch was signalled";
    } else if (d.action == Action::stop) {
      verdict = fmt::format("stop: {} is not retried", d.kind);
    } else if (restarts >= options.max_restarts) {
      verdict = fmt::format("stop: {} restarts spent (--max-restarts)", restarts);
    } else {
      streak = progress ? 1 : streak + 1;
      backoff = d.preempted ? 0.0
                            : std::min(options.backoff_max_s,
                                       options.backoff_s * std::pow(2.0, streak - 1));
      verdict = fmt::format("relaunch in {:.1f} s (restart {} of {})", backoff, restarts + 1,
                            options.max_restarts);
    }
    end["action"] = verdict;
    end["backoff_s"] = backoff;
    log.record(end);
    log.say(fmt::format("attempt {} ended: {} after {:.1f} s{}; {}", attempt,
                        describe_code(r.code, d), r.end - r.start,
                        cause.empty() ? "" : fmt::format("; cause: {}", cause), verdict));
    if (!verdict.starts_with("relaunch")) {
      log.record({{"event", "finish"}, {"attempts", attempt}, {"restarts", restarts},
                  {"exit_code", r.code}, {"time", unix_now()}});
      return r.code;
    }
    ++restarts;
    // --shrink: the same rank failing again and again.
    same_rank = rank < 0 ? 0 : rank == last_rank ? same_rank + 1 : 1;
    last_rank = rank;
    if (options.shrink && same_rank >= options.shrink_after) {
      const std::optional<int> world = rank_count(base);
      const int per = std::max(1, options.ranks_per_replica);
      const int dp = world ? *world / per : 0;
      const int smaller = shrunk_dp(dp, options.batch_size);
      if (world && smaller > 0) {
        base = with_rank_count(base, smaller * per);
        log.record({{"event", "shrink"}, {"attempt", attempt}, {"failing_rank", rank},
                    {"from_ranks", *world}, {"to_ranks", smaller * per}, {"dp", smaller}});
        log.say(fmt::format("rank {} failed {} times in a row: {} ranks -> {} (dp {} -> {})", rank,
                            same_rank, *world, smaller * per, dp, smaller));
        same_rank = 0;
      } else {
        log.say(fmt::format("cannot shrink: {}", world ? "no smaller dp divides train.batch_size"
                                                       : "the command has no rank count"));
      }
    }
    if (!wait_unless_signalled(backoff, signals, forwarded) ||
        !wait_for_old_ranks(options.out_dir, log, signals, forwarded)) {
      log.record({{"event", "finish"}, {"attempts", attempt}, {"restarts", restarts - 1},
                  {"exit_code", r.code}, {"time", unix_now()}});
      log.say("signalled during the back-off: not relaunching");
      return r.code;
    }
  }
}

}  // namespace meshtrain::launch
