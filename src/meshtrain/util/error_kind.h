// Errors carry their context (file, field, tensor, rank) in the message and a
// kind that says what recovery can do about them; the CLI turns any Error into
// one line on stderr and the kind's exit code (docs/errors.md). This header
// has no fmt, for code that cannot include it (CUDA translation units: fmt's
// compile-time format strings do not build under nvcc); util/error.h adds the
// formatting helpers everything else uses.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

namespace meshtrain {

// What went wrong, by what a supervisor (meshtrain launch) can do about it:
//   config     the input is wrong (config, options, data, shapes): fix it, do not retry
//   io         a file system call failed (open, write, fsync, no space): retry may help
//   corrupt    a file is damaged (checksum, truncation): use another checkpoint
//   diverged   training went non-finite or unstable beyond the guard's remedies
//   peer       another rank failed or the job's communication broke: relaunch
//   timeout    a collective or a peer passed its deadline (the watchdog): relaunch
//   resource   the run does not fit the machine (memory, disk): change the layout
//   busy       another live run holds the out_dir: wait for it, or use another
//   preempted  asked to stop (SIGTERM/SIGINT); a checkpoint was written: resume
enum class ErrorKind : uint8_t {
  config,
  io,
  corrupt,
  diverged,
  peer,
  timeout,
  resource,
  busy,
  preempted
};
inline constexpr int kErrorKinds = 9;

std::string_view error_kind_name(ErrorKind kind);
// The process exit code of each kind: config 1 (2 is the CLI's usage error),
// io 3, corrupt 4, diverged 5, peer 6, timeout 7, resource 8, busy 9, preempted 75
// (EX_TEMPFAIL: "try again": resume from the checkpoint just written).
int exit_code(ErrorKind kind);
// The kind an exit code stands for; false for 0, 2 and codes no kind uses.
bool kind_of_exit_code(int code, ErrorKind* kind);

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message, ErrorKind kind = ErrorKind::config)
      : std::runtime_error(message), kind_(kind) {}
  explicit Error(const char* message, ErrorKind kind = ErrorKind::config)
      : std::runtime_error(message), kind_(kind) {}
  ErrorKind kind() const { return kind_; }

 private:
  ErrorKind kind_;
};

}  // namespace meshtrain
