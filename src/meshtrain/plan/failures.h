// Failures and goodput of a long run: checkpoint interval (Young 1974, Daly
// 2006), the work lost to each interruption, and the wall-clock time the
// failure-free training time becomes. Formulas and sources: docs/plan.md.
#pragma once

#include <cstdint>

namespace meshtrain::plan {

// Llama 3 (Dubey et al. 2024, section 3.3.4): 419 unexpected interruptions in
// 54 days of pre-training on 16,384 H100s.
inline constexpr double kLlama3FailuresPerGpuHour = 419.0 / (54.0 * 24.0 * 16384.0);

struct FailureModel {
  double failures_per_gpu_hour = kLlama3FailuresPerGpuHour;
  double restart_seconds = 600;  // detect, reschedule, reload the checkpoint, warm up
};

// Young: tau = sqrt(2 delta M), delta = checkpoint write time, M = the job's MTBF.
double young_interval(double checkpoint_seconds, double mtbf_seconds);
// Daly's higher-order optimum: sqrt(2 delta M) (1 + sqrt(delta / 2M) / 3 + delta / 18M) - delta
// for delta < 2M, else M.
double daly_interval(double checkpoint_seconds, double mtbf_seconds);
// Daly's expected wall time for solve time Ts, computing tau between
// checkpoints of delta, restarts of R, exponential failures of mean M:
//   M e^(R/M) (e^((tau + delta)/M) - 1) Ts / tau.
double daly_wall_seconds(double solve_seconds, double interval, double checkpoint_seconds,
                         double restart_seconds, double mtbf_seconds);

struct Goodput {
  double mtbf_seconds = 0;      // of the whole job: 1 / (rate x GPUs)
  double interval_seconds = 0;  // between checkpoints
  double checkpoint_seconds = 0;
  double failures = 0;          // expected over the run
  double lost_per_failure = 0;  // half an interval of work + a checkpoint + the restart
  double wall_seconds = 0;      // solve time + checkpoints + lost work + restarts
  double goodput = 1;           // solve / wall
};
// interval <= 0: Daly's optimum. solve_seconds: the failure-free compute time
// without checkpoint writes.
Goodput plan_goodput(double solve_seconds, int64_t gpus, double checkpoint_seconds,
                     double interval, const FailureModel& failures);

}  // namespace meshtrain::plan
