#include "meshtrain/train/preemption.h"

#include "meshtrain/train/distributed.h"
#include "meshtrain/train/trainer.h"
#include "meshtrain/util/error.h"

namespace meshtrain {
namespace {

// Process-wide by nature: a signal handler can reach nothing else.
volatile sig_atomic_t g_received = 0;

void on_signal(int sig) {
  if (g_received == 0) g_received = sig;
}

}  // namespace

PreemptionSignals::PreemptionSignals() {
  g_received = 0;
  struct sigaction action {};
  action.sa_handler = on_signal;
  action.sa_flags = SA_RESETHAND;  // a second signal kills: the save is abandoned
  sigemptyset(&action.sa_mask);
  ::sigaction(SIGTERM, &action, &old_term_);
  ::sigaction(SIGINT, &action, &old_int_);
}

PreemptionSignals::~PreemptionSignals() {
  ::sigaction(SIGTERM, &old_term_, nullptr);
  ::sigaction(SIGINT, &old_int_, nullptr);
}

int PreemptionSignals::received() { return g_received; }

PreemptionHook::PreemptionHook(Trainer& trainer, Communicator* world,
                               std::function<void()> before_checkpoint)
    : trainer_(trainer), world_(world), before_checkpoint_(std::move(before_checkpoint)) {}

void PreemptionHook::on_step(const StepRecord& record) {
  if (record.step >= trainer_.config().train.steps) return;  // the run ends here anyway
  const int sig = PreemptionSignals::received();
  double signalled = sig != 0 ? 1.0 : 0.0;
  if (world_ != nullptr && world_->size() > 1) signalled = sum_over_ranks(*world_, signalled);
  if (signalled == 0) return;
  if (before_checkpoint_) before_checkpoint_();
  const std::string dir = trainer_.checkpoint_now();
  trainer_.log_event({{"event", "preempted"},
                      {"step", record.step},
                      {"signal", sig},
                      {"ranks_signalled", static_cast<int64_t>(signalled)},
                      {"checkpoint", dir}});
  fail_as(ErrorKind::preempted,
          "preempted at step {} ({} of {} ranks signalled{}): checkpoint {} written; resume with "
          "--resume auto",
          record.step, static_cast<int64_t>(signalled), world_ != nullptr ? world_->size() : 1,
          sig != 0 ? fmt::format(", this one by SIG{}", sigabbrev_np(sig)) : "", dir);
}

}  // namespace meshtrain
