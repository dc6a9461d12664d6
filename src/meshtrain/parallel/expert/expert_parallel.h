// Expert parallelism: the routed experts of every MoE layer split over the ep
// ranks of an ep group (comm/mesh.h: ep neighbouring dp ranks), and the
// token rows exchanged with all-to-alls so that each expert's rows meet its
// weights on the rank that holds them.
//
// Contract:
// - Rank r of the group holds experts [r * E/ep, (r + 1) * E/ep) of each MoE
//   layer (the expert tensors' rows split, parallel/tensor/split.h kind rows).
// - A rank's token side is its rows permuted to their (global) experts, in
//   expert order (ops moe_sort / moe_permute): the rows of rank q's experts
//   are contiguous and go to q. Its expert side is every row the group routed
//   to its local experts, grouped by local expert (each one's rows
//   contiguous, ordered by source rank), so one GEMM per local expert covers
//   them.
// - plan_exchange exchanges the per-expert counts (an all-to-all of E/ep
//   counts per rank pair), dispatch_rows moves token side -> expert side and
//   combine_rows the reverse (all-to-all-v through the Communicator: numbered,
//   traced, under the watchdog). All three are collective over the group and
//   must be issued in the same order on every member (every member runs the
//   same layers and micro-batches).
// - Gradients: a rank's expert gradients sum the contributions of the whole
//   group's tokens. The model scales them by 1 / ep, so that averaging them
//   over the expert-data-parallel group (the dp ranks holding the same
//   experts, dp / ep of them) gives every parameter the same 1 / dp average
//   of the per-rank gradients as a dense parameter averaged over dp.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "meshtrain/backend/backend.h"
#include "meshtrain/comm/communicator.h"

namespace meshtrain {

struct ExpertParallel {
  Communicator* comm = nullptr;  // the ep group; nullptr means ep = 1

  int rank() const { return comm != nullptr ? comm->rank() : 0; }
  int size() const { return comm != nullptr ? comm->size() : 1; }
  bool active() const { return size() > 1; }
};

// One MoE layer's exchange for one micro-batch, as both sides see it.
struct ExpertExchange {
  int64_t local_experts = 0;           // E / ep
  std::vector<int64_t> send_rows;      // [ep] token-side rows to each rank
  std::vector<int64_t> recv_rows;      // [ep] expert-side rows from each rank
  std::vector<int64_t> recv_counts;    // [ep * E/ep] rows from rank p for local expert l
  std::vector<int32_t> expert_rows;    // [E/ep] rows of each local expert (over all sources)
  int64_t sent() const;                // token-side rows
  int64_t received() const;            // expert-side rows
};

// Collective over the group: rows_per_expert [E] are this rank's token-side
// rows per global expert (kept ones, in expert order).
ExpertExchange plan_exchange(const ExpertParallel& ep, std::span<const int32_t> rows_per_expert);

// Token side [plan.sent(), width] -> expert side [plan.received(), width]
// (dtype dt). staging: [plan.received(), width], the rows as they arrive
// (by source rank), reordered into `expert`.
void dispatch_rows(const ExpertParallel& ep, const ExpertExchange& plan, Backend& backend,
                   DType dt, int64_t width, const void* token, void* staging, void* expert);
// Expert side [plan.received(), width] -> token side [plan.sent(), width];
// staging [plan.received(), width] holds the rows reordered by destination.
void combine_rows(const ExpertParallel& ep, const ExpertExchange& plan, Backend& backend,
                  DType dt, int64_t width, const void* expert, void* staging, void* token);

}  // namespace meshtrain
