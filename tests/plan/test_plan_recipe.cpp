// DeepSeek-V3's training recipe in the planner, one mechanism at a time:
// FP8 GEMMs, MLA's up-projections recomputed, node-limited FP8 dispatch,
// DualPipe (split, bubble, memory, overlap and the SMs it costs) and MTP.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>

#include "meshtrain/plan/models.h"
#include "meshtrain/plan/pipeline_split.h"
#include "meshtrain/plan/search.h"
#include "meshtrain/util/error.h"

namespace meshtrain::plan {
namespace {

const OpTime& op_named(const OpsTime& ops, const std::string& name) {
  for (const OpTime& op : ops.ops) {
    if (op.name == name) return op;
  }
  throw std::runtime_error("no op " + name);
}

ComputeShape deepseek_shape(bool fp8) {
  ComputeShape x;
  x.seq = 4096;
  x.fp8 = fp8;
  return x;
}

TEST(Fp8, BlockGemmsRunAtTheFp8PeakTheRestStaysSixteenBit) {
  const ModelConfig m = plan_model("deepseek-v3").config;
  const GpuSpec gpu = gpu_spec("h800");
  EXPECT_DOUBLE_EQ(gpu.fp8_peak_flops, 2 * gpu.peak_flops);
  const OpsTime bf16 = layer_time(m, gpu, deepseek_shape(false));
  const OpsTime fp8 = layer_time(m, gpu, deepseek_shape(true));
  // gate|up: T tokens x 7168 -> 2 x the active width, three GEMMs at the FP8
  // peak on 1-byte operands (what an HBM-bound short GEMM reads), plus
  // quantising x forward and dy backward.
  const double in = 7168, out = 2 * active_mlp_width(m);
  GpuSpec fast = gpu;
  fast.peak_flops = gpu.fp8_peak_flops;
  for (int64_t seq : {4096, 8}) {
    ComputeShape x = deepseek_shape(true);
    x.seq = seq;
    const double T = static_cast<double>(seq);
    const OpTime up = op_named(layer_time(m, gpu, x), "gate|up");
    EXPECT_DOUBLE_EQ(up.forward,
                     memory_seconds(T * in * 3, gpu) + gemm_seconds(T, out, in, 1, fast));
    EXPECT_DOUBLE_EQ(up.weight, gemm_seconds(in, out, T, 1, fast));
    EXPECT_DOUBLE_EQ(up.backward, memory_seconds(T * out * 3, gpu) +
                                      gemm_seconds(T, in, out, 1, fast) + up.weight);
  }
  EXPECT_LT(op_named(fp8, "gate|up").total(), 0.6 * op_named(bf16, "gate|up").total());
  // Attention, the router and the output layer stay 16-bit.
  for (const char* name : {"attention", "router", "norms (2)"}) {
    EXPECT_DOUBLE_EQ(op_named(fp8, name).total(), op_named(bf16, name).total()) << name;
  }
  EXPECT_DOUBLE_EQ(head_time(m, gpu, deepseek_shape(true)).total(),
                   head_time(m, gpu, deepseek_shape(false)).total());
}

TEST(Fp8, KeepsTheLinearInputsInEightBits) {
  ActivationShape x{active_dense_view(plan_model("llama3-8b").config), 4096};
  x.recompute = Recompute::selective;
  const double bf16 = layer_activation_bytes(x);
  x.linear_input_bytes = 1;
  const double fp8 = layer_activation_bytes(x);
  // What moves to 1 byte: the attention and MLP inputs (sbh each), the
  // o-projection's input (sb x 4096) and gate|up (2 sbf); Q, K, V and the norm
  // inputs stay 2 bytes.
  const double sb = 4096, h = 4096, f = 14336;
  EXPECT_DOUBLE_EQ(bf16 - fp8, sb * (2 * h + 4096 + 2 * f));
}

TEST(Fp8, RefusedInFp32AndWithoutFp8TensorCores) {
  Job job;
  job.seq = 4096;
  job.global_batch = 64;
  job.fp8 = true;
  job.precision = Precision::fp32;
  EXPECT_THROW(job.validate(), Error);
  job.precision = Precision::bf16;
  job.validate();
  const PlanContext ctx = make_context(plan_model("llama3-8b").config, job);
  SearchOptions opt;
  opt.gpu_counts = {8};
  try {
    search(ctx, make_cluster(gpu_spec("a100-80gb"), 8, 8), job, opt);
    FAIL() << "FP8 on an A100";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "plan: --fp8: the a100-80gb has no FP8 tensor cores");
  }
}

TEST(Mla, SelectiveRecomputesTheUpProjectionsInsteadOfKeepingQkv) {
  const ModelConfig m = plan_model("deepseek-v3").config;
  ComputeShape x = deepseek_shape(false);
  x.recompute = Recompute::selective;
  const OpsTime ops = layer_time(m, gpu_spec("h800"), x);
  for (const char* name : {"q_b", "kv_b"}) {
    EXPECT_DOUBLE_EQ(op_named(ops, name).recompute, op_named(ops, name).forward) << name;
  }
  for (const char* name : {"q_a", "kv_a", "o-proj"}) {
    EXPECT_EQ(op_named(ops, name).recompute, 0) << name;
  }
  const AttentionShape at = attention_shape(m);
  EXPECT_DOUBLE_EQ(at.from_latent, at.qk + at.k + at.v);
  ActivationShape a{active_dense_view(m), 4096};
  a.recompute = Recompute::none;
  const double none = layer_activation_bytes(a);
  a.recompute = Recompute::selective;
  const double selective = layer_activation_bytes(a);
  // Selective drops the attention core, Q, K, V and SwiGLU's product (sbf).
  const double sb = 4096, f = static_cast<double>(a.model.hidden_dim);
  const double core = 2 * 128 * sb * 4096;
  EXPECT_DOUBLE_EQ(none - selective, core + 2 * sb * at.from_latent + 2 * sb * f);
}

// A model on a cluster with a base layout whose schedule the tests choose.
struct Fixture {
  Job job;
  PlanContext ctx;
  Cluster cl;
  Layout base;
  Fixture(const char* model, const char* gpu, int64_t gpus, int64_t batch, Layout l)
      : cl(make_cluster(gpu_spec(gpu), gpus, 8)), base(l) {
    job.seq = 4096;
    job.global_batch = batch;
    job.checkpoint_interval_seconds = 0;
    ctx = make_context(plan_model(model).config, job);
  }
  Layout layout(Schedule s) const {
    Layout l = base;
    l.schedule = s;
    return l;
  }
  Estimate at(const Job& j, const Layout& l) const {
    EXPECT_EQ(check_layout(ctx, cl, j, l), "");
    return evaluate(ctx, cl, j, l);
  }
};

// A dense Llama on pp 4: the DualPipe pieces can be counted by hand.
struct DualFixture : Fixture {
  DualFixture() : Fixture("llama3-8b", "h100-sxm", 8, 64, {.pp = 4, .dp = 2}) {}
};

// DeepSeek-V3 on its 2,048 H800 (pp 16, ep 64 over 8 nodes, dp 128).
struct DeepSeekFixture : Fixture {
  DeepSeekFixture()
      : Fixture("deepseek-v3", "h800", 2048, 15360, {.pp = 16, .dp = 128, .ep = 64, .zero = 1}) {}
};

TEST(DualPipe, BubbleIsTheReportsFormulaOverTheSlowerPairOfStages) {
  const DualFixture f;
  const Layout l = f.layout(Schedule::dualpipe);
  ASSERT_EQ(check_layout(f.ctx, f.cl, f.job, l), "");
  const Estimate e = evaluate(f.ctx, f.cl, f.job, l);
  const OpsTime layer = layer_time(f.ctx.model, layout_gpu(f.cl, f.job, l), compute_shape(f.job, l));
  const double t = dualpipe_pace(e.stage_seconds), share = t / layer.total();
  const double F = share * layer.forward, W = share * layer.weight, B = t - F;
  const double m = static_cast<double>(e.microbatches);  // 64 / 2
  // DeepSeek-V3 table 2: (pp / 2 - 1)(F&B + B - 3W), F&B = F + B.
  EXPECT_NEAR(e.time.compute + e.time.recompute + e.time.bubble,
              m * t + (4.0 / 2 - 1) * std::max(0.0, F + 2 * B - 3 * W), 1e-12);
  const Estimate one = evaluate(f.ctx, f.cl, f.job, f.layout(Schedule::one_f_one_b));
  EXPECT_LT(e.time.bubble, 0.5 * one.time.bubble);
}

TEST(DualPipe, EachRankHoldsTwoStagesAndTheirMicroBatches) {
  const DualFixture f;
  Job job = f.job;
  job.balance_pipeline = false;  // 8 layers per stage
  const Estimate dual = evaluate(f.ctx, f.cl, job, f.layout(Schedule::dualpipe));
  const Estimate one = evaluate(f.ctx, f.cl, job, f.layout(Schedule::one_f_one_b));
  const TransformerCounts& n = f.ctx.counts;
  // Rank 0 holds stages 0 and 3: 16 blocks, the embedding and the head.
  EXPECT_DOUBLE_EQ(dual.params_per_rank, 16 * n.layer_params + n.embedding_params + n.head_params);
  EXPECT_DOUBLE_EQ(one.params_per_rank, 8 * n.layer_params + n.embedding_params);
  // Its activations: 4 micro-batches of stage 0, 1 of stage 3 (p + 1 in all).
  const ActivationShape a = activation_shape(f.ctx, job, f.layout(Schedule::dualpipe));
  const double layer = layer_activation_bytes(a);
  EXPECT_NEAR(dual.memory.activations,
              4 * (8 * layer + first_stage_activation_bytes(a)) +
                  1 * (8 * layer + last_stage_activation_bytes(a)),
              1);
  EXPECT_EQ(inflight_microbatches(Schedule::dualpipe, 4, 1, 32, 0), 5);
  Layout odd = f.layout(Schedule::dualpipe);
  odd.pp = 1;
  odd.dp = 8;
  EXPECT_EQ(check_layout(f.ctx, f.cl, job, odd),
            "dualpipe needs an even pp >= 2 and an even number of micro-batches (pp 1, 8 "
            "micro-batches)");
}

TEST(DualPipe, SplitBalancesPairsOfStagesAgainstBruteForce) {
  const LayerCosts costs{1.0, 0.5, 3.5};
  EXPECT_EQ(balanced_dualpipe_split(costs, 20, 4), (std::vector<int64_t>{4, 6, 6, 4}));
  EXPECT_DOUBLE_EQ(dualpipe_pace({4.5, 6, 6, 7.5}), 6);
  for (int64_t layers : {8, 11, 17}) {
    for (const LayerCosts& c : {costs, LayerCosts{1, 0.1, 7}, LayerCosts{1, 2, 0.2}}) {
      double best = std::numeric_limits<double>::infinity();
      std::vector<int64_t> split(4);
      std::function<void(size_t, int64_t)> walk = [&](size_t r, int64_t left) {
        if (r == 3) {
          split[3] = left;
          if (left >= 1) best = std::min(best, dualpipe_pace(stage_costs(c, split, 4)));
          return;
        }
        for (int64_t k = 1; k <= left - static_cast<int64_t>(3 - r); ++k) {
          split[r] = k;
          walk(r + 1, left - k);
        }
      };
      walk(0, layers);
      const double got = dualpipe_pace(stage_costs(c, balanced_dualpipe_split(c, layers, 4), 4));
      EXPECT_NEAR(got, best, 1e-12) << layers << " layers";
    }
  }
}

TEST(NodeLimitedDispatch, CrossesTheNetworkOncePerTargetNode) {
  const DeepSeekFixture f;
  const Layout l = f.layout(Schedule::one_f_one_b);
  const Estimate e = f.at(f.job, l);
  const double values = 4096.0 * 7168, moe_layers = static_cast<double>(e.layers_per_stage) * 58 / 61;
  const double m = static_cast<double>(e.microbatches);
  // 8 nodes, 4 groups of 8 chosen: 4 target nodes, 7/8 of them remote, then
  // top 8 copies over NVLink; four bf16 calls per layer and micro-batch.
  const double per_value = 4.0 * 7 / 8 + 8;
  EXPECT_NEAR(e.ep_bytes_per_step / (m * moe_layers * 4 * values * 2), per_value, 1e-9);
  // FP8 dispatch: two of the four calls at 1 byte + a 4-byte scale per 128.
  Job fp8 = f.job;
  fp8.fp8 = true;
  EXPECT_NEAR(f.at(fp8, l).ep_bytes_per_step / e.ep_bytes_per_step, (2 * (1 + 4.0 / 128) + 4) / 8,
              1e-12);
  // Without the group limit every one of the 8 copies crosses the network:
  // slower although fewer bytes are counted (no NVLink fan-out).
  DeepSeekFixture flat;
  ModelConfig ungrouped = flat.ctx.model;
  ungrouped.moe.n_groups = ungrouped.moe.topk_groups = 1;
  flat.ctx = make_context(ungrouped, flat.job);
  const Estimate open = flat.at(flat.job, l);
  EXPECT_NEAR(open.ep_bytes_per_step / (m * moe_layers * 4 * values * 2), 8, 1e-9);
  EXPECT_GT(open.ep_comm_raw, 1.5 * e.ep_comm_raw);
}

// Megatron-Core's folding on Megatron-Bridge's H100 layout (tp 2, pp 8, ep 64,
// dp 64): the ep group is 64 consecutive GPUs (8 nodes) instead of 64 ranks
// two apart (16 nodes), and the experts' state is sharded over tp x dp / ep.
TEST(EpFold, TheGroupSpansEpGpusAndShardsExpertStateOverTpTimesDp) {
  Fixture f("deepseek-v3", "h100-sxm", 1024, 8192, {.tp = 2, .pp = 8, .dp = 64, .ep = 64, .zero = 1});
  f.base.sequence_parallel = true;
  Layout folded = f.layout(Schedule::one_f_one_b);
  folded.ep_fold = true;
  const Estimate drawn = f.at(f.job, f.layout(Schedule::one_f_one_b)), fold = f.at(f.job, folded);
  const double values = 4096.0 / 2 * 7168;  // SP: a rank's half of the sequence
  const double calls = static_cast<double>(fold.microbatches * fold.layers_per_stage) * 58 / 61 * 4 * 2;
  // 16 nodes: 8 target nodes (4 of 8 groups x 2 nodes each), 15/16 remote; 8 nodes: 4, 7/8.
  EXPECT_NEAR(drawn.ep_bytes_per_step / (calls * values), 8.0 * 15 / 16 + 8, 1e-9);
  EXPECT_NEAR(fold.ep_bytes_per_step / (calls * values), 4.0 * 7 / 8 + 8, 1e-9);
  EXPECT_LT(fold.ep_comm_raw, 0.6 * drawn.ep_comm_raw);
  // Expert optimizer state over 2 ranks instead of 1; the dense part unchanged.
  const double expert_states = drawn.memory.optimizer - fold.memory.optimizer;
  EXPECT_GT(expert_states, 0);
  Layout dense_only = folded;
  dense_only.ep_fold = false;
  EXPECT_EQ(folded.expert_dp(), 2);
  EXPECT_EQ(dense_only.expert_dp(), 1);
  // ep 128 divides tp x dp but not dp; a shard group is not modelled folded.
  folded.ep = 128;
  EXPECT_EQ(check_layout(f.ctx, f.cl, f.job, folded), "");
  folded.ep_fold = false;
  EXPECT_NE(check_layout(f.ctx, f.cl, f.job, folded).find("does not divide dp"), std::string::npos);
  Layout sharded = f.layout(Schedule::one_f_one_b);
  sharded.ep_fold = true;
  sharded.zero = 3;
  sharded.shard = 8;
  EXPECT_NE(check_layout(f.ctx, f.cl, f.job, sharded).find("--ep-fold"), std::string::npos);
}

TEST(DualPipe, HidesTheAllToAllsAndPaysTheirSms) {
  const DeepSeekFixture f;
  const Estimate one = f.at(f.job, f.layout(Schedule::one_f_one_b));
  const Estimate dual = f.at(f.job, f.layout(Schedule::dualpipe));
  EXPECT_DOUBLE_EQ(one.time.ep, one.ep_comm_raw);
  EXPECT_LT(dual.time.ep, 0.1 * dual.ep_comm_raw);
  // The compute runs on 112 of the 132 SMs: the FLOP-bound ops take 132/112
  // as long, the memory-bound ones no longer.
  const GpuSpec left = layout_gpu(f.cl, f.job, f.layout(Schedule::dualpipe));
  EXPECT_DOUBLE_EQ(left.peak_flops, f.cl.gpu.peak_flops * 112 / 132);
  EXPECT_DOUBLE_EQ(left.fp8_peak_flops, f.cl.gpu.fp8_peak_flops * 112 / 132);
  EXPECT_DOUBLE_EQ(layout_gpu(f.cl, f.job, f.layout(Schedule::one_f_one_b)).peak_flops,
                   f.cl.gpu.peak_flops);
  Job all_sms = f.job;
  all_sms.comm_sms = 0;
  const Estimate free = f.at(all_sms, f.layout(Schedule::dualpipe));
  const double slower =
      (dual.time.compute + dual.time.recompute) / (free.time.compute + free.time.recompute);
  EXPECT_GT(slower, 1.1);
  EXPECT_LT(slower, 132.0 / 112);
  // A network 20x slower: what exceeds each layer's compute is exposed.
  DeepSeekFixture slow;
  slow.cl.inter.bus_bandwidth /= 20;
  const Layout l = slow.layout(Schedule::dualpipe);
  const Estimate e = slow.at(slow.job, l);
  const OpsTime layer =
      layer_time(slow.ctx.model, layout_gpu(slow.cl, slow.job, l), compute_shape(slow.job, l));
  const double moe_layers = static_cast<double>(e.layers_per_stage) * 58 / 61;
  const double m = static_cast<double>(e.microbatches);
  EXPECT_NEAR(e.time.ep, e.ep_comm_raw - m * moe_layers * layer.total(), 1e-9 * e.ep_comm_raw);
  EXPECT_GT(e.time.ep, 0);
}

TEST(Mtp, AddsABlockAndTheSharedOutputLayerOnTheLastStage) {
  const ModelConfig m = plan_model("deepseek-v3").config;
  const GpuSpec gpu = gpu_spec("h800");
  ComputeShape x = deepseek_shape(false);
  const OpsTime plain = head_time(m, gpu, x);
  x.mtp = 1;
  const OpsTime mtp = head_time(m, gpu, x);
  EXPECT_DOUBLE_EQ(op_named(mtp, "mtp block").total(), layer_time(m, gpu, x).total());
  EXPECT_DOUBLE_EQ(op_named(mtp, "mtp output").total(), op_named(plain, "output").total());
  EXPECT_DOUBLE_EQ(op_named(mtp, "mtp proj").flops, 2 * 4096.0 * 2 * 7168 * 7168);
  EXPECT_GT(mtp.total(), plain.total() + layer_time(m, gpu, x).total());

  // The last stage (here the only one) holds one more block, a 2h x h
  // projection and its 3 norms, and keeps that block's activations and a
  // second set of logits per micro-batch.
  const DualFixture f;
  Job job = f.job;
  job.mtp = 1;
  Layout l;
  l.dp = 8;
  l.recompute = Recompute::selective;
  const Estimate with = evaluate(f.ctx, f.cl, job, l);
  const Estimate without = evaluate(f.ctx, f.cl, f.job, l);
  const double h = 4096;
  EXPECT_DOUBLE_EQ(with.params_per_rank - without.params_per_rank,
                   f.ctx.counts.layer_params + 2 * h * h + 3 * h);
  const ActivationShape a = activation_shape(f.ctx, job, l);
  EXPECT_NEAR(with.memory.activations - without.memory.activations,
              layer_activation_bytes(a) + last_stage_activation_bytes(a), 1);
}

}  // namespace
}  // namespace meshtrain::plan
