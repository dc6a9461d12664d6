// Counts live and peak bytes by category. Every tensor allocation registers
// here, so a run can report what it holds and compare with the planner.
// Thread-safe (atomics); one tracker per process/rank, passed explicitly.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <string>
#include <string_view>

namespace meshtrain {

enum class MemCategory : uint8_t {
  params,       // model weights (fp32 master and compute copies)
  grads,        // parameter gradients
  optimizer,    // optimizer state (AdamW moments)
  activations,  // tensors saved between forward and backward
  workspace,    // temporaries that live within one kernel or layer call
  comm,         // communication buffers
  offloaded,    // bytes moved to a slower tier (host copy, file); not part of the totals
};
inline constexpr size_t kMemCategories = 7;

std::string_view mem_category_name(MemCategory category);

// Live and peak bytes by category at one moment (also the element-wise
// maximum of several ranks' snapshots).
struct MemorySnapshot {
  std::array<size_t, kMemCategories> live{}, peak{};
  size_t live_total = 0, peak_total = 0;
  // "params 1.2 MiB (peak 1.2 MiB), grads ..., total 5.0 MiB (peak 6.1 MiB)"
  std::string report() const;
};

class MemoryTracker {
 public:
  void on_alloc(MemCategory category, size_t bytes);
  void on_free(MemCategory category, size_t bytes);

  size_t live(MemCategory category) const;
  size_t peak(MemCategory category) const;
  // Totals are the working memory: every category except `offloaded`.
  size_t live_total() const;
  // Highest total of live bytes seen at any moment (not the sum of per-category peaks).
  size_t peak_total() const;
  // Resets every peak to the current live value (e.g. after initialisation).
  void reset_peaks();

  MemorySnapshot snapshot() const;
  std::string report() const { return snapshot().report(); }

 private:
  std::array<std::atomic<size_t>, kMemCategories> live_{};
  std::array<std::atomic<size_t>, kMemCategories> peak_{};
  std::atomic<size_t> live_total_{0};
  std::atomic<size_t> peak_total_{0};
};

// "1.50 MiB"
std::string format_bytes(size_t bytes);

}  // namespace meshtrain
