// The run's metrics file (metrics.jsonl on rank 0, metrics.rank<R>.jsonl on
// the others) and console lines, as a step hook. Every write is checked: a
// failed one (a full disk) ends the run with the file named.
#pragma once

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "meshtrain/train/config.h"
#include "meshtrain/train/step.h"

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
  std::string path_;
  std::ofstream out_;
  const TrainSettings& train_;
  bool console_, show_comm_;
};

// A run killed while writing leaves a partial last line: cut it off, so the
// run that resumes appends whole records.
void drop_partial_line(const std::string& path);

// JSON has no NaN; a diverged value is written as null.
nlohmann::json json_number(double value);

}  // namespace meshtrain
