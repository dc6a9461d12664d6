#include "meshtrain/plan/failures.h"

#include <cmath>

#include "meshtrain/util/error.h"

namespace meshtrain::plan {

double young_interval(double delta, double mtbf) { return std::sqrt(2 * delta * mtbf); }

double daly_interval(double delta, double mtbf) {
  if (delta >= 2 * mtbf) return mtbf;
  const double x = delta / (2 * mtbf);
  return std::sqrt(2 * delta * mtbf) * (1 + std::sqrt(x) / 3 + x / 9) - delta;
}

double daly_wall_seconds(double solve, double tau, double delta, double restart, double mtbf) {
  return mtbf * std::exp(restart / mtbf) * std::expm1((tau + delta) / mtbf) * solve / tau;
}

Goodput plan_goodput(double solve, int64_t gpus, double delta, double interval,
                     const FailureModel& f) {
  MESHTRAIN_CHECK(f.failures_per_gpu_hour >= 0, "plan: --failures-per-gpu-hour must be >= 0");
  MESHTRAIN_CHECK(f.restart_seconds >= 0, "plan: --restart-min must be >= 0");
  Goodput g;
  g.checkpoint_seconds = delta;
  const double rate = f.failures_per_gpu_hour * static_cast<double>(gpus) / 3600.0;  // per s
  if (rate <= 0) {  // no failures: only the checkpoint writes cost time
    g.interval_seconds = interval > 0 ? interval : 0;
    g.wall_seconds = solve + (g.interval_seconds > 0 ? solve / g.interval_seconds * delta : 0);
    g.goodput = g.wall_seconds > 0 ? solve / g.wall_seconds : 1;
    return g;
  }
  g.mtbf_seconds = 1 / rate;
  g.interval_seconds = interval > 0 ? interval : daly_interval(delta, g.mtbf_seconds);
  g.wall_seconds =
      daly_wall_seconds(solve, g.interval_seconds, delta, f.restart_seconds, g.mtbf_seconds);
  g.failures = g.wall_seconds / g.mtbf_seconds;
  g.lost_per_failure = (g.interval_seconds + delta) / 2 + f.restart_seconds;
  g.goodput = solve / g.wall_seconds;
  return g;
}

}  // namespace meshtrain::plan
