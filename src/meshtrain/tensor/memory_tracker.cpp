#include "meshtrain/tensor/memory_tracker.h"

#include <fmt/format.h>

namespace meshtrain {

namespace {
void raise_to(std::atomic<size_t>& peak, size_t value) {
  size_t seen = peak.load(std::memory_order_relaxed);
  while (value > seen && !peak.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
  }
}
}  // namespace

std::string_view mem_category_name(MemCategory category) {
  switch (category) {
    case MemCategory::params: return "params";
    case MemCategory::grads: return "grads";
    case MemCategory::optimizer: return "optimizer";
    case MemCategory::activations: return "activations";
    case MemCategory::workspace: return "workspace";
    case MemCategory::comm: return "comm";
    case MemCategory::offloaded: return "offloaded";
  }
  return "?";
}

void MemoryTracker::on_alloc(MemCategory category, size_t bytes) {
  auto c = static_cast<size_t>(category);
  raise_to(peak_[c], live_[c].fetch_add(bytes, std::memory_order_relaxed) + bytes);
  if (category == MemCategory::offloaded) return;
  raise_to(peak_total_, live_total_.fetch_add(bytes, std::memory_order_relaxed) + bytes);
}

void MemoryTracker::on_free(MemCategory category, size_t bytes) {
  live_[static_cast<size_t>(category)].fetch_sub(bytes, std::memory_order_relaxed);
  if (category == MemCategory::offloaded) return;
  live_total_.fetch_sub(bytes, std::memory_order_relaxed);
}

size_t MemoryTracker::live(MemCategory category) const {
  return live_[static_cast<size_t>(category)].load(std::memory_order_relaxed);
}

size_t MemoryTracker::peak(MemCategory category) const {
  return peak_[static_cast<size_t>(category)].load(std::memory_order_relaxed);
}

size_t MemoryTracker::live_total() const { return live_total_.load(std::memory_order_relaxed); }

size_t MemoryTracker::peak_total() const { return peak_total_.load(std::memory_order_relaxed); }

void MemoryTracker::reset_peaks() {
  for (size_t c = 0; c < kMemCategories; ++c) peak_[c].store(live_[c].load());
  peak_total_.store(live_total_.load());
}

MemorySnapshot MemoryTracker::snapshot() const {
  MemorySnapshot s;
  for (size_t c = 0; c < kMemCategories; ++c) {
    s.live[c] = live_[c].load();
    s.peak[c] = peak_[c].load();
  }
  s.live_total = live_total();
  s.peak_total = peak_total();
  return s;
}

std::string MemorySnapshot::report() const {
  std::string out;
  for (size_t c = 0; c < kMemCategories; ++c) {
    out += fmt::format("{} {} (peak {}), ", mem_category_name(static_cast<MemCategory>(c)),
                       format_bytes(live[c]), format_bytes(peak[c]));
  }
  out += fmt::format("total {} (peak {})", format_bytes(live_total), format_bytes(peak_total));
  return out;
}

std::string format_bytes(size_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024.0 && unit < 4) {
    value /= 1024.0;
    ++unit;
  }
  return unit == 0 ? fmt::format("{} B", bytes) : fmt::format("{:.2f} {}", value, units[unit]);
}

}  // namespace meshtrain
