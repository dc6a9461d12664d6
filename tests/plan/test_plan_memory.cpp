// Memory formulas: ZeRO's model states, DeepSpeed's estimator example,
// Korthikanti et al.'s activation table, pipeline in-flight counts, and the
// CPU engine's own allocations against its MemoryTracker.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "meshtrain/backend/cpu/cpu_backend.h"
#include "meshtrain/model/model.h"
#include "meshtrain/optim/adamw.h"
#include "meshtrain/util/error.h"
#include "meshtrain/plan/memory.h"
#include "meshtrain/plan/models.h"
#include "meshtrain/tensor/memory_tracker.h"

namespace meshtrain::plan {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

TEST(ZeroFormulas, MixedPrecisionAdamMatchesThePaperExactly) {
  const StateBytes adam = state_bytes(Precision::bf16, Optimizer::adamw);
  ASSERT_EQ(adam.weights, 2);
  ASSERT_EQ(adam.grads, 2);
  ASSERT_EQ(adam.optimizer, 12);
  for (double psi : {1.0e9, 7.5e9, 70.6e9}) {
    for (int64_t n : {1, 8, 64, 1024}) {
      const double N = static_cast<double>(n);
      EXPECT_EQ(model_state_memory(psi, adam, 0, n).total(), 16 * psi);
      EXPECT_EQ(model_state_memory(psi, adam, 1, n).total(), 4 * psi + 12 * psi / N);
      EXPECT_EQ(model_state_memory(psi, adam, 2, n).total(), 2 * psi + 14 * psi / N);
      EXPECT_EQ(model_state_memory(psi, adam, 3, n).total(), 16 * psi / N);
    }
  }
}

TEST(ZeroFormulas, PaperFigureOneNumbers) {
  // Rajbhandari et al. 2020, figure 1: 7.5B parameters, N_d = 64, K = 12 (GB = 1e9 bytes).
  const StateBytes adam = state_bytes(Precision::bf16, Optimizer::adamw);
  EXPECT_NEAR(model_state_memory(7.5e9, adam, 0, 64).total() / 1e9, 120, 0.05);
  EXPECT_NEAR(model_state_memory(7.5e9, adam, 1, 64).total() / 1e9, 31.4, 0.05);
  EXPECT_NEAR(model_state_memory(7.5e9, adam, 2, 64).total() / 1e9, 16.6, 0.05);
  EXPECT_NEAR(model_state_memory(7.5e9, adam, 3, 64).total() / 1e9, 1.9, 0.05);
}

TEST(ZeroFormulas, ShardsOnlyWhatEachStageShards) {
  const StateBytes adam = state_bytes(Precision::bf16, Optimizer::adamw);
  const ModelStates z1 = model_state_memory(1e9, adam, 1, 4);
  EXPECT_EQ(z1.params, 2e9);
  EXPECT_EQ(z1.grads, 2e9);
  EXPECT_EQ(z1.optimizer, 3e9);
  const ModelStates z2 = model_state_memory(1e9, adam, 2, 4);
  EXPECT_EQ(z2.grads, 0.5e9);
  EXPECT_EQ(z2.params, 2e9);
  EXPECT_THROW(model_state_memory(1e9, adam, 4, 4), Error);
  EXPECT_THROW(model_state_memory(1e9, adam, 1, 0), Error);
  const StateBytes fp32 = state_bytes(Precision::fp32, Optimizer::adamw);
  EXPECT_EQ(model_state_memory(1.0, fp32, 0, 1).total(), 16);  // 4 + 4 + 8, no master copy
  EXPECT_EQ(state_bytes(Precision::bf16, Optimizer::sgd).optimizer, 8);
}

TEST(DeepSpeedEstimator, T5ThreeBillionExampleWithinOnePercent) {
  // DeepSpeed "Memory Requirements": t5-3b, 2851M params, largest layer 32M,
  // 1 node x 8 GPUs, no offload: ZeRO-2 15.93 GB, ZeRO-3 6.09 GB per GPU (GiB).
  EXPECT_NEAR(deepspeed_zero2_gpu_bytes(2851e6, 8, 1) / kGiB, 15.93, 15.93 * 0.01);
  EXPECT_NEAR(deepspeed_zero3_gpu_bytes(2851e6, 32e6, 8, 1) / kGiB, 6.09, 6.09 * 0.01);
}

// GPT-3 175B (the paper's running example): s 2048, h 12288, a 96, dropout.
ActivationShape gpt3(int64_t tp, bool sp, Recompute rc) {
  ActivationShape x;
  x.model = gpt_dense(96, 12288, 96, 51200, 2048);
  x.seq = 2048;
  x.micro_batch = 1;
  x.tp = tp;
  x.sequence_parallel = sp;
  x.recompute = rc;
  x.dropout = true;
  x.value_bytes = 2;
  return x;
}

TEST(Activations, KorthikantiTableTwo) {
  const double s = 2048, b = 1, h = 12288, a = 96, t = 8, sbh = s * b * h;
  auto near = [](double got, double want) { EXPECT_NEAR(got / want, 1.0, 1e-12) << got; };
  near(layer_activation_bytes(gpt3(1, false, Recompute::none)), sbh * (34 + 5 * a * s / h));
  near(layer_activation_bytes(gpt3(8, false, Recompute::none)),
       sbh * (10 + 24 / t + 5 * a * s / (h * t)));
  near(layer_activation_bytes(gpt3(8, true, Recompute::none)),
       sbh * (34 / t + 5 * a * s / (h * t)));
  near(layer_activation_bytes(gpt3(8, false, Recompute::selective)), sbh * (10 + 24 / t));
  near(layer_activation_bytes(gpt3(8, true, Recompute::selective)), sbh * 34 / t);
  near(layer_activation_bytes(gpt3(8, false, Recompute::full)), 2 * sbh);
  near(layer_activation_bytes(gpt3(8, true, Recompute::full)), 2 * sbh / t);
}

TEST(Activations, LlamaHandComputed) {
  // Llama-3 70B, s 8192, b 2, tp 8, SP, no dropout:
  // whole 8sbh / t; split (4sbh + 4 sb kv + 6 sbf) / t with kv = 1024, f = 28672,
  // of which selective recomputation keeps gate|up (4sbf) and recomputes their
  // product; core without recomputation 2 a s^2 b / t.
  ActivationShape x;
  x.model = plan_model("llama3-70b").config;
  x.seq = 8192;
  x.micro_batch = 2;
  x.tp = 8;
  x.sequence_parallel = true;
  x.recompute = Recompute::selective;
  const double s = 8192, b = 2, h = 8192, kv = 1024, f = 28672, a = 64, t = 8;
  const double selective = (8 * s * b * h + 4 * s * b * h + 4 * s * b * kv + 4 * s * b * f) / t;
  const double none = selective + 2 * s * b * f / t + 2 * a * s * s * b / t;
  EXPECT_DOUBLE_EQ(layer_activation_bytes(x), selective);
  x.recompute = Recompute::none;
  EXPECT_DOUBLE_EQ(layer_activation_bytes(x), none);
  x.value_bytes = 4;  // fp32 activations: twice the values
  EXPECT_DOUBLE_EQ(layer_activation_bytes(x), 2 * none);
  // Context parallelism: each of cp ranks keeps seq / cp positions; the core
  // is its queries against all keys.
  x.value_bytes = 2;
  x.cp = 4;
  EXPECT_DOUBLE_EQ(layer_activation_bytes(x), none / 4);
  x.recompute = Recompute::selective;
  EXPECT_DOUBLE_EQ(layer_activation_bytes(x), selective / 4);
}

TEST(Activations, StageEnds) {
  ActivationShape x = gpt3(8, true, Recompute::selective);
  const double s = 2048, h = 12288, v = 51200, t = 8;
  EXPECT_DOUBLE_EQ(first_stage_activation_bytes(x), s * h / t);  // dropout mask
  EXPECT_DOUBLE_EQ(last_stage_activation_bytes(x), 4 * s * h / t + 4 * s * v / t);
  x.dropout = false;
  EXPECT_EQ(first_stage_activation_bytes(x), 0);
}

TEST(Pipeline, InflightMicrobatches) {
  EXPECT_EQ(inflight_microbatches(Schedule::one_f_one_b, 4, 1, 8, 0), 4);
  EXPECT_EQ(inflight_microbatches(Schedule::one_f_one_b, 4, 1, 8, 3), 1);
  EXPECT_EQ(inflight_microbatches(Schedule::one_f_one_b, 4, 1, 2, 0), 2);  // m < p
  EXPECT_EQ(inflight_microbatches(Schedule::gpipe, 4, 1, 8, 0), 8);
  EXPECT_EQ(inflight_microbatches(Schedule::gpipe, 4, 1, 8, 3), 8);
  // Interleaved, stage 0: p (1 + (p - 1)/(p v)) (Korthikanti et al. 4.2.3).
  for (int64_t p : {2, 4, 8}) {
    for (int64_t v : {2, 3, 5}) {
      const double want = static_cast<double>(p) *
                          (1 + static_cast<double>(p - 1) / static_cast<double>(p * v));
      EXPECT_DOUBLE_EQ(inflight_microbatches(Schedule::interleaved, p, v, 64, 0), want);
    }
  }
  EXPECT_DOUBLE_EQ(inflight_microbatches(Schedule::interleaved, 4, 2, 8, 3), 5.0 / 2);
  EXPECT_THROW(inflight_microbatches(Schedule::one_f_one_b, 4, 1, 8, 4), Error);
}

TEST(Pipeline, BubbleFraction) {
  EXPECT_DOUBLE_EQ(bubble_fraction(1, 1, 16), 0);
  EXPECT_DOUBLE_EQ(bubble_fraction(8, 1, 64), 7.0 / 64);
  EXPECT_DOUBLE_EQ(bubble_fraction(8, 4, 64), 7.0 / 256);
  EXPECT_DOUBLE_EQ(bubble_fraction(4, 1, 4), 0.75);
}

TEST(Categories, SameNamesAsTheEngineTracker) {
  MemoryBreakdown m;
  m.params = 1;
  m.grads = 2;
  m.optimizer = 3;
  m.activations = 4;
  m.workspace = 5;
  m.comm = 6;
  m.offloaded = 7;
  m.fragmentation = 8;
  const auto cats = categories(m);
  ASSERT_EQ(cats.size(), kMemCategories + 1);
  for (size_t i = 0; i < kMemCategories; ++i) {
    EXPECT_EQ(cats[i].first, mem_category_name(static_cast<MemCategory>(i)));
    EXPECT_EQ(cats[i].second, static_cast<double>(i + 1));
  }
  EXPECT_EQ(cats.back().first, "fragmentation");
  EXPECT_EQ(m.tracked(), 21);
  EXPECT_EQ(m.device_total(), 29);  // offloaded is host memory
}

// The engine's predicted bytes equal what its MemoryTracker sees after one
// forward/backward and an optimizer (params, grads, optimizer, activations).
void expect_engine_matches(const ModelConfig& config, Precision precision, int64_t batch,
                           int64_t seq, const RecomputePolicy& recompute = {}) {
  SCOPED_TRACE(std::string(recompute_name(recompute.mode)) + " " +
               std::to_string(recompute.layers));
  MemoryTracker tracker;
  cpu::CpuBackend ctx(1, tracker);
  Model model(config, precision, ctx);
  model.set_recompute(recompute);
  model.init_weights(7);
  AdamW adamw(model, AdamWConfig{});
  std::mt19937 rng(3);
  std::vector<int32_t> tokens(static_cast<size_t>(batch * seq)), targets(tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = static_cast<int32_t>(rng() % static_cast<uint32_t>(config.vocab_size));
    targets[i] = static_cast<int32_t>(rng() % static_cast<uint32_t>(config.vocab_size));
  }
  model.zero_grads();
  model.forward_backward(tokens.data(), targets.data(), batch, seq, 1.0f);
  const MemoryBreakdown want = engine_memory(config, precision, batch, seq, recompute);
  EXPECT_EQ(static_cast<double>(tracker.live(MemCategory::params)), want.params);
  EXPECT_EQ(static_cast<double>(tracker.live(MemCategory::grads)), want.grads);
  EXPECT_EQ(static_cast<double>(tracker.live(MemCategory::optimizer)), want.optimizer);
  EXPECT_EQ(static_cast<double>(tracker.live(MemCategory::activations)), want.activations);
  // Workspace is an estimate (kernels' scratch comes and goes): within 2x of the peak.
  const double ws = static_cast<double>(tracker.peak(MemCategory::workspace));
  EXPECT_GT(want.workspace, 0.5 * ws) << "peak " << ws;
  EXPECT_LT(want.workspace, 2.0 * ws) << "peak " << ws;
}

TEST(EngineMemory, LlamaMatchesTheTracker) {
  ModelConfig c = model_preset("llama-tiny");
  expect_engine_matches(c, Precision::bf16, 2, 32);
  expect_engine_matches(c, Precision::fp32, 1, 16);
  expect_engine_matches(c, Precision::fp16, 2, 32);  // f16 compute copies: as bf16's
  c.tie_embeddings = true;
  expect_engine_matches(c, Precision::bf16, 2, 24);
}

TEST(EngineMemory, Gpt2MatchesTheTracker) {
  ModelConfig c = gpt_dense(2, 64, 4, 300, 64);
  expect_engine_matches(c, Precision::bf16, 2, 32);
  expect_engine_matches(c, Precision::fp32, 1, 64);
}

// Activation checkpointing: the activations each mode keeps (and the one
// shared set it recomputes into) are predicted exactly.
TEST(EngineMemory, RecomputeMatchesTheTracker) {
  ModelConfig llama = model_preset("llama-tiny");
  llama.n_layers = 4;
  const ModelConfig gpt2 = gpt_dense(3, 64, 4, 300, 64);
  for (const RecomputePolicy& r : {RecomputePolicy{Recompute::selective, 0},
                                   RecomputePolicy{Recompute::full, 0},
                                   RecomputePolicy{Recompute::full, 2}}) {
    expect_engine_matches(llama, Precision::bf16, 2, 32, r);
    expect_engine_matches(llama, Precision::fp32, 1, 16, r);
    expect_engine_matches(gpt2, Precision::bf16, 2, 32, r);
  }
}

TEST(EngineMemory, RejectsBadShapes) {
  EXPECT_THROW(engine_memory(model_preset("llama-tiny"), Precision::bf16, 0, 16), Error);
  EXPECT_THROW(engine_memory(model_preset("llama-tiny"), Precision::bf16, 1, 100000), Error);
}

}  // namespace
}  // namespace meshtrain::plan
