// Straggler detection, as a step hook. Every `interval` steps each rank's
// breakdown of the steps since the last report — compute, data wait,
// communication wait, optimizer — is gathered over the world (one small
// all-reduce). In a synchronous job every rank's step takes as long as the
// slowest rank's, so the hook compares each rank's own work (step minus
// communication wait: what it spent before its peers could proceed) with the
// median rank's; a rank more than `threshold` above it is named with the
// phase whose excess over that phase's median is largest. One console line
// (rank 0) and a metrics record {"event": "stragglers", ...} with every
// rank's breakdown (each rank's metrics file) per report. The first step the
// hook sees (warm-up: allocation, first touches) is left out.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/train/step.h"

namespace meshtrain {

class MetricsLog;

// One rank's milliseconds over a report's steps.
struct StepBreakdown {
  double step_ms = 0, compute_ms = 0, data_ms = 0, comm_wait_ms = 0, optimizer_ms = 0;
  double own_ms() const { return step_ms - comm_wait_ms; }  // work this rank's peers waited for
  void add(const StepRecord& record);
};

struct Straggler {
  int rank = 0;
  std::string phase;       // "compute", "data", "optimizer"
  double excess = 0;       // own work over the median's, as a fraction (0.5 = 50% slower)
  double phase_excess_ms = 0;  // the phase's time over the phase's median
};

// The ranks of `ranks` (index = rank) whose own work exceeds the median's by
// more than `threshold`, slowest first.
std::vector<Straggler> find_stragglers(const std::vector<StepBreakdown>& ranks, double threshold);

class StragglerHook final : public StepHook {
 public:
  // world, metrics must outlive the hook; console: rank 0 prints.
  StragglerHook(Communicator& world, MetricsLog& metrics, int64_t interval, double threshold,
                bool console);
  void on_step(const StepRecord& record) override;  // collective every `interval` steps

 private:
  Communicator& world_;
  MetricsLog& metrics_;
  int64_t interval_;
  double threshold_;
  bool console_;
  StepBreakdown mine_;
  int64_t steps_ = 0;
  bool warm_ = false;  // past the first step this hook saw (left out: warm-up)
};

// Test hook MESHTRAIN_SLOW_RANK=<rank>:<ms>[:<phase>]: the milliseconds world
// rank `world_rank` sleeps in phase "data" (the default: each micro-batch's
// loading), "compute" (each step's, before its forward and backward) or
// "optimizer" (each update).
struct SlowRankDelays {
  double data_ms = 0, compute_ms = 0, optimizer_ms = 0;
};
SlowRankDelays slow_rank_delays(int world_rank);
// Sleeps `ms` milliseconds (nothing for 0).
void sleep_ms(double ms);

}  // namespace meshtrain
