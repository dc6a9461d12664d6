// One run per out_dir (docs/launch.md#one-run-per-out_dir). Two lock files
// in out_dir, each an flock(2) that dies with its holder:
//   owner.lock  exclusive, for its life, by `meshtrain launch`, or by the rank 0
//               of a job that launch did not start: two of them never share out_dir;
//   ranks.lock  shared, by every rank of the job, for its life. A rank 0 takes it
//               exclusively once before that: if it cannot within 5 s, a rank of
//               an earlier job still runs (a relaunch while an old rank drains),
//               and the job is refused. (The 5 s let the ranks of a job that
//               has just ended there finish unwinding.)
// A refusal is an Error of kind busy naming out_dir and the holder's host and
// pid. On a file system without locks (flock fails with ENOLCK, EOPNOTSUPP or
// ENOSYS) nothing is held and the caller gets a warning instead.
#pragma once

#include <string>

#include "meshtrain/util/file_lock.h"

namespace meshtrain {

struct OutDirLocks {
  FileLock owner, ranks;
};

// Rank 0, before anything in out_dir is read or written (created here when
// missing). `under_launch`: this job is a `meshtrain launch` attempt (owner.lock
// is its supervisor's). `warning` is set when the file system has no locks.
OutDirLocks lock_out_dir(const std::string& out_dir, bool under_launch, std::string* warning);
// Every other rank, once rank 0 holds out_dir: ranks.lock, shared.
FileLock join_out_dir(const std::string& out_dir);
// `meshtrain launch`, for its life: owner.lock, exclusive.
FileLock lock_launch(const std::string& out_dir, std::string* warning);
// launch, before a relaunch: waits up to `seconds` for every rank of earlier
// jobs to let go of out_dir. "" when none holds it any more, else who does.
std::string wait_out_dir_free(const std::string& out_dir, double seconds);

}  // namespace meshtrain
