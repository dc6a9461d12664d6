// Preemption: SIGTERM / SIGINT (what Slurm and cloud schedulers send before
// they kill a job) end the run cleanly at the next step boundary with a
// checkpoint and ErrorKind::preempted (exit 75: "resume me").
//
// The handler only sets a flag (async-signal-safe). After each step the hook
// agrees over the world whether any rank was signalled (one 8-byte
// all-reduce: ranks receive the signal at different times, or only some of
// them); if so every rank writes the checkpoint (synchronously, after any
// pending async save) and throws the preempted Error, which the CLI turns into
// exit 75 on every rank. The last step is not interrupted (the run ends with
// its checkpoint anyway). The handler is installed with SA_RESETHAND: a second
// signal takes the default action and kills the process at once (the save is
// abandoned; the previous checkpoint stays valid).
#pragma once

#include <csignal>
#include <functional>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/train/step.h"

namespace meshtrain {

class Trainer;

// Installs the SIGTERM/SIGINT handler for its lifetime (one per process: the
// flag is process-wide, as signals are); restores the previous handlers.
class PreemptionSignals {
 public:
  PreemptionSignals();
  ~PreemptionSignals();
  PreemptionSignals(const PreemptionSignals&) = delete;
  PreemptionSignals& operator=(const PreemptionSignals&) = delete;
  // The first signal received since installation; 0 when none.
  static int received();

 private:
  struct sigaction old_term_ {}, old_int_ {};
};

class PreemptionHook final : public StepHook {
 public:
  // world: every rank of the job (null: a single process). `trainer` must outlive the hook.
  // The vote runs under the step's communication deadline (add this hook before
  // CommDeadlines, whose on_step switches to the long one): a rank stalled
  // between steps is then caught within comm.timeout_s. `before_checkpoint`
  // (optional) runs before the preemption checkpoint: it switches to the long
  // deadline a checkpoint needs.
  PreemptionHook(Trainer& trainer, Communicator* world,
                 std::function<void()> before_checkpoint = {});
  void on_step(const StepRecord& record) override;

 private:
  Trainer& trainer_;
  Communicator* world_;
  std::function<void()> before_checkpoint_;
};

}  // namespace meshtrain
