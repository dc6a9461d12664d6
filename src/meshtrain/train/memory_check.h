// Fail before allocating: each rank's predicted peak (memory_plan.h), summed
// over the ranks that share its host, against what the host allows (the
// process's cgroup memory limit, v2 memory.max or v1 memory.limit_in_bytes, and
// MemAvailable), the offload store's budget against its pieces, and the disk
// tier's free space. The decision is collective: every rank refuses with the
// same line, naming the rank, its bytes by category, the limit and its
// source, and the levers that would make it fit, each with what it would need.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "meshtrain/comm/mesh.h"
#include "meshtrain/train/config.h"
#include "meshtrain/train/memory_plan.h"

namespace meshtrain {

// One limit on the bytes a host's ranks may still allocate.
struct MemoryLimit {
  double available = 0;  // bytes left: limit minus what the cgroup / host uses now
  std::string source;    // "cgroup v1 /sys/fs/cgroup/memory/x/memory.limit_in_bytes (limit 2.00 GiB, used 5.0 MiB)"
};

// The limits that apply to this process now: the tightest cgroup limit on its
// path (v2 and v1), and MemAvailable from /proc/meminfo. Missing or unlimited
// ones are left out. `root` replaces "/" for tests.
std::vector<MemoryLimit> host_memory_limits(const std::string& root = "");

// Checks the run's prediction (this rank: `ranks[my rank]`) against the
// limits; throws Error on every rank when one refuses (train.memory_check =
// "error"), prints the reason on rank 0 with "warn", does nothing with "off"
// (the offload budget check always applies: the store would fail at the
// first step). Collective over mesh->world() when mesh is set.
void check_memory_before_allocating(const TrainConfig& config, const std::vector<RankMemory>& ranks,
                                    DeviceMesh* mesh, bool console);

// The refusal text for `host_ranks` (world ranks on one host, with their
// predictions) against `limits`, or nullopt when they fit. Pure: tested
// without a machine to fill.
std::optional<std::string> memory_refusal(const TrainConfig& config,
                                          const std::vector<RankMemory>& ranks,
                                          const std::vector<int>& host_ranks,
                                          const std::vector<MemoryLimit>& limits);

// Always fatal: the offload store's resident budget must hold two chunks
// (one in use, the next read ahead); names parallel.offload_budget_mb and the
// minimum. nullopt when it does.
std::optional<std::string> offload_budget_refusal(const RankMemory& rank);

}  // namespace meshtrain
