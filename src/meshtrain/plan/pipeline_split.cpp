#include "meshtrain/plan/pipeline_split.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "meshtrain/util/error.h"

namespace meshtrain::plan {

LayerCosts layer_costs(const ModelConfig& model, const GpuSpec& gpu, const ComputeShape& shape) {
  return {layer_time(model, gpu, shape).total(), embedding_time(model, gpu, shape).total(),
          head_time(model, gpu, shape).total()};
}

GpuSpec flop_counting_gpu() {
  GpuSpec gpu;
  gpu.name = "flop-count";
  gpu.peak_flops = 1;
  gpu.gemm_efficiency = 1;
  gpu.attention_efficiency = 1;
  gpu.hbm_bandwidth = std::numeric_limits<double>::infinity();
  gpu.memory_efficiency = 1;
  gpu.kernel_overhead_seconds = 0;
  gpu.compute_source = "FLOPs only (the CPU engine's pipeline split)";
  return gpu;
}

namespace {

// Layers of stage r, whose fixed cost is offset[r]: water-filling from the
// continuous optimum, then one layer at a time to the stage that stays
// cheapest (or from the dearest) until they sum to L.
std::vector<int64_t> stage_counts(double layer_cost, const std::vector<double>& offset,
                                  int64_t layers, int64_t least) {
  const double unit = layer_cost > 0 ? layer_cost : 1.0;
  const int64_t pp = static_cast<int64_t>(offset.size());
  double sum_offset = 0;
  for (double o : offset) sum_offset += o;
  const double level = (static_cast<double>(layers) * unit + sum_offset) / static_cast<double>(pp);
  std::vector<int64_t> n(static_cast<size_t>(pp));
  int64_t total = 0;
  for (size_t r = 0; r < n.size(); ++r) {
    n[r] = std::max<int64_t>(least, static_cast<int64_t>(std::floor((level - offset[r]) / unit)));
    total += n[r];
  }
  auto cost = [&](size_t r, int64_t count) { return static_cast<double>(count) * unit + offset[r]; };
  while (total < layers) {  // add where the stage stays cheapest; ties to the middle stages
    size_t best = 0;
    for (size_t r = 1; r < n.size(); ++r) {
      if (cost(r, n[r] + 1) < cost(best, n[best] + 1) - 1e-12 * unit) best = r;
    }
    ++n[best];
    ++total;
  }
  while (total > layers) {  // take from the dearest stage that can spare one
    size_t worst = n.size();
    for (size_t r = 0; r < n.size(); ++r) {
      if (n[r] > least && (worst == n.size() || cost(r, n[r]) > cost(worst, n[worst]))) worst = r;
    }
    --n[worst];
    --total;
  }
  return n;
}

}  // namespace

std::vector<int64_t> chunks_from_stages(const std::vector<int64_t>& per_stage, int64_t v) {
  const int64_t pp = static_cast<int64_t>(per_stage.size());
  std::vector<int64_t> chunks(static_cast<size_t>(pp * v));
  for (int64_t r = 0; r < pp; ++r) {
    for (int64_t k = 0; k < v; ++k) {
      // The remainder goes to the later chunks of the stage.
      const int64_t n = per_stage[static_cast<size_t>(r)];
      chunks[static_cast<size_t>(k * pp + r)] = n / v + (k >= v - n % v ? 1 : 0);
    }
  }
  return chunks;
}

namespace {

void check_split_args(int64_t layers, int64_t pp, int64_t v) {
  MESHTRAIN_CHECK(pp >= 1 && v >= 1, "plan: pipeline split needs pp >= 1 and v >= 1 (got {}, {})",
                  pp, v);
  MESHTRAIN_CHECK(layers >= pp * v, "plan: {} layers cannot fill {} stages x {} chunks", layers,
                  pp, v);
}

}  // namespace

std::vector<int64_t> balanced_pipeline_split(const LayerCosts& costs, int64_t layers, int64_t pp,
                                             int64_t v) {
  check_split_args(layers, pp, v);
  std::vector<double> offset(static_cast<size_t>(pp), 0.0);
  offset.front() += costs.embedding;
  offset.back() += costs.head;
  return chunks_from_stages(stage_counts(costs.layer, offset, layers, v), v);
}

std::vector<int64_t> balanced_dualpipe_split(const LayerCosts& costs, int64_t layers, int64_t pp) {
  check_split_args(layers, pp, 1);
  MESHTRAIN_CHECK(pp % 2 == 0, "plan: dualpipe needs an even pp, got {}", pp);
  // Rank r holds stages r and pp - 1 - r: balance the pairs (rank 0 holds
  // both ends), then halve each pair's layers.
  std::vector<double> offset(static_cast<size_t>(pp / 2), 0.0);
  offset.front() = costs.embedding + costs.head;
  const std::vector<int64_t> pairs = stage_counts(costs.layer, offset, layers, 2);
  std::vector<int64_t> stages(static_cast<size_t>(pp));
  for (size_t r = 0; r < pairs.size(); ++r) {
    stages[r] = (pairs[r] + 1) / 2;
    stages[static_cast<size_t>(pp) - 1 - r] = pairs[r] / 2;
  }
  return stages;
}

double dualpipe_pace(const std::vector<double>& stage_seconds) {
  double most = 0;
  const size_t p = stage_seconds.size();
  for (size_t r = 0; r < p / 2; ++r) {
    most = std::max(most, 0.5 * (stage_seconds[r] + stage_seconds[p - 1 - r]));
  }
  return most;
}

std::vector<int64_t> balanced_pipeline_split(const ModelConfig& config, int64_t pp, int64_t v,
                                             int64_t seq, const GpuSpec& gpu) {
  ComputeShape shape;
  shape.seq = seq;
  return balanced_pipeline_split(layer_costs(config, gpu, shape), config.n_layers, pp, v);
}

std::vector<int64_t> uniform_pipeline_split(int64_t layers, int64_t pp, int64_t v) {
  check_split_args(layers, pp, v);
  const int64_t most = (layers + pp - 1) / pp;
  std::vector<int64_t> per_stage(static_cast<size_t>(pp), most);
  int64_t extra = most * pp - layers;
  for (int64_t r = pp - 1; r >= 0 && extra > 0; --r, --extra) --per_stage[static_cast<size_t>(r)];
  return chunks_from_stages(per_stage, v);
}

std::vector<int64_t> stage_layers(const std::vector<int64_t>& chunks, int64_t pp) {
  std::vector<int64_t> n(static_cast<size_t>(pp), 0);
  for (size_t j = 0; j < chunks.size(); ++j) n[j % static_cast<size_t>(pp)] += chunks[j];
  return n;
}

std::vector<double> stage_costs(const LayerCosts& c, const std::vector<int64_t>& chunks,
                                int64_t pp) {
  std::vector<double> t;
  for (int64_t n : stage_layers(chunks, pp)) t.push_back(static_cast<double>(n) * c.layer);
  t.front() += c.embedding;
  t.back() += c.head;
  return t;
}

double pipeline_step(const std::vector<double>& t, int64_t m, int64_t v) {
  double sum = 0, most = 0;
  for (double x : t) {
    sum += x;
    most = std::max(most, x);
  }
  return static_cast<double>(m) * most + (sum - most) / static_cast<double>(v);
}

}  // namespace meshtrain::plan
