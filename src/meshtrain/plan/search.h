// The parallelism search: for each GPU count, every layout that divides the
// model and the batch (tp, pp, virtual stages, dp, ZeRO stage, micro-batch,
// recomputation), dropped when it does not fit in HBM, ranked by step time or
// by cost; one line per rejected family saying why.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "meshtrain/plan/planner.h"

namespace meshtrain::plan {

// Choices the user fixed; unset ones are searched.
struct FixedChoices {
  std::optional<int64_t> tp, cp, ep, pp, vpp, dp, micro_batch;
  // ZeRO-3's shard group: g (hybrid sharding), 0 = the whole DP group. Unset
  // with --zero 3 fixed means full sharding; unset otherwise, both are searched.
  std::optional<int64_t> shard;
  std::optional<int> zero;
  std::optional<Recompute> recompute;
  std::optional<bool> sequence_parallel;
  std::optional<Offload> offload;
  std::optional<Schedule> schedule;
  bool ep_fold = false;  // Layout::ep_fold: ep drawn from tp x cp x dp (Megatron's folding)
};

enum class RankBy { time, cost };
RankBy parse_rank_by(std::string_view name);  // "time" | "cost"

struct SearchOptions {
  std::vector<int64_t> gpu_counts;
  FixedChoices fixed;
  RankBy rank_by = RankBy::time;
  int top = 10;
  double max_train_seconds = 0;  // a deadline for the token budget; 0 = none
};

// A family: DP, FSDP (ZeRO-3), HSDP (ZeRO-3 in shard groups, replicated), each
// with TP and/or PP; "+ offload" when the optimizer state lives on the host.
std::string family_name(const Layout& layout);

struct FamilyReport {
  std::string family;
  int64_t valid = 0, fits = 0;   // layouts that can run; of those, that fit
  int64_t too_slow = 0;          // fit, but miss the deadline
  std::optional<Estimate> best;  // fastest (or cheapest) that fits (within the deadline)
  std::optional<Estimate> fastest_too_slow;
  std::optional<Estimate> smallest;  // least memory among the valid ones
  std::string reason;            // the commonest structural reason when valid == 0
};

struct SearchResult {
  std::vector<Estimate> ranked;  // the top N, at most one per (gpus, tp, cp, ep, pp, v, zero)
  std::vector<FamilyReport> families;
  int64_t evaluated = 0, valid = 0, fits = 0, too_slow = 0;
  bool offload_retried = false;  // nothing fit, so optimizer offload was searched too
  double seconds = 0;            // wall time of the search
};

// Throws Error (one line) when a fixed choice is impossible for this model and
// cluster, or when no layout can run at all.
SearchResult search(const PlanContext& ctx, const Cluster& cluster, const Job& job,
                    const SearchOptions& options);

// Better-first order for the chosen criterion; ties go to the smaller memory.
bool ranks_before(const Estimate& a, const Estimate& b, RankBy by);

}  // namespace meshtrain::plan
