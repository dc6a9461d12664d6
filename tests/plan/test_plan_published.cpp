// The planner against published large runs: with the published layout fixed
// (tp, cp, pp, dp, batch, and recomputation where stated), the search's best
// layout must fit in memory and reproduce the published throughput within
// 10%. The GEMM efficiency is the catalog's, fitted once per GPU (A100 to the
// Megatron 1T row, H100 to Llama 3 405B on 8K GPUs) and the same for every row.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>

#include "meshtrain/plan/report.h"
#include "published_runs.h"

namespace meshtrain::plan {
namespace {

struct Prediction {
  Estimate best;
  double value = 0, error = 0;
};

Prediction predict(const PublishedRun& r) {
  Job job;
  job.seq = r.seq;
  job.global_batch = r.global_batch;
  job.tokens = 1e12;
  job.dropout = r.model.family == Family::gpt2;
  job.checkpoint_interval_seconds = 0;  // the published throughputs exclude checkpoints
  job.attention = r.attention;
  job.fp8 = r.fp8;
  job.mtp = r.mtp;
  ModelConfig model = r.model;
  model.max_seq_len = std::max(model.max_seq_len, r.seq);
  const PlanContext ctx = make_context(model, job);
  const Cluster cl = make_cluster(gpu_spec(r.gpu), r.gpus, 8);
  SearchOptions opt;
  opt.gpu_counts = {r.gpus};
  opt.fixed.tp = r.tp;
  opt.fixed.cp = r.cp;
  opt.fixed.ep = r.ep;
  if (r.vpp) opt.fixed.vpp = *r.vpp;
  opt.fixed.pp = r.pp;
  opt.fixed.dp = r.dp;
  opt.fixed.zero = r.zero;
  opt.fixed.recompute = r.recompute;
  opt.fixed.micro_batch = r.micro_batch;
  opt.fixed.schedule = r.schedule;
  opt.fixed.ep_fold = r.ep_fold;
  opt.fixed.sequence_parallel = r.sequence_parallel && r.tp > 1;
  opt.top = 1;
  const SearchResult res = search(ctx, cl, job, opt);
  Prediction p;
  if (res.ranked.empty()) return p;
  p.best = res.ranked.front();
  const Estimate& e = p.best;
  const double per_gpu = e.step_seconds * static_cast<double>(e.gpus);
  switch (r.metric) {
    case Metric::hardware_tflops: p.value = e.hardware_flops_per_step / per_gpu / 1e12; break;
    case Metric::causal_model_tflops: {
      const ModelConfig& m = ctx.model;
      const double half_attention = 6.0 * static_cast<double>(m.n_layers * r.seq) *
                                    static_cast<double>(m.n_heads * m.head_dim()) *
                                    static_cast<double>(job.tokens_per_step());
      p.value = (e.model_flops_per_step - half_attention) / per_gpu / 1e12;
      break;
    }
    case Metric::mfu: p.value = e.mfu; break;
    case Metric::model_tflops: p.value = e.model_flops_per_step / per_gpu / 1e12; break;
    case Metric::tokens_per_gpu: p.value = e.tokens_per_second / static_cast<double>(e.gpus); break;
  }
  p.error = p.value / r.published - 1;
  return p;
}

TEST(Published, ThroughputWithinTenPercentWithTheLayoutFixed) {
  std::printf("%-36s %10s %10s %7s  %s\n", "run", "published", "predicted", "error", "layout");
  for (const PublishedRun& r : published_runs()) {
    const Prediction p = predict(r);
    ASSERT_GT(p.value, 0) << r.name << ": nothing fits";
    EXPECT_TRUE(p.best.fits) << r.name;
    std::printf("%-36s %10.4g %10.4g %+6.1f%%  %s, %.0f%% HBM\n", r.name.c_str(), r.published,
                p.value, 100 * p.error, describe(p.best.layout).c_str(), 100 * p.best.hbm_fraction);
    EXPECT_LT(std::fabs(p.error), r.tolerance) << r.name << ": " << describe(p.best.layout);
    // Llama 3 trained 405B without activation checkpointing at 8K (section
    // 3.3.2): the planner must not need full recomputation there.
    if (!r.recompute) {
      EXPECT_NE(p.best.layout.recompute, Recompute::full) << r.name;
    }
  }
}

// Every mechanism of DeepSeek-V3's recipe that its report quantifies is
// modelled (FP8 GEMMs, DualPipe with its overlap and the 20 SMs it gives the
// all-to-alls, node-limited FP8 dispatch, MTP); what is left (docs/plan.md) is
// a residual of +25%, held here so that it cannot silently grow.
// A run outside 10%, held within the residual docs/plan.md reports for it.
Prediction expect_within_documented_residual(const PublishedRun& r) {
  const Prediction p = predict(r);
  EXPECT_GT(p.value, 0) << r.name << ": nothing fits";
  EXPECT_TRUE(p.best.fits) << r.name;
  std::printf("%-36s %10.4g %10.4g %+6.1f%%  %s, %.0f%% HBM\n", r.name.c_str(), r.published,
              p.value, 100 * p.error, describe(p.best.layout).c_str(), 100 * p.best.hbm_fraction);
  EXPECT_LT(std::fabs(p.error), r.tolerance) << describe(p.best.layout);
  return p;
}

TEST(Published, DeepSeekV3WithItsRecipeWithinItsDocumentedResidual) {
  const Prediction p = expect_within_documented_residual(deepseek_v3_run());
  // DeepSeek recomputes only norms and MLA's up-projections: selective fits.
  EXPECT_EQ(p.best.layout.recompute, Recompute::selective);
  EXPECT_EQ(p.best.time.ep, 0) << "DualPipe hides the all-to-alls on this layout";
}

// A small MoE (hidden 2048, experts 768 wide) whose GEMMs the planner prices
// at the large GEMMs' efficiency: over its published throughput by the
// documented residual (docs/plan.md), held here so that it cannot grow.
TEST(Published, Qwen3ThirtyBWithinItsDocumentedResidual) {
  expect_within_documented_residual(qwen3_30b_run());
}

TEST(Published, ParameterCountsWithinOnePercent) {
  for (const PublishedRun& r : published_runs()) {
    const double n = count_transformer(r.model).total_params;
    // Within 1%, or within the rounding of the stated size ("1.7B" is 1.65-1.75B).
    const double tolerance = std::max(0.01 * r.published_params, r.stated_to / 2);
    EXPECT_NEAR(n, r.published_params, tolerance) << r.name << ": " << human_count(n);
  }
}

}  // namespace
}  // namespace meshtrain::plan
