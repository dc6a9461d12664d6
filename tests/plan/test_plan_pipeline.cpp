// Pipeline splits by cost, the pipeline step of a given split, and context
// parallelism's memory, communication and search.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <numeric>

#include "llama405b.h"
#include "meshtrain/plan/models.h"
#include "meshtrain/plan/pipeline_split.h"
#include "meshtrain/plan/search.h"
#include "meshtrain/util/error.h"

namespace meshtrain::plan {
namespace {

double most_loaded(const LayerCosts& c, const std::vector<int64_t>& chunks, int64_t pp) {
  const std::vector<double> t = stage_costs(c, chunks, pp);
  return *std::max_element(t.begin(), t.end());
}

// Every split of L layers over pp stages (each >= 1): the least max stage cost.
double brute_force_best(const LayerCosts& c, int64_t layers, int64_t pp) {
  double best = 1e300;
  std::vector<int64_t> n(static_cast<size_t>(pp), 1);
  std::function<void(size_t, int64_t)> go = [&](size_t r, int64_t left) {
    if (r + 1 == n.size()) {
      n[r] = left;
      best = std::min(best, most_loaded(c, n, pp));
      return;
    }
    for (int64_t k = 1; k <= left - static_cast<int64_t>(n.size() - r - 1); ++k) {
      n[r] = k;
      go(r + 1, left - k);
    }
  };
  go(0, layers);
  return best;
}

TEST(PipelineSplit, BalancedIsOptimalAgainstBruteForce) {
  for (const LayerCosts& c : {LayerCosts{1, 0, 0}, LayerCosts{1, 0.1, 2.6}, LayerCosts{1, 1.4, 0.3},
                              LayerCosts{2, 0, 7}}) {
    for (int64_t layers : {7, 12, 13}) {
      for (int64_t pp : {2, 3, 4}) {
        const std::vector<int64_t> split = balanced_pipeline_split(c, layers, pp, 1);
        ASSERT_EQ(split.size(), static_cast<size_t>(pp));
        EXPECT_EQ(std::accumulate(split.begin(), split.end(), int64_t{0}), layers);
        EXPECT_DOUBLE_EQ(most_loaded(c, split, pp), brute_force_best(c, layers, pp))
            << layers << " layers on " << pp << " stages";
      }
    }
  }
}

TEST(PipelineSplit, VirtualChunksSpreadEachStage) {
  const LayerCosts c{1, 0, 3};
  const std::vector<int64_t> chunks = balanced_pipeline_split(c, 30, 4, 2);
  ASSERT_EQ(chunks.size(), 8u);
  for (int64_t n : chunks) EXPECT_GE(n, 1);
  const std::vector<int64_t> stages = stage_layers(chunks, 4);
  EXPECT_EQ(std::accumulate(stages.begin(), stages.end(), int64_t{0}), 30);
  EXPECT_LT(stages.back(), stages.front());  // the head's stage holds fewer layers
  for (size_t r = 0; r < 4; ++r) EXPECT_LE(std::abs(chunks[r] - chunks[r + 4]), 1);
}

TEST(PipelineSplit, Llama405bPutsFewerLayersWithTheHead) {
  // 126 layers on 16 stages (Llama 3): the head + loss costs about a layer, so
  // the last stage gets fewer layers than the others.
  const ModelConfig m = plan_model("llama3-405b").config;
  const std::vector<int64_t> split = balanced_pipeline_split(m, 16, 1, 8192, gpu_spec("h100-sxm"));
  EXPECT_EQ(std::accumulate(split.begin(), split.end(), int64_t{0}), 126);
  EXPECT_LT(split.back(), *std::max_element(split.begin(), split.end()));
  const std::vector<int64_t> uniform = uniform_pipeline_split(126, 16, 1);
  EXPECT_EQ(uniform.front(), 8);
  EXPECT_EQ(uniform.back(), 7);
  EXPECT_EQ(std::count(uniform.begin(), uniform.end(), 7), 2);
}

TEST(PipelineSplit, StepOfEqualStagesIsTheScheduleFormula) {
  const std::vector<double> equal(8, 0.25);
  for (int64_t v : {1, 2, 4}) {
    EXPECT_DOUBLE_EQ(pipeline_step(equal, 64, v), (64 + 7.0 / static_cast<double>(v)) * 0.25);
  }
  // An imbalanced split runs at its slowest stage.
  std::vector<double> uneven = equal;
  uneven[3] = 0.5;
  EXPECT_DOUBLE_EQ(pipeline_step(uneven, 64, 1), 64 * 0.5 + 7 * 0.25);
}

TEST(PipelineSplit, TooFewLayersIsAnError) {
  EXPECT_THROW(balanced_pipeline_split(LayerCosts{1, 0, 0}, 7, 4, 2), Error);
}

TEST(PipelineSplit, AGivenSplitIsCostedWithItsImbalance) {
  // Llama 3's 126 layers on 16 stages with one layer fewer on the first and
  // the last stage (section 3.3.2, for memory): the first stage holds less,
  // and the step pays for the 8-layer stages' pace.
  Llama405b x = llama405b_at(8192, 8192);
  const PlanContext& ctx = x.ctx;
  const Cluster& cl = x.cluster;
  Job& job = x.job;
  const Layout l = llama405b_layout(1, 64);
  const Estimate balanced = evaluate(ctx, cl, job, l);
  job.pipeline_split = std::vector<int64_t>(16, 8);
  job.pipeline_split.front() = 7;
  job.pipeline_split.back() = 7;
  ASSERT_EQ(check_layout(ctx, cl, job, l), "");
  const Estimate given = evaluate(ctx, cl, job, l);
  EXPECT_EQ(given.split, job.pipeline_split);
  EXPECT_NEAR(given.time.compute + given.time.recompute + given.time.bubble,
              pipeline_step(given.stage_seconds, given.microbatches, 1), 1e-9);
  EXPECT_GE(given.step_seconds, balanced.step_seconds * (1 - 1e-12));
  // Against uniform stages (8 layers on the first, which holds the most
  // micro-batches), the peak moves to the second stage and is lower.
  Job uniform = job;
  uniform.pipeline_split.clear();
  uniform.balance_pipeline = false;
  const Estimate u = evaluate(ctx, cl, uniform, l);
  EXPECT_EQ(u.memory_stage, "first");
  EXPECT_EQ(given.memory_stage, "second");
  EXPECT_LT(given.memory.activations, u.memory.activations);
  job.pipeline_split.back() = 8;  // 127 layers
  EXPECT_NE(check_layout(ctx, cl, job, l).find("--pp-split lists 16 stages of 127 layers"),
            std::string::npos);
}

TEST(ContextParallel, SplitsActivationsAndAddsHiddenKvGathers) {
  Llama405b x = llama405b_at(131072, 16384);
  const Layout with = llama405b_layout(16, 8);
  ASSERT_EQ(check_layout(x.ctx, x.cluster, x.job, with), "");
  const Estimate e = evaluate(x.ctx, x.cluster, x.job, with);
  EXPECT_TRUE(e.fits) << e.memory.device_total() / 1e9;
  EXPECT_GT(e.cp_comm_raw, 0);
  EXPECT_LE(e.time.cp, e.cp_comm_raw);
  // Without cp the same sequence holds 16x the activations of a layer.
  x.cluster.gpus = 1024;
  const Estimate without = evaluate(x.ctx, x.cluster, x.job, llama405b_layout(1, 8));
  EXPECT_FALSE(without.fits);
  EXPECT_NEAR(without.memory.activations / e.memory.activations, 16, 1.0);

  Layout odd = with;
  x.cluster.gpus = 16384;
  x.job.seq = 131072 + 8;
  EXPECT_EQ(check_layout(x.ctx, x.cluster, x.job, odd),
            "cp 16 needs seq a multiple of 2 x cp (load-balanced chunks)");
}

TEST(ContextParallel, SearchedForLongSequences) {
  Llama405b x = llama405b_at(131072, 16384);
  SearchOptions opt;
  opt.gpu_counts = {16384};
  opt.fixed.tp = 8;
  opt.fixed.pp = 16;
  opt.top = 3;
  const SearchResult r = search(x.ctx, x.cluster, x.job, opt);
  ASSERT_FALSE(r.ranked.empty());
  EXPECT_GT(r.ranked.front().layout.cp, 1);
  EXPECT_LT(r.seconds, 1.0);
}

}  // namespace
}  // namespace meshtrain::plan
