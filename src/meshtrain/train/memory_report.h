// The run's memory report: every rank's measured bytes (MemoryTracker live
// and peak by category) next to its prediction (memory_plan.h).
#pragma once

#include <cstdint>
#include <vector>

#include "meshtrain/comm/mesh.h"
#include "meshtrain/tensor/memory_tracker.h"
#include "meshtrain/train/memory_plan.h"

namespace meshtrain {

class MetricsLog;

// Each rank writes {"memory": when, "rank", "bytes": measured live + peak,
// "predicted": bytes, "basis"} to its metrics; with `console`, rank 0 prints
// its line, the maximum over ranks and a table of all ranks (measured peak /
// predicted per category). Collective over mesh->world() when mesh is set.
void report_memory(const char* when, int64_t step, const MemoryTracker& tracker,
                   const std::vector<RankMemory>& predicted, DeviceMesh* mesh,
                   MetricsLog& metrics, bool console);

}  // namespace meshtrain
