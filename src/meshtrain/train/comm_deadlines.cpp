#include "meshtrain/train/comm_deadlines.h"

namespace meshtrain {

CommDeadlines::CommDeadlines(FlightRecorder& recorder, const CommSettings& settings)
    : recorder_(recorder), settings_(settings) {
  recorder_.set_timeout(settings_.long_timeout_s);
}

void CommDeadlines::before_step(int64_t) {
  if (first_) {
    first_ = false;
    return;
  }
  recorder_.set_timeout(settings_.timeout_s);
}

void CommDeadlines::on_step(const StepRecord&) { recorder_.set_timeout(settings_.long_timeout_s); }

}  // namespace meshtrain
