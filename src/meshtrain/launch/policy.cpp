#include "meshtrain/launch/policy.h"

#include "meshtrain/util/error.h"

namespace meshtrain::launch {

Decision decide(int code) {
  if (code == 0) return {Action::done, "ok"};
  if (code == 2) return {Action::stop, "usage"};
  if (code == 126 || code == 127) return {Action::stop, "exec"};
  ErrorKind kind;
  if (kind_of_exit_code(code, &kind)) {
    const std::string name(error_kind_name(kind));
    switch (kind) {
      case ErrorKind::config:
      case ErrorKind::diverged:
      case ErrorKind::resource:
      case ErrorKind::busy: return {Action::stop, name};
      case ErrorKind::preempted: return {Action::relaunch, name, true};
      case ErrorKind::io:
      case ErrorKind::corrupt:
      case ErrorKind::peer:
      case ErrorKind::timeout: return {Action::relaunch, name};
    }
  }
  if (code > 128 && code < 160) return {Action::relaunch, "signal"};
  // mpirun's own failures and anything else unclassified: relaunch, bounded by --max-restarts.
  return {Action::relaunch, "unknown"};
}

}  // namespace meshtrain::launch
