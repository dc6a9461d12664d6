// One progress display for long commands (prepare, train): on a terminal a bar
// redrawn in place; otherwise plain lines, as often as the caller asks.
#pragma once

#include <chrono>
#include <cstdio>
#include <string>

namespace meshtrain {

// "m:ss" or "h:mm:ss".
std::string format_duration(double seconds);

class ProgressBar {
 public:
  // mode: "auto" (bar when `out` is a terminal and the process was not started
  // by mpirun/srun, whose ranks write to a pty of the launcher), "bar", "lines", "none";
  // anything else throws Error naming `what`. out may be null (= none).
  ProgressBar(std::FILE* out, const std::string& mode, std::string label, const char* what);

  bool bar() const { return bar_; }
  bool enabled() const { return out_ != nullptr; }
  // On a bar, at most every `min_interval_s` (unless done): "\r<label> [###...] <text>".
  // done ends the line.
  void draw(double fraction, const std::string& text, bool done = false,
            double min_interval_s = 0.2);
  // A whole line above the bar (the bar is cleared and redrawn by the next draw).
  void line(const std::string& text);

 private:
  std::FILE* out_;
  std::string label_;
  bool bar_ = false, drawn_ = false;
  std::chrono::steady_clock::time_point last_{};
};

// Seconds left at the average rate so far: "?" before any progress.
std::string eta_text(double done, double total, double elapsed_s);

}  // namespace meshtrain
