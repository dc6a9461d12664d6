// The run's metrics file (metrics.jsonl on rank 0, metrics.rank<R>.jsonl on
// the others) and the console, as a step hook: on a terminal a progress bar
// (steps, tokens/s, loss, ETA) redrawn in place, otherwise a line every
// log_interval steps. Every record is one whole line in one write (util/line_log.h),
// checked: a failed one (a full disk) ends the run with the file named.
#pragma once

#include <chrono>
#include <nlohmann/json.hpp>
#include <string>

#include "meshtrain/train/config.h"
#include "meshtrain/train/step.h"
#include "meshtrain/util/line_log.h"
#include "meshtrain/util/progress.h"

namespace meshtrain {

class MetricsLog final : public StepHook {
 public:
  // append: continue the file of the run this one resumes (a partial last
  // line, from a killed run, is dropped first).
  MetricsLog(std::string path, bool append, const TrainSettings& train, bool console,
             bool show_comm);
  void write(const nlohmann::json& record);  // one line, flushed and checked
  void on_step(const StepRecord& record) override;
  void on_eval(int64_t step, double val_loss) override;
  void on_checkpoint(int64_t step, const std::string& dir) override;
  const std::string& path() const { return path_; }

 private:
  void draw_progress(const StepRecord& r);

  std::string path_;
  const TrainSettings& train_;
  bool console_, show_comm_;
  ProgressBar progress_;
  LineLog out_;
  int64_t first_step_ = -1;  // this process's first step and when it ended: the ETA's rate
  std::chrono::steady_clock::time_point first_end_{};
};

// JSON has no NaN; a diverged value is written as null.
nlohmann::json json_number(double value);

}  // namespace meshtrain
