// The search end to end: the llama3-70b / 1024 x H100 case, 16,384
// GPUs, fixed choices, rejected families, bad inputs, and the outputs.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <functional>
#include <set>

#include "meshtrain/util/error.h"
#include "meshtrain/plan/models.h"
#include "meshtrain/plan/pipeline_split.h"
#include "meshtrain/plan/report.h"
#include "meshtrain/plan/search.h"
#include "meshtrain/tensor/memory_tracker.h"

namespace meshtrain::plan {
namespace {

PlanInputs llama70b_on_h100(int64_t gpus) {
  PlanInputs in;
  in.model_name = "llama3-70b";
  ModelConfig model = plan_model("llama3-70b").config;
  in.job.seq = 8192;
  in.job.global_batch = 2048;  // 16M tokens
  in.job.tokens = 15e12;
  in.ctx = make_context(model, in.job);
  in.cluster = make_cluster(gpu_spec("h100-sxm"), gpus, 8);
  in.options.gpu_counts = {gpus};
  return in;
}

// A tensor-parallel layout (SP on), interleaved when vpp > 1.
Layout tp_layout(int64_t tp, int64_t pp, int64_t dp, int zero, int64_t vpp = 1,
                 int64_t micro_batch = 1) {
  Layout l;
  l.tp = tp;
  l.pp = pp;
  l.dp = dp;
  l.zero = zero;
  l.vpp = vpp;
  l.micro_batch = micro_batch;
  l.sequence_parallel = tp > 1;
  l.schedule = vpp > 1 ? Schedule::interleaved : Schedule::one_f_one_b;
  return l;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(Search, Llama70bOn1024H100) {
  PlanInputs in = llama70b_on_h100(1024);
  const SearchResult r = search(in.ctx, in.cluster, in.job, in.options);
  ASSERT_EQ(r.ranked.size(), 10u);
  EXPECT_GT(r.evaluated, r.valid);
  EXPECT_GT(r.valid, r.fits);
  std::set<std::tuple<int64_t, int64_t, int64_t, int>> shapes;
  for (size_t i = 0; i < r.ranked.size(); ++i) {
    const Estimate& e = r.ranked[i];
    const Layout& l = e.layout;
    EXPECT_TRUE(e.fits);
    EXPECT_LE(e.memory.device_total(), in.cluster.gpu.hbm_bytes);
    EXPECT_EQ(l.tp * l.pp * l.dp, 1024);
    EXPECT_LE(l.tp, 8);
    EXPECT_EQ(8 % l.tp, 0);  // divides the 8 kv heads
    EXPECT_EQ(2048 % (l.dp * l.micro_batch), 0);
    EXPECT_TRUE(shapes.insert({l.tp, l.pp, l.vpp, l.zero}).second) << "one row per shape";
    if (i > 0) {
      EXPECT_LE(r.ranked[i - 1].step_seconds, e.step_seconds);
    }
    // The step is the sum of its parts, and MFU follows from it.
    EXPECT_NEAR(e.step_seconds, e.time.total(), 1e-9);
    EXPECT_NEAR(e.mfu, e.model_flops_per_step / (e.step_seconds * 1024 * 989.4e12), 1e-12);
    EXPECT_GT(e.mfu, 0.2);
    // MFU counts the full attention scores; flash attention computes the causal
    // half, so MFU may pass the GEMM efficiency, but not by much at 8K.
    EXPECT_LT(e.mfu, 1.1 * in.cluster.gpu.gemm_efficiency);
  }
  // A 70B model cannot be plainly data-parallel on 80 GB GPUs: 16 bytes x 70B.
  bool saw_dp = false;
  for (const FamilyReport& f : r.families) {
    if (f.family == "DP (ZeRO-0/1/2)") {
      saw_dp = true;
      EXPECT_GT(f.valid, 0);
      EXPECT_EQ(f.fits, 0);
      ASSERT_TRUE(f.smallest.has_value());
      EXPECT_GT(f.smallest->memory.device_total(), in.cluster.gpu.hbm_bytes);
    }
    if (f.family == "PP + FSDP (ZeRO-3)") {
      EXPECT_EQ(f.valid, 0);
      EXPECT_NE(f.reason.find("ZeRO-2/3 with pp > 1"), std::string::npos);
    }
  }
  EXPECT_TRUE(saw_dp);

  const std::string table = format_table(in, r);
  EXPECT_NE(table.find("rejected: none of"), std::string::npos);
  EXPECT_NE(table.find("best overall"), std::string::npos);
  const std::string explain = format_explain(in, r.ranked.front());
  EXPECT_NE(explain.find("Korthikanti"), std::string::npos);
  EXPECT_NE(explain.find("MFU (PaLM)"), std::string::npos);
}

TEST(Search, SixteenThousandGpus) {
  PlanInputs in = llama70b_on_h100(16384);
  in.ctx = make_context(plan_model("llama3-405b").config, in.job);
  in.options.top = 5;
  const SearchResult r = search(in.ctx, in.cluster, in.job, in.options);
  ASSERT_FALSE(r.ranked.empty());
  for (const Estimate& e : r.ranked) {
    EXPECT_TRUE(e.fits);
    EXPECT_GT(e.layout.tp * e.layout.pp, 1) << "405B needs model parallelism";
  }
  std::printf("16384-GPU search: %lld layouts in %.3f s\n",
              static_cast<long long>(r.evaluated), r.seconds);
}

TEST(Search, FixedChoicesAreKept) {
  PlanInputs in = llama70b_on_h100(1024);
  in.options.fixed.tp = 8;
  in.options.fixed.zero = 3;
  in.options.fixed.recompute = Recompute::selective;
  const SearchResult r = search(in.ctx, in.cluster, in.job, in.options);
  ASSERT_FALSE(r.ranked.empty());
  for (const Estimate& e : r.ranked) {
    EXPECT_EQ(e.layout.tp, 8);
    EXPECT_EQ(e.layout.zero, 3);
    EXPECT_EQ(e.layout.pp, 1);  // ZeRO-3 excludes pipelines
    EXPECT_EQ(e.layout.recompute, Recompute::selective);
    EXPECT_TRUE(e.layout.sequence_parallel);
  }
}

TEST(Search, RankByCostAcrossGpuCounts) {
  PlanInputs in = llama70b_on_h100(512);
  in.options.gpu_counts = {512, 1024, 2048};
  in.options.rank_by = RankBy::cost;
  const SearchResult r = search(in.ctx, in.cluster, in.job, in.options);
  ASSERT_GE(r.ranked.size(), 2u);
  for (size_t i = 1; i < r.ranked.size(); ++i) {
    EXPECT_LE(r.ranked[i - 1].cost, r.ranked[i].cost);
  }
  std::set<int64_t> counts;
  for (const Estimate& e : r.ranked) counts.insert(e.gpus);
  EXPECT_GE(counts.size(), 1u);
}

TEST(Search, ZeroThreeMemoryFallsWithDataParallelism) {
  PlanInputs in = llama70b_on_h100(64);
  Layout l;
  l.tp = 8;
  l.zero = 3;
  l.sequence_parallel = true;
  double previous = 1e300;
  for (int64_t gpus : {64, 128, 256, 512}) {
    in.cluster.gpus = gpus;
    l.dp = gpus / 8;
    ASSERT_EQ(check_layout(in.ctx, in.cluster, in.job, l), "");
    const Estimate e = evaluate(in.ctx, in.cluster, in.job, l);
    EXPECT_LT(e.memory.params + e.memory.grads + e.memory.optimizer, previous);
    previous = e.memory.params + e.memory.grads + e.memory.optimizer;
  }
}

TEST(Search, OffloadIsTriedWhenNothingElseFits) {
  PlanInputs in = llama70b_on_h100(8);  // 16 x 70.6B bytes > 8 x 80 GB
  const SearchResult r = search(in.ctx, in.cluster, in.job, in.options);
  EXPECT_TRUE(r.offload_retried);
  ASSERT_FALSE(r.ranked.empty());
  for (const Estimate& e : r.ranked) {
    EXPECT_EQ(e.layout.offload, Offload::optimizer);
    EXPECT_EQ(e.memory.optimizer, 0);
    EXPECT_GT(e.memory.offloaded, 0);
    EXPECT_GT(e.time.offload, 0);
  }
  // Enough GPUs: no offload searched.
  PlanInputs big = llama70b_on_h100(1024);
  EXPECT_FALSE(search(big.ctx, big.cluster, big.job, big.options).offload_retried);
}

TEST(Search, NothingFitsIsReportedNotThrown) {
  PlanInputs in = llama70b_on_h100(8);
  in.ctx = make_context(plan_model("llama3-405b").config, in.job);
  const SearchResult r = search(in.ctx, in.cluster, in.job, in.options);
  EXPECT_TRUE(r.ranked.empty());
  EXPECT_GT(r.valid, 0);
  const std::string table = format_table(in, r);
  EXPECT_NE(table.find("nothing fits"), std::string::npos);
}

TEST(BadInputs, OneClearLine) {
  PlanInputs in = llama70b_on_h100(1024);
  auto run = [&](PlanInputs x) { search(x.ctx, x.cluster, x.job, x.options); };
  PlanInputs tp3 = in;
  tp3.options.fixed.tp = 3;
  EXPECT_EQ(error_of([&] { run(tp3); }),
            "plan: --tp 3 does not divide the 64 attention heads");
  PlanInputs tp16 = in;
  tp16.options.fixed.tp = 16;
  EXPECT_EQ(error_of([&] { run(tp16); }), "plan: --tp 16 does not divide the 8 kv heads");
  PlanInputs product = in;
  product.options.fixed.tp = 8;
  product.options.fixed.pp = 4;
  product.options.fixed.dp = 16;
  EXPECT_EQ(error_of([&] { run(product); }),
            "plan: --tp 8 x --pp 4 x --dp 16 = 512 is not --gpus 1024");
  PlanInputs pp = in;
  pp.options.fixed.pp = 81;
  EXPECT_EQ(error_of([&] { run(pp); }), "plan: --pp 81 must be in 1..80 (the model's layers)");
  PlanInputs nodes = in;
  nodes.options.gpu_counts = {1020};
  EXPECT_EQ(error_of([&] { run(nodes); }), "plan: --gpus 1020 is not a whole number of 8-GPU nodes");
  PlanInputs batch = in;
  batch.job.global_batch = 3;  // no dp > 1 divides 3 sequences except 3 itself
  batch.options.gpu_counts = {16};
  batch.options.fixed.dp = 16;
  EXPECT_EQ(error_of([&] { run(batch); }),
            "plan: no layout can run: global batch 3 is not a multiple of dp 16 x micro-batch 1");
  PlanInputs zero = in;
  zero.options.fixed.zero = 2;
  zero.options.fixed.pp = 4;
  EXPECT_NE(error_of([&] { run(zero); }).find("ZeRO-2/3 with pp > 1"), std::string::npos);
  PlanInputs eff = in;
  eff.job.compute_efficiency = 1.5;
  EXPECT_EQ(error_of([&] { run(eff); }), "plan: --efficiency must be in (0, 1], got 1.5");
}

TEST(Output, JsonHasTheEngineCategories) {
  PlanInputs in = llama70b_on_h100(1024);
  in.options.top = 3;
  const SearchResult r = search(in.ctx, in.cluster, in.job, in.options);
  const nlohmann::json j = nlohmann::json::parse(format_json(in, r));
  ASSERT_EQ(j["ranked"].size(), 3u);
  const auto& mem = j["ranked"][0]["memory_bytes"];
  for (size_t i = 0; i < kMemCategories; ++i) {
    EXPECT_TRUE(mem.contains(std::string(mem_category_name(static_cast<MemCategory>(i)))));
  }
  EXPECT_DOUBLE_EQ(mem["device_total"].get<double>(), r.ranked[0].memory.device_total());
  EXPECT_DOUBLE_EQ(j["ranked"][0]["time_seconds"]["step"].get<double>(), r.ranked[0].step_seconds);
  EXPECT_EQ(j["model"]["params"].get<double>(), 70553706496.0);
  EXPECT_EQ(j["families"].size(), r.families.size());
}


TEST(StepTime, CheckpointWriteIsAmortisedOverItsInterval) {
  PlanInputs in = llama70b_on_h100(1024);
  Layout l = tp_layout(8, 4, 32, 1);
  in.job.checkpoint_interval_seconds = 0;
  const Estimate none = evaluate(in.ctx, in.cluster, in.job, l);
  EXPECT_EQ(none.time.checkpoint, 0);
  in.job.checkpoint_interval_seconds = 1800;
  in.job.checkpoint_write_bandwidth = 50e9;
  const Estimate with = evaluate(in.ctx, in.cluster, in.job, l);
  const double save = 70553706496.0 * 14 / 50e9;  // bf16 weights + fp32 master and moments
  EXPECT_DOUBLE_EQ(with.checkpoint_seconds, save);
  EXPECT_NEAR(with.time.checkpoint, save * none.step_seconds / 1800, 1e-12);
  EXPECT_NEAR(with.step_seconds, none.step_seconds + with.time.checkpoint, 1e-12);
}

TEST(StepTime, BubbleIsTheScheduleFormula) {
  PlanInputs in = llama70b_on_h100(1024);
  in.job.checkpoint_interval_seconds = 0;
  Layout l = tp_layout(8, 8, 16, 1);
  for (int64_t v : {1, 2, 5}) {
    l.vpp = v;
    l.schedule = v > 1 ? Schedule::interleaved : Schedule::one_f_one_b;
    ASSERT_EQ(check_layout(in.ctx, in.cluster, in.job, l), "");
    const Estimate e = evaluate(in.ctx, in.cluster, in.job, l);
    EXPECT_EQ(e.microbatches, 2048 / 16);
    ASSERT_EQ(e.stage_seconds.size(), 8u);
    // compute + recompute + bubble = m max(t) + (sum(t) - max(t)) / v, and the
    // bubble is at least the uniform-stage fraction (p - 1) / (v m).
    const double pipe = e.time.compute + e.time.recompute + e.time.bubble;
    EXPECT_NEAR(pipe, pipeline_step(e.stage_seconds, e.microbatches, v), 1e-9 * pipe);
    const double ideal = e.time.compute + e.time.recompute;
    EXPECT_GE(e.time.bubble / ideal, bubble_fraction(8, v, e.microbatches) * (1 - 1e-9));
    // Balanced by cost, the slowest stage is no slower than with uniform stages.
    Job uniform = in.job;
    uniform.balance_pipeline = false;
    const Estimate u = evaluate(in.ctx, in.cluster, uniform, l);
    EXPECT_LE(*std::max_element(e.stage_seconds.begin(), e.stage_seconds.end()),
              *std::max_element(u.stage_seconds.begin(), u.stage_seconds.end()) * (1 + 1e-12));
  }
  l.vpp = 1;
  l.schedule = Schedule::gpipe;
  const Estimate gpipe = evaluate(in.ctx, in.cluster, in.job, l);
  l.schedule = Schedule::one_f_one_b;
  const Estimate ofob = evaluate(in.ctx, in.cluster, in.job, l);
  EXPECT_DOUBLE_EQ(gpipe.time.bubble, ofob.time.bubble);  // same bubble, more memory
  EXPECT_GT(gpipe.memory.activations, 10 * ofob.memory.activations);
}

TEST(HybridSharding, ShardsOverTheGroupAndAllReducesAcrossReplicas) {
  PlanInputs in = llama70b_on_h100(1024);
  in.job.checkpoint_interval_seconds = 0;
  Layout l = tp_layout(8, 1, 128, 3, 1, 2);
  const Estimate full = evaluate(in.ctx, in.cluster, in.job, l);
  l.shard = 16;
  ASSERT_EQ(check_layout(in.ctx, in.cluster, in.job, l), "");
  const Estimate hybrid = evaluate(in.ctx, in.cluster, in.job, l);
  // Model states are ZeRO-3's over 16 ranks instead of 128.
  const StateBytes adam = state_bytes(Precision::bf16, Optimizer::adamw);
  const ModelStates want = model_state_memory(hybrid.params_per_rank, adam, 3, 16);
  EXPECT_DOUBLE_EQ(hybrid.memory.params, want.params);
  EXPECT_DOUBLE_EQ(hybrid.memory.optimizer, want.optimizer);
  EXPECT_NEAR(hybrid.memory.params * 8, full.memory.params * 64, 1e-6 * full.memory.params * 64);
  // The shard group (16 x tp 8 = 16 nodes) is smaller than the DP group: fewer
  // latency steps per gather, plus one all-reduce across the 8 replicas.
  EXPECT_LT(hybrid.dp_comm_raw, full.dp_comm_raw);
  EXPECT_GT(hybrid.dp_comm_raw, 0);

  l.shard = 12;
  EXPECT_EQ(check_layout(in.ctx, in.cluster, in.job, l),
            "shard group 12 must divide dp 128 and be smaller");
  l.shard = 16;
  l.zero = 1;
  EXPECT_EQ(check_layout(in.ctx, in.cluster, in.job, l),
            "a shard group (hybrid sharding) needs ZeRO-3");
  EXPECT_EQ(zero_label(l), "1/16");
}

TEST(HybridSharding, FixedShardIsSearched) {
  PlanInputs in = llama70b_on_h100(1024);
  in.options.fixed.shard = 8;
  const SearchResult r = search(in.ctx, in.cluster, in.job, in.options);
  ASSERT_FALSE(r.ranked.empty());
  for (const Estimate& e : r.ranked) {
    EXPECT_EQ(e.layout.zero, 3);
    EXPECT_EQ(e.layout.shard, 8);
  }
  in.options.fixed.zero = 1;
  EXPECT_EQ(error_of([&] { search(in.ctx, in.cluster, in.job, in.options); }),
            "plan: --shard (hybrid sharding) needs --zero 3");
}


TEST(Search, DeadlineKeepsOnlyLayoutsThatFinishInTime) {
  PlanInputs in = llama70b_on_h100(1024);
  in.options.gpu_counts = {1024, 2048, 4096};
  in.options.rank_by = RankBy::cost;
  in.options.max_train_seconds = 90 * 86400.0;
  const SearchResult r = search(in.ctx, in.cluster, in.job, in.options);
  ASSERT_FALSE(r.ranked.empty());
  EXPECT_GT(r.too_slow, 0);
  for (const Estimate& e : r.ranked) {
    EXPECT_LE(e.train_seconds, 90 * 86400.0);
    EXPECT_GT(e.gpus, 1024);  // 15T tokens of a 70B model take ~200 days on 1024 H100s
  }
  in.options.gpu_counts = {1024};
  const SearchResult late = search(in.ctx, in.cluster, in.job, in.options);
  EXPECT_TRUE(late.ranked.empty());
  EXPECT_EQ(late.too_slow, late.fits);
  const std::string table = format_table(in, late);
  EXPECT_NE(table.find("nothing trains within the deadline"), std::string::npos);
  EXPECT_NE(table.find("too slow:"), std::string::npos);
}


TEST(StepTime, OptimizerStepStreamsItsShardThroughHbm) {
  PlanInputs in = llama70b_on_h100(1024);
  Layout l = tp_layout(8, 4, 32, 1);
  const Estimate e = evaluate(in.ctx, in.cluster, in.job, l);
  // bf16 AdamW: read the 2-byte gradient, read and write 12 bytes of state, write 2-byte weights.
  EXPECT_NEAR(e.time.optimizer, e.params_per_rank / 32 * 28 / 3.35e12, 1e-15);
  l.offload = Offload::optimizer;
  EXPECT_EQ(evaluate(in.ctx, in.cluster, in.job, l).time.optimizer, 0);  // on the host instead
}


TEST(Calibration, RecoversTheEfficiencyOfAMeasuredStep) {
  PlanInputs in = llama70b_on_h100(1024);
  const Layout l = tp_layout(8, 4, 32, 1, 5);
  ASSERT_EQ(check_layout(in.ctx, in.cluster, in.job, l), "");
  for (double eff : {0.23, 0.41, 0.62}) {
    Job job = in.job;
    job.compute_efficiency = eff;
    const double measured = evaluate(in.ctx, in.cluster, job, l).step_seconds;
    EXPECT_NEAR(calibrate_efficiency(in.ctx, in.cluster, in.job, l, measured), eff, 1e-6);
  }
  EXPECT_NE(error_of([&] { calibrate_efficiency(in.ctx, in.cluster, in.job, l, 0.5); })
                .find("is faster than"),
            std::string::npos);
}

// Mixtral 8x7B on 64 H100 with expert parallelism: the routed experts' state
// falls as 1 / ep while the rest stays; the all-to-alls are priced on the
// node's links while the ep group (x tp) fits in a node and on the
// inter-node links beyond; bad layouts say why; the search covers ep.
TEST(ExpertParallel, ShardsExpertStateAndPricesTheAllToAlls) {
  const ModelConfig model = plan_model("mixtral-8x7b").config;
  Job job;
  job.seq = 4096;
  job.global_batch = 256;
  job.tokens = 1e12;
  job.checkpoint_interval_seconds = 0;
  const PlanContext ctx = make_context(model, job);
  const Cluster cl = make_cluster(gpu_spec("h100-sxm"), 64, 8);
  auto at = [&](int64_t tp, int64_t ep, int zero) {
    Layout l = tp_layout(tp, 1, 64 / tp, zero);
    l.ep = ep;
    l.recompute = Recompute::full;
    EXPECT_EQ(check_layout(ctx, cl, job, l), "");
    return evaluate(ctx, cl, job, l);
  };
  const TransformerCounts& n = ctx.counts;
  const double experts = n.layer_expert_params * static_cast<double>(model.n_layers);
  const Estimate ep1 = at(1, 1, 0), ep8 = at(1, 8, 0);
  // DDP: 2 bytes of bf16 weights per parameter; the experts' are 1 / 8 at ep 8.
  EXPECT_NEAR(ep1.params_per_rank - ep8.params_per_rank, experts * 7.0 / 8.0, 1);
  EXPECT_NEAR(ep1.memory.params - ep8.memory.params, 2 * experts * 7.0 / 8.0, 1e3);
  EXPECT_EQ(ep1.time.ep, 0);
  EXPECT_GT(ep8.time.ep, 0);
  // 4 all-to-alls per MoE layer and micro-batch (6 with full recomputation) of
  // the rank's tokens x top_k x dim in bf16.
  const double per_call = 4096.0 * 2 * 4096 * 2;
  EXPECT_NEAR(ep8.ep_bytes_per_step, 4.0 * 32 * 6 * per_call, 1);
  // ZeRO-1 shards the experts' optimizer state over dp / ep = 8 ranks, the rest over 64.
  const Estimate z1 = at(1, 8, 1);
  const double dense = n.total_params - experts;
  EXPECT_NEAR(z1.memory.optimizer, 12 * (dense / 64 + experts / 8 / 8), 1e3);
  // ep 8 x tp 2 spans 16 GPUs: the all-to-alls leave the node and cost more.
  const Estimate inter = at(2, 8, 0), intra = at(2, 4, 0);
  EXPECT_GT(inter.time.ep / inter.ep_bytes_per_step, 2 * intra.time.ep / intra.ep_bytes_per_step);

  Layout bad = tp_layout(1, 1, 64, 0);
  bad.ep = 3;
  EXPECT_EQ(check_layout(ctx, cl, job, bad), "ep 3 does not divide dp 64");
  bad.ep = 16;
  EXPECT_EQ(check_layout(ctx, cl, job, bad), "ep 16 does not divide the 8 experts");
  const PlanContext dense_ctx = make_context(plan_model("llama2-7b").config, job);
  bad.ep = 2;
  EXPECT_EQ(check_layout(dense_ctx, cl, job, bad), "ep > 1 needs a mixture-of-experts model");

  SearchOptions opt;
  opt.gpu_counts = {64};
  opt.fixed.tp = 1;
  opt.fixed.pp = 1;
  opt.top = 3;
  const SearchResult all = search(ctx, cl, job, opt);
  ASSERT_FALSE(all.ranked.empty());
  EXPECT_GT(all.ranked.front().layout.ep, 1) << "the experts do not fit whole on every GPU";
  opt.fixed.ep = 4;
  for (const Estimate& e : search(ctx, cl, job, opt).ranked) EXPECT_EQ(e.layout.ep, 4);
}

}  // namespace
}  // namespace meshtrain::plan
