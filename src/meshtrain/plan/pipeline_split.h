// Pipeline stages by cost: how many transformer layers each stage (and each of
// its virtual chunks) holds so that the slowest stage, which sets the pace of
// every micro-batch, is as fast as it can be; and the time a given split takes
// through the schedule, bubble and imbalance included.
#pragma once

#include <cstdint>
#include <vector>

#include "meshtrain/model/config.h"
#include "meshtrain/plan/compute.h"

namespace meshtrain::plan {

// The cost of one micro-batch (forward + backward + recomputation, seconds or
// any unit) of a block and of the two ends.
struct LayerCosts {
  double layer = 0;      // one transformer block
  double embedding = 0;  // on the first stage
  double head = 0;       // final norm, output layer and loss, on the last stage
};
LayerCosts layer_costs(const ModelConfig& model, const GpuSpec& gpu, const ComputeShape& shape);

// A device on which every op takes its FLOPs in seconds: unit peak and
// efficiencies, no HBM floor (streaming ops and the embedding lookup cost 0),
// no kernel overhead. layer_costs on it are FLOP-proportional, the CPU
// engine's model (its GEMMs run at one rate; docs/plan.md).
GpuSpec flop_counting_gpu();

// Layers per virtual chunk, in model order (pp x virtual_stages entries; chunk
// j runs on stage j % pp), minimising the most loaded stage's cost
// n_r * layer + (r == 0) embedding + (r == pp - 1) head; every chunk gets at
// least one layer. Ties keep the split as even as possible. Throws Error when
// the model has fewer layers than chunks.
std::vector<int64_t> balanced_pipeline_split(const LayerCosts& costs, int64_t layers, int64_t pp,
                                             int64_t virtual_stages);
// The same with the costs of `config` at micro-batch 1, tp 1 on `gpu`.
std::vector<int64_t> balanced_pipeline_split(const ModelConfig& config, int64_t pp,
                                             int64_t virtual_stages, int64_t seq,
                                             const GpuSpec& gpu);
// DualPipe (rank r holds stages r and pp - 1 - r, one micro-batch of each
// direction in turn): layers per stage minimising the dearest rank's pair of
// stages; pp even, every stage at least one layer.
std::vector<int64_t> balanced_dualpipe_split(const LayerCosts& costs, int64_t layers, int64_t pp);
// The pace of one micro-batch under DualPipe: the dearest rank's mean of its
// two stages' costs.
double dualpipe_pace(const std::vector<double>& stage_seconds);

// ceil(L / pp) per stage with the remainder taken from the last stages, each
// stage's layers spread evenly over its chunks (Megatron's default when L divides).
std::vector<int64_t> uniform_pipeline_split(int64_t layers, int64_t pp, int64_t virtual_stages);

// Per-stage layer counts spread over each stage's v chunks (±1, the remainder
// to the later chunks), in model order.
std::vector<int64_t> chunks_from_stages(const std::vector<int64_t>& per_stage,
                                        int64_t virtual_stages);

// Layers of each stage (summing its chunks).
std::vector<int64_t> stage_layers(const std::vector<int64_t>& chunks, int64_t pp);
// Per-stage cost of one micro-batch under `split`.
std::vector<double> stage_costs(const LayerCosts& costs, const std::vector<int64_t>& chunks,
                                int64_t pp);

// One step of m micro-batches through stages of per-micro-batch cost t_r
// (1F1B or interleaved with v chunks): m max(t) + (sum(t) - max(t)) / v. For
// equal stages this is (m + (p - 1) / v) t (Narayanan et al. 2021).
double pipeline_step(const std::vector<double>& stage_seconds, int64_t microbatches,
                     int64_t virtual_stages);

}  // namespace meshtrain::plan
