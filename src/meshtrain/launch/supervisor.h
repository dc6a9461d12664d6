// `meshtrain launch`: runs a job command as a child in its own session,
// forwards SIGTERM/SIGINT to its ranks, and on a failure relaunches it with
// `--resume auto` after a back-off, up to max_restarts times; every attempt
// is logged as JSONL and as one console line. docs/launch.md.
#pragma once

#include <string>
#include <vector>

#include "meshtrain/launch/command.h"

namespace meshtrain::launch {

struct LaunchOptions {
  int max_restarts = 3;
  double backoff_s = 1.0;       // the first failure's wait, doubled per failure without progress
  double backoff_max_s = 60.0;
  // --shrink: after `shrink_after` consecutive failures naming the same rank,
  // relaunch with fewer data-parallel ranks (world = dp' x ranks_per_replica,
  // dp' the largest divisor of batch_size below dp).
  bool shrink = false;
  int shrink_after = 2;
  int ranks_per_replica = 1;  // tp x pp
  int batch_size = 0;         // train.batch_size (0: unknown, no shrinking)
  std::string log_path;       // the JSONL log; empty: none
  // The run's out_dir: its `latest` tells whether an attempt made progress
  // (a new checkpoint resets the back-off and the shrink count); empty: unknown.
  std::string out_dir;
  bool console = true;        // one line per attempt on stderr
};

// Runs the job until it succeeds, fails with a kind that a retry cannot fix,
// or max_restarts relaunches are spent; returns the exit code to exit with
// (the last attempt's). A SIGTERM/SIGINT to this process is forwarded, and
// ends the supervision once the job exits (no relaunch: whoever sent it
// wants the job gone; exit 75 tells them it can be resumed).
int supervise(const Argv& command, const LaunchOptions& options);

// The rank named as the failing one in a job's stderr: mpirun's "process
// rank N ... exited on signal" or the first "rank N: " line; -1 when none.
int failing_rank(const std::vector<std::string>& stderr_lines);
// The line that says why a job failed: the last "rank N: " or "meshtrain: "
// line, else the last non-empty line that is not a banner of dashes.
std::string cause_line(const std::vector<std::string>& stderr_lines);
// The largest divisor of batch_size below dp; 0 when none (dp 1).
int shrunk_dp(int dp, int batch_size);

}  // namespace meshtrain::launch
