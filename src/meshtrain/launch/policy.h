// What `meshtrain launch` does when its job ends: the restart policy, by the
// exit status's kind (docs/errors.md; docs/launch.md has the table).
#pragma once

#include <string>

namespace meshtrain::launch {

enum class Action { done, stop, relaunch };

struct Decision {
  Action action = Action::stop;
  std::string kind;  // "ok", an ErrorKind's name, "usage", "signal", "exec", "unknown"
  bool preempted = false;  // exit 75: a checkpoint was just written (no back-off)
};

// `code` as a shell reports it: the exit code, or 128 + the signal of a
// process killed by one (mpirun exits 137 when a rank is killed by SIGKILL).
//   0                                  done
//   config 1, usage 2, diverged 5, resource 8, busy 9,
//   126/127 (the command cannot run)   stop with that code
//   io 3, corrupt 4, peer 6, timeout 7, preempted 75,
//   signal deaths (129..159), others   relaunch
Decision decide(int code);

}  // namespace meshtrain::launch
