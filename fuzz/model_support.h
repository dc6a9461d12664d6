// One CPU context for the harnesses that build a model from a file (oneDNN's
// engine is costly to make per input).
#pragma once

#include "meshtrain/backend/cpu/context.h"
#include "meshtrain/tensor/memory_tracker.h"

namespace meshtrain::fuzz {

inline cpu::CpuContext& cpu_context() {
  static MemoryTracker tracker;
  static cpu::CpuContext ctx(1, tracker);
  return ctx;
}

}  // namespace meshtrain::fuzz
