// What each rank of a run will hold, by the engine's MemoryTracker
// categories, predicted from the run's config and mesh coordinate before
// anything is allocated. The model state comes from the layout code the
// engine itself runs (build_param_specs' tp slice, select_stage_params'
// pipeline stage, make_zero_layout's padded shards), the activations from the
// tensors the model keeps per (chunk, micro-batch) walked through the
// rank's pipeline schedule, so the prediction and the engine cannot drift
// apart silently (tests/train/test_memory_plan.cpp, tests/*_mpi). What is
// exact and what is a bound: docs/plan.md#per-rank-engine-memory.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "meshtrain/comm/mesh.h"
#include "meshtrain/tensor/memory_tracker.h"
#include "meshtrain/train/config.h"

namespace meshtrain {

// How a category's prediction relates to the tracker's peak.
enum class PredictionBasis : uint8_t {
  exact,     // the bytes the engine allocates
  bound,     // an upper bound on a timing-dependent peak (prefetch, async collectives)
  // Routing-dependent (expert parallelism): the rows a rank's experts receive
  // depend on the router, so they are counted at the balanced load (what a
  // rank sends); a step whose routing is imbalanced exceeds it by up to its
  // imbalance on those buffers (docs/moe.md).
  balanced,
  // Routing-dependent, from the measured routing: the expert-side buffers at
  // the most rows one micro-batch gave this rank's experts so far
  // (Model::max_expert_rows): every layer's are at most that, so the measured
  // peak is at most the prediction.
  routed,
};
std::string_view prediction_basis_name(PredictionBasis basis);

struct RankMemory {
  int rank = 0;
  MeshCoord coord;
  std::string role;  // "pp stage 1 (layers 2-3, head), tp 0 of 2" (dp ranks are alike)
  // Predicted peak bytes per category (MemCategory order; offloaded = the
  // slower tier's bytes), with the basis of each.
  std::array<double, kMemCategories> peak{};
  std::array<PredictionBasis, kMemCategories> basis{};
  // For a bound, what the peak is at least (the part that does not depend on
  // timing: ZeRO's shards, pipeline sends freed at once); else = peak.
  std::array<double, kMemCategories> floor{};
  double at(MemCategory c) const { return peak[static_cast<size_t>(c)]; }
  // Working memory: the sum of the category peaks (every category but
  // offloaded): a bound on the tracker's peak_total.
  double total() const;
  // What the rank takes from the host's RAM: total(), plus the cpu tier's
  // host copies (this engine's "device" is the host).
  double host_bytes = 0;
  // Offload: the optimizer state the store streams, its resident budget
  // (0 = no limit) and its largest piece (the states of one shard range the
  // update acquires together; the budget must hold two: one in use, the next
  // read ahead).
  double offload_state = 0, offload_budget = 0, offload_piece = 0;
  std::string offload_tier = "none";
  std::string offload_dir;  // disk tier
};

// Every rank of a run on `world_size` ranks (dp = world / (tp * pp)).
// Throws Error naming the key for a layout the engine would refuse.
std::vector<RankMemory> predict_run_memory(const TrainConfig& config, int world_size,
                                           int64_t expert_rows = 0);
// One rank. expert_rows > 0 (expert parallelism): the expert-side rows of a
// micro-batch as measured (basis routed) instead of the balanced S = N * top_k.
RankMemory predict_rank_memory(const TrainConfig& config, const MeshLayout& mesh, MeshCoord coord,
                               int64_t expert_rows = 0);

// Ranks that predict the same bytes (dp ranks mostly) as one row each:
// (first rank, ranks with it). For the plan's table.
std::vector<std::pair<const RankMemory*, std::vector<int>>> distinct_ranks(
    const std::vector<RankMemory>& ranks);

// `meshtrain plan --config`: the table (format_bytes units) and the JSON
// (every rank, every category in bytes, with its basis).
std::string format_run_memory(const std::string& source, const TrainConfig& config,
                              const std::vector<RankMemory>& ranks);
std::string run_memory_json(const std::string& source, const TrainConfig& config,
                            const std::vector<RankMemory>& ranks);

}  // namespace meshtrain
