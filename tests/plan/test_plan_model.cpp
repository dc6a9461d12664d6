// Presets against their published sizes, the closed-form counts against the
// parameter registry, FLOPs against a count of the model's matmuls, the GPU
// catalog, collectives and input parsing.
#include <gtest/gtest.h>

#include <cmath>

#include "meshtrain/model/params.h"
#include "meshtrain/util/error.h"
#include "meshtrain/plan/collectives.h"
#include "meshtrain/plan/hardware.h"
#include "meshtrain/plan/inputs.h"
#include "meshtrain/plan/memory.h"
#include "meshtrain/plan/models.h"
#include "meshtrain/plan/planner.h"
#include "meshtrain/plan/report.h"
#include "meshtrain/plan/search.h"
#include "meshtrain/plan/transformer.h"

namespace meshtrain::plan {
namespace {

TEST(Presets, ParameterCountsWithinOnePercentOfPublished) {
  const std::vector<std::string> names = plan_model_names();
  ASSERT_EQ(names.size(), 19u);
  for (const std::string& name : names) {
    const PlanModel m = plan_model(name);
    ASSERT_GT(m.published_params, 0) << name;
    const double n = count_transformer(m.config).total_params;  // == num_params(): Counts
    EXPECT_NEAR(n / m.published_params, 1.0, 0.01) << name << ": " << n;
  }
}

TEST(Presets, ExactCountsOfTheOfficialCheckpoints) {
  // Hugging Face safetensors totals of the official checkpoints.
  EXPECT_EQ(plan_model("gpt2-124m").config.num_params(), 124439808);
  EXPECT_EQ(plan_model("gpt2-350m").config.num_params(), 354823168);
  EXPECT_EQ(plan_model("gpt2-774m").config.num_params(), 774030080);
  EXPECT_EQ(plan_model("gpt2-1.5b").config.num_params(), 1557611200);
  EXPECT_EQ(plan_model("llama1-65b").config.num_params(), 65285660672);  // huggyllama/llama-65b
  EXPECT_EQ(plan_model("llama2-7b").config.num_params(), 6738415616);
  EXPECT_EQ(plan_model("mixtral-8x7b").config.num_params(), 46702792704);
  EXPECT_EQ(plan_model("llama2-13b").config.num_params(), 13015864320);
  EXPECT_EQ(plan_model("llama2-70b").config.num_params(), 68976648192);
  EXPECT_EQ(plan_model("llama3-8b").config.num_params(), 8030261248);
  EXPECT_EQ(plan_model("llama3-70b").config.num_params(), 70553706496);
  EXPECT_EQ(plan_model("llama3-405b").config.num_params(), 405853388800);
  EXPECT_EQ(plan_model("mistral-7b").config.num_params(), 7241732096);    // mistralai/Mistral-7B-v0.1
  EXPECT_EQ(plan_model("qwen2.5-7b").config.num_params(), 7615616512);    // Qwen/Qwen2.5-7B
  EXPECT_EQ(plan_model("qwen3-8b").config.num_params(), 8190735360);      // Qwen/Qwen3-8B
  // Qwen/Qwen3-235B-A22B: 94 x (attention 71,303,424 + QK-norms 256 + norms
  // 8,192 + router 524,288 + 128 experts x 3 x 1536 x 4096) + 2 x 151936 x
  // 4096 + 4096, the 235.09B its checkpoint holds.
  EXPECT_EQ(plan_model("qwen3-235b-a22b").config.num_params(), 235093634560);
}

// Qwen3-30B-A3B's active parameters (its model card: 3.3B activated): the
// planner's FLOPs count top_k of 128 experts per token.
TEST(Presets, Qwen3MoeCountsItsActiveParameters) {
  const ModelConfig c = plan_model("qwen3-30b-a3b").config;
  EXPECT_EQ(c.head_dim(), 128);
  EXPECT_NE(c.attention_width(), c.dim);
  double active = 0;
  for (const ParamSpec& spec : build_param_specs(c)) active += spec.active * static_cast<double>(spec.numel());
  EXPECT_NEAR(active / 3.3e9, 1.0, 0.02) << active;
}

// DeepSeek-V3 counted module by module as HF's modeling_deepseek_v3.py
// declares them (latent attention: q_a_proj [1536, 7168], q_a_layernorm,
// q_b_proj [128 x 192, 1536], kv_a_proj_with_mqa [512 + 64, 7168],
// kv_a_layernorm, kv_b_proj [128 x 256, 512], o_proj [7168, 128 x 128]; the
// MoE's gate [256, 7168] and its e_score_correction_bias, 256 experts and one
// shared expert of 3 x 2048 x 7168; 3 dense layers of 3 x 18432 x 7168): the
// closed form's totals, its active count (37B, the technical report), its
// attention FLOPs (scores over 192 and values over 128 per head), and the
// engine refusing to build it.
TEST(Presets, DeepSeekV3LatentAttentionCountedModuleByModule) {
  const ModelConfig c = plan_model("deepseek-v3").config;
  const double d = 7168, heads = 128, expert = 3 * 2048 * d;
  const double attention = 1536 * d + 1536 + heads * 192 * 1536 + 576 * d + 512 +
                           heads * 256 * 512 + d * heads * 128;
  const double moe = 256 * d + 256 + 256 * expert + expert;
  const double dense = 3 * 18432 * d;
  const double norms = 2 * d, ends = 2 * 129280 * d + d;
  const double total = 61 * (attention + norms) + 3 * dense + 58 * moe + ends;
  const TransformerCounts n = count_transformer(c);
  EXPECT_NEAR(n.total_params / total, 1.0, 1e-12);
  EXPECT_NEAR(total / 671e9, 1.0, 0.001);
  const double active_attention = attention - 1536 - 512;  // the latent norms are no GEMMs
  const double active = 61 * active_attention + 3 * dense + 58 * (256 * d + 9 * expert);
  EXPECT_NEAR(61 * n.layer_matmul_params / active, 1.0, 1e-12);
  EXPECT_NEAR((active + 129280 * d) / 37e9, 1.0, 0.02);  // + the output layer
  Job job;
  job.seq = 4096;
  EXPECT_NEAR(make_context(c, job).model_flops_per_token /
                  (6 * (active + 129280 * d) + 61 * 6.0 * 4096 * heads * (192 + 128)),
              1.0, 1e-12);
  EXPECT_THROW(c.num_params(), Error);
  try {
    build_param_specs(c);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.mla:"), std::string::npos) << e.what();
  }
}

TEST(Presets, UnknownNameListsTheKnownOnes) {
  try {
    plan_model("llama4-1t");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown model 'llama4-1t'"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("llama3-405b"), std::string::npos);
  }
  EXPECT_EQ(plan_model("gpt2-124M").config.dim, 768);  // the engine's presets work too
}

TEST(Counts, ClosedFormEqualsTheRegistry) {
  std::vector<ModelConfig> configs;
  for (const std::string& name : plan_model_names()) {
    const ModelConfig c = plan_model(name).config;
    if (!c.mla.enabled()) configs.push_back(c);  // the engine builds no MLA: DeepSeekV3 below
  }
  for (const std::string& name : model_preset_names()) configs.push_back(model_preset(name));
  // Qwen2's q/k/v biases; OLMoE's QK-norm over the projection, at a head width of its own.
  ModelConfig biased = model_preset("llama-tiny");
  biased.qkv_bias = true;
  ModelConfig olmoe = model_preset("llama-tiny");
  olmoe.qk_norm = QkNorm::full;
  olmoe.head_width = 12;
  configs.push_back(biased);
  configs.push_back(olmoe);
  for (const ModelConfig& c : configs) {
    const TransformerCounts n = count_transformer(c);
    double matmul = 0, layer0 = 0;
    for (const ParamSpec& spec : build_param_specs(c)) {
      // The GEMM weights a token uses: a MoE's router, and top_k of E experts.
      if (spec.matmul_weight || spec.f32_gemm) {
        matmul += spec.active * static_cast<double>(spec.numel());
      }
      const bool first_layer = spec.name.find("layers.0.") != std::string::npos ||
                               spec.name.find("h.0.") != std::string::npos;
      if (first_layer) layer0 += static_cast<double>(spec.numel());
    }
    EXPECT_EQ(n.total_params, static_cast<double>(c.num_params())) << c.dim;
    EXPECT_EQ(n.layer_params, layer0) << c.dim;
    EXPECT_EQ(static_cast<double>(c.n_layers) * n.layer_matmul_params + n.output_matmul_params,
              matmul)
        << c.dim;
  }
}

// Training FLOPs per token from the registry's GEMM shapes: each weight
// [out, in] costs 2 in out per token forward; attention QK^T and AV cost
// 2 s (H D) each per token and layer; backward is twice the forward.
double counted_flops_per_token(const ModelConfig& c, int64_t seq) {
  double forward = 0;
  for (const ParamSpec& spec : build_param_specs(c)) {
    if (spec.matmul_weight) forward += 2.0 * static_cast<double>(spec.shape[0] * spec.shape[1]);
  }
  const double hd = static_cast<double>(c.n_heads * c.head_dim());
  forward += static_cast<double>(c.n_layers) * 2 * (2.0 * static_cast<double>(seq) * hd);
  return 3 * forward;
}

TEST(Flops, MatchACountOfTheMatmuls) {
  for (const char* name : {"gpt2-124m", "gpt2-1.5b", "llama2-7b", "llama3-8b",
                                  "llama3-70b"}) {
    const ModelConfig c = plan_model(name).config;
    for (int64_t seq : {1024, 4096}) {
      const double counted = counted_flops_per_token(c, seq);
      EXPECT_NEAR(c.train_flops_per_token(seq) / counted, 1.0, 1e-12) << name;
      Job job;
      job.seq = seq;
      EXPECT_NEAR(make_context(c, job).model_flops_per_token / counted, 1.0, 1e-12) << name;
      // 6 N + 12 L s h, with N the GEMM weights (an untied embedding is a lookup).
      const TransformerCounts n = count_transformer(c);
      const double six_n = 6 * (static_cast<double>(c.n_layers) * n.layer_matmul_params +
                                n.output_matmul_params);
      const double attention = 12.0 * static_cast<double>(c.n_layers * seq * c.dim);
      EXPECT_NEAR((six_n + attention) / counted, 1.0, 1e-12) << name;
    }
  }
}

// Mistral's sliding window (4096): attention FLOPs as the causal pairs it keeps, the same
// below the window; context parallelism, which the engine lacks with a window, not offered.
TEST(Flops, SlidingWindowCountsTheKeyPairsItKeeps) {
  const ModelConfig mistral = plan_model("mistral-7b").config;
  ASSERT_EQ(mistral.sliding_window, 4096);
  ModelConfig full = mistral;
  full.sliding_window = 0;
  EXPECT_EQ(mistral.train_flops_per_token(4096), full.train_flops_per_token(4096));
  // At 32768: 4096 * 4097 / 2 + 28672 * 4096 pairs of 32768 * 32769 / 2.
  const double pairs = 4096.0 * 4097 / 2 + 28672.0 * 4096, causal = 32768.0 * 32769 / 2;
  EXPECT_NEAR(mistral.attention_seq(32768), 32768 * pairs / causal, 1e-9);
  const double attention = [](const ModelConfig& c, double s) {
    return 12.0 * static_cast<double>(c.n_layers * c.attention_width()) * s;
  }(mistral, 32768);
  EXPECT_NEAR(full.train_flops_per_token(32768) - mistral.train_flops_per_token(32768),
              attention * (1 - pairs / causal), 1e-3 * attention);
  Job job;
  job.seq = 32768;
  EXPECT_EQ(make_context(mistral, job).model_flops_per_token, mistral.train_flops_per_token(32768));
  PlanInputs in;
  in.job = job;
  in.job.global_batch = 64;
  in.job.tokens = 1e9;
  in.ctx = make_context(mistral, in.job);
  in.cluster = make_cluster(gpu_spec("h100-sxm"), 8, 8);
  in.options.gpu_counts = {8};
  const SearchResult r = search(in.ctx, in.cluster, in.job, in.options);
  ASSERT_FALSE(r.ranked.empty());
  for (const Estimate& e : r.ranked) {
    EXPECT_EQ(e.layout.cp, 1);
  }
}

// Mixtures of experts: the planner's closed-form counts equal the registry's
// (total parameters, active FLOPs with the router and shared experts, the
// routed experts' share), for Mixtral and for a DeepSeek-style layout with
// dense first layers, a gated shared expert and a selection bias; a token's
// dense view has the active width.
TEST(Flops, MixturesOfExpertsCountTheRegistryAndActiveParameters) {
  ModelConfig deepseek = plan_model("llama2-7b").config;
  deepseek.n_layers = 6;
  deepseek.moe.experts = 16;
  deepseek.moe.top_k = 4;
  deepseek.moe.hidden_dim = 1024;
  deepseek.moe.first_dense = 2;
  deepseek.moe.shared_hidden = 2048;
  deepseek.moe.shared_gate = true;
  deepseek.moe.score = ops::RouterScore::sigmoid;
  deepseek.moe.bias_update_rate = 0.001;
  for (const ModelConfig& c : {plan_model("mixtral-8x7b").config, deepseek}) {
    const TransformerCounts n = count_transformer(c);
    EXPECT_NEAR(n.total_params / static_cast<double>(c.num_params()), 1.0, 1e-12);
    double experts = 0;
    for (const ParamSpec& spec : build_param_specs(c)) {
      if (spec.expert) experts += static_cast<double>(spec.numel());
    }
    EXPECT_NEAR(n.layer_expert_params * static_cast<double>(c.n_layers) / experts, 1.0, 1e-12);
    Job job;
    job.seq = 4096;
    EXPECT_NEAR(make_context(c, job).model_flops_per_token / c.train_flops_per_token(4096), 1.0,
                1e-12);
  }
  const ModelConfig mixtral = plan_model("mixtral-8x7b").config;
  EXPECT_EQ(active_dense_view(mixtral).hidden_dim, 2 * 14336);
  EXPECT_FALSE(active_dense_view(mixtral).moe.enabled());
  // (2 dense layers of 11008 + 4 MoE layers of 4 x 1024 + 2048) / 6.
  EXPECT_EQ(active_dense_view(deepseek).hidden_dim, (2 * 11008 + 4 * 6144) / 6);
  EXPECT_EQ(count_transformer(deepseek).moe_layers, 4);
}

TEST(Flops, RecomputationAddsTheForwardItRepeats) {
  const ModelConfig c = plan_model("llama3-8b").config;
  Job job;
  job.seq = 8192;
  job.global_batch = 64;
  job.tokens = 1e9;
  const PlanContext ctx = make_context(c, job);
  Cluster cl = make_cluster(gpu_spec("h100-sxm"), 8, 8);
  Layout l;
  l.tp = 8;
  l.dp = 1;
  l.sequence_parallel = true;
  l.recompute = Recompute::none;
  const Estimate none = evaluate(ctx, cl, job, l);
  EXPECT_EQ(none.hardware_flops_per_step, none.model_flops_per_step);
  l.recompute = Recompute::selective;
  const Estimate sel = evaluate(ctx, cl, job, l);
  const double tokens = 64.0 * 8192;
  EXPECT_NEAR(sel.hardware_flops_per_step - sel.model_flops_per_step,
              32 * 4.0 * 8192 * 4096 * tokens, 1e-6 * sel.model_flops_per_step);
  l.recompute = Recompute::full;
  const Estimate full = evaluate(ctx, cl, job, l);
  EXPECT_NEAR(full.hardware_flops_per_step - full.model_flops_per_step,
              32 * ctx.layer_flops_per_token / 3 * tokens, 1e-6 * full.model_flops_per_step);
  EXPECT_GT(full.step_seconds, sel.step_seconds);
  EXPECT_GT(sel.step_seconds, none.step_seconds);
  EXPECT_LT(full.memory.activations, sel.memory.activations);
  EXPECT_LT(sel.memory.activations, none.memory.activations);
}

TEST(Catalog, PublishedPeaksAndMemory) {
  EXPECT_EQ(gpu_spec("a100-40gb").peak_flops, 312e12);
  EXPECT_EQ(gpu_spec("a100-80gb").peak_flops, 312e12);
  EXPECT_EQ(gpu_spec("h100-sxm").peak_flops, 989.4e12);
  EXPECT_EQ(gpu_spec("h200").peak_flops, 989.4e12);
  EXPECT_EQ(gpu_spec("a100-40gb").hbm_bytes, 40960.0 * 1024 * 1024);
  EXPECT_EQ(gpu_spec("a100-80gb").hbm_bytes, 81920.0 * 1024 * 1024);
  EXPECT_EQ(gpu_spec("h100-sxm").hbm_bytes, 81559.0 * 1024 * 1024);
  EXPECT_EQ(gpu_spec("h200").hbm_bytes, 143771.0 * 1024 * 1024);  // "141 GB"
  EXPECT_EQ(gpu_spec("h100-sxm").hbm_bandwidth, 3.35e12);
  EXPECT_EQ(gpu_spec("h200").hbm_bandwidth, 4.8e12);
  EXPECT_EQ(gpu_spec("a100-80gb").hbm_bandwidth, 2.039e12);
  EXPECT_EQ(gpu_spec("h100-sxm").nvlink_bandwidth, 450e9);  // 900 GB/s both directions
  try {
    gpu_spec("h300");
    FAIL();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "plan: unknown GPU 'h300' (known: a100-40gb, a100-80gb, h100-sxm, h800, h200)");
  }
}

TEST(Collectives, NcclTestsBusBandwidthFactors) {
  const Link link{100e9, 0};
  const double bytes = 1e9;
  EXPECT_DOUBLE_EQ(all_reduce_seconds(bytes, 8, link), 2.0 * 7 / 8 * bytes / 100e9);
  EXPECT_DOUBLE_EQ(reduce_scatter_seconds(bytes, 8, link), 7.0 / 8 * bytes / 100e9);
  EXPECT_DOUBLE_EQ(all_gather_seconds(bytes, 8, link), 7.0 / 8 * bytes / 100e9);
  EXPECT_DOUBLE_EQ(send_recv_seconds(bytes, link), bytes / 100e9);
  EXPECT_EQ(all_reduce_seconds(bytes, 1, link), 0);
  const Link slow{100e9, 1e-5};
  // Latency: min(ring 2(n-1), tree 2 log2 n) steps; reduce-scatter is a ring.
  EXPECT_DOUBLE_EQ(all_reduce_seconds(0, 2, slow), 2e-5);
  EXPECT_DOUBLE_EQ(all_reduce_seconds(0, 1024, slow), 20e-5);
  EXPECT_DOUBLE_EQ(reduce_scatter_seconds(0, 4, slow), 3e-5);
}

TEST(Inputs, Counts) {
  EXPECT_EQ(parse_count("15T", "--tokens"), 15e12);
  EXPECT_EQ(parse_count("1.5e12", "--tokens"), 1.5e12);
  EXPECT_EQ(parse_count("300B", "--tokens"), 300e9);
  EXPECT_EQ(parse_count("8Ki", "--x"), 8192);
  EXPECT_EQ(parse_count("42", "--x"), 42);
  EXPECT_THROW(parse_count("abc", "--tokens"), Error);
  EXPECT_THROW(parse_count("-5", "--tokens"), Error);
  EXPECT_THROW(parse_count("16X", "--tokens"), Error);
  EXPECT_THROW(parse_count("", "--tokens"), Error);
}

TEST(Inputs, GlobalBatchTokens) {
  const GlobalBatch binary = parse_global_batch_tokens("16M", 8192);
  EXPECT_EQ(binary.sequences, 2048);
  EXPECT_NE(binary.note.find("16777216"), std::string::npos);
  const GlobalBatch decimal = parse_global_batch_tokens("4M", 1000);
  EXPECT_EQ(decimal.sequences, 4000);
  EXPECT_TRUE(decimal.note.empty());
  EXPECT_EQ(parse_global_batch_tokens("4Mi", 4096).sequences, 1024);
  try {
    parse_global_batch_tokens("1000", 3);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("not a whole number of 3-token sequences"),
              std::string::npos);
  }
  EXPECT_THROW(parse_global_batch_tokens("100", 8192), Error);  // less than one sequence
}


TEST(Inputs, OptionNamesRoundTrip) {
  for (Recompute r : {Recompute::none, Recompute::selective, Recompute::full}) {
    EXPECT_EQ(parse_recompute(recompute_name(r)), r);
  }
  for (Schedule s : {Schedule::gpipe, Schedule::one_f_one_b, Schedule::interleaved}) {
    EXPECT_EQ(parse_schedule(schedule_name(s)), s);
  }
  EXPECT_EQ(schedule_name(Schedule::one_f_one_b), "1f1b");
  EXPECT_EQ(parse_offload("optimizer"), Offload::optimizer);
  EXPECT_EQ(parse_optimizer("sgd"), Optimizer::sgd);
  try {
    parse_recompute("some");
    FAIL();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "unknown recompute 'some' (expected none, selective, full)");
  }
}

}  // namespace
}  // namespace meshtrain::plan
