#include "meshtrain/util/progress.h"

#include <unistd.h>

#include <cstdint>
#include <cstdlib>

#include "meshtrain/util/error.h"

namespace meshtrain {
namespace {

// A terminal a person watches. Under a launcher the ranks' stdout is often a
// pty the launcher made (Open MPI's orted does), whatever mpirun's own output
// is — a file in CI — so a rank of a multi-rank job counts as not interactive
// (a singleton MPI process sets OMPI_COMM_WORLD_SIZE=1 itself).
bool interactive(std::FILE* out) {
  for (const char* size : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"}) {
    const char* value = std::getenv(size);
    if (value != nullptr && std::atoi(value) > 1) return false;
  }
  return ::isatty(::fileno(out)) != 0;
}

}  // namespace

std::string format_duration(double seconds) {
  auto s = static_cast<int64_t>(seconds + 0.5);
  if (s >= 3600) return fmt::format("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60);
  return fmt::format("{}:{:02}", s / 60, s % 60);
}

std::string eta_text(double done, double total, double elapsed_s) {
  if (done <= 0 || elapsed_s <= 0) return "?";
  return format_duration((total - done) * elapsed_s / done);
}

ProgressBar::ProgressBar(std::FILE* out, const std::string& mode, std::string label,
                         const char* what)
    : out_(out), label_(std::move(label)) {
  MESHTRAIN_CHECK_AS(ErrorKind::config,
                     mode == "auto" || mode == "bar" || mode == "lines" || mode == "none",
                     "{}: progress '{}' is not one of auto, bar, lines, none", what, mode);
  if (out_ == nullptr || mode == "none") {
    out_ = nullptr;
  } else {
    bar_ = mode == "bar" || (mode == "auto" && interactive(out_));
  }
}

void ProgressBar::draw(double fraction, const std::string& text, bool done,
                       double min_interval_s) {
  if (out_ == nullptr || !bar_) return;
  const auto now = std::chrono::steady_clock::now();
  if (!done && drawn_ && std::chrono::duration<double>(now - last_).count() < min_interval_s) return;
  last_ = now;
  drawn_ = true;
  constexpr int kWidth = 30;
  const double frac = fraction < 0 ? 0 : fraction > 1 ? 1 : fraction;
  const int filled = static_cast<int>(frac * kWidth);
  // \033[K clears what a longer earlier bar left.
  std::fprintf(out_, "\r%s [%s%s] %s\033[K", label_.c_str(),
               std::string(static_cast<size_t>(filled), '#').c_str(),
               std::string(static_cast<size_t>(kWidth - filled), '.').c_str(), text.c_str());
  if (done) {
    std::fputc('\n', out_);
    drawn_ = false;
  }
  std::fflush(out_);
}

void ProgressBar::line(const std::string& text) {
  if (out_ == nullptr) return;
  if (bar_ && drawn_) std::fputs("\r\033[K", out_);
  std::fprintf(out_, "%s\n", text.c_str());
  drawn_ = false;
  std::fflush(out_);
}

}  // namespace meshtrain
