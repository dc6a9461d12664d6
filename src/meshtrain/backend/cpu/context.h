// The CPU backend's execution context: thread count, the memory tracker every
// allocation goes through, and oneDNN's engine, stream and primitive cache.
// One per process (rank); passed explicitly, never global.
#pragma once

#include <memory>

#include "meshtrain/tensor/memory_tracker.h"
#include "meshtrain/util/cores.h"

namespace meshtrain::cpu {

using meshtrain::available_cores;
// The threads a CpuContext asked for `requested` runs with (<= 0: available_cores()),
// at most OMP_THREAD_LIMIT: what the memory plan sizes the thread-dependent workspace by.
int context_threads(int requested);

class CpuContext {
 public:
  // threads <= 0 means available_cores(). Sets the OpenMP thread count.
  CpuContext(int threads, MemoryTracker& tracker);
  ~CpuContext();
  CpuContext(const CpuContext&) = delete;
  CpuContext& operator=(const CpuContext&) = delete;

  int threads() const { return threads_; }
  MemoryTracker& tracker() const { return *tracker_; }

  struct Impl;  // oneDNN state, defined in matmul.cpp
  Impl& impl() { return *impl_; }

 private:
  int threads_;
  MemoryTracker* tracker_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace meshtrain::cpu
