// The deadline of communication calls by phase of the run, as a step hook:
// comm.timeout_s for the calls of training steps, comm.long_timeout_s for
// everything else (start-up and a resume's load, the first step this process
// runs — ranks arrive from start-ups of different lengths —, evaluation,
// checkpoints, the end). A rank writing a checkpoint while the others wait in
// its barrier is a legitimate long wait, so it gets the long deadline; inside
// a step every rank does the same work and a long wait is a fault.
#pragma once

#include "meshtrain/comm/flight_recorder.h"
#include "meshtrain/train/config.h"
#include "meshtrain/train/step.h"

namespace meshtrain {

class CommDeadlines final : public StepHook {
 public:
  // Sets the long deadline now. `recorder` must outlive the hook.
  CommDeadlines(FlightRecorder& recorder, const CommSettings& settings);
  void before_step(int64_t step) override;
  void on_step(const StepRecord& record) override;

 private:
  FlightRecorder& recorder_;
  CommSettings settings_;
  bool first_ = true;
};

}  // namespace meshtrain
