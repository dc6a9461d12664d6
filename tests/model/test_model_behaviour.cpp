// Model behaviour beyond the math: consistency between the passes, decoding,
// determinism, bf16 and fp16, complete unit gradients and memory accounting.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "meshtrain/backend/cpu/cpu_backend.h"
#include "meshtrain/model/model.h"
#include "meshtrain/util/error.h"
#include "support/tiny_models.h"

namespace meshtrain {
namespace {

// The families, and the llama recipe with today's attention options: Qwen's
// q/k/v biases with per-head QK-norm at a head width of its own, and OLMoE's
// QK-norm over the whole projection.
std::vector<ModelConfig> configs() {
  ModelConfig qwen = testing::tiny_llama(false);
  qwen.qkv_bias = true;
  qwen.qk_norm = QkNorm::head;
  qwen.head_width = 6;
  ModelConfig olmoe = testing::tiny_llama(true);
  olmoe.qk_norm = QkNorm::full;
  ModelConfig mistral = testing::tiny_llama(false);
  mistral.sliding_window = 4;  // decoding past it reads only the cache's last 4 positions
  return {testing::tiny_llama(false), testing::tiny_llama(true), testing::tiny_gpt2(), qwen, olmoe,
          mistral};
}

std::vector<float> grads_of(Model& model) {
  const float* g = model.flat_grad().data<float>();
  return std::vector<float>(g, g + model.num_params());
}

struct LossAndGrads {
  double loss;
  std::vector<float> grads;
};

// A fresh model initialised from `init_seed`: its loss and gradients, scaled by
// 1/n, on a B x T batch of tokens and targets drawn from `ids_seed` and `ids_seed + 1`.
LossAndGrads loss_and_grads(const ModelConfig& c, Precision prec, uint64_t init_seed,
                            uint64_t ids_seed, int64_t B, int64_t T) {
  testing::CpuModel m(c, prec);
  m.model.init_weights(init_seed);
  const int64_t n = B * T;
  auto tokens = testing::random_ids(ids_seed, n, c.vocab_size);
  auto targets = testing::random_ids(ids_seed + 1, n, c.vocab_size);
  m.model.zero_grads();
  const double loss = m.model.forward_backward(tokens.data(), targets.data(), B, T, 1.0f / n);
  return {loss, grads_of(m.model)};
}

double cross_entropy(const std::vector<float>& logits, const std::vector<int32_t>& targets,
                     int64_t vocab) {
  double total = 0;
  for (size_t r = 0; r < targets.size(); ++r) {
    const float* row = logits.data() + r * static_cast<size_t>(vocab);
    double mx = row[0], sum = 0;
    for (int64_t v = 0; v < vocab; ++v) mx = std::max(mx, double(row[v]));
    for (int64_t v = 0; v < vocab; ++v) sum += std::exp(row[v] - mx);
    total += std::log(sum) + mx - row[targets[r]];
  }
  return total;
}

TEST(ModelPasses, LossesAgreeAcrossForwardBackwardLossAndLogits) {
  for (const ModelConfig& c : configs()) {
    for (Precision prec : {Precision::fp32, Precision::bf16, Precision::fp16}) {
      SCOPED_TRACE(std::string(family_name(c.family)) + " " + std::string(precision_name(prec)));
      testing::CpuModel m(c, prec);
      Model& model = m.model;
      testing::init_for_test(model, 1);
      const int64_t B = 3, T = 9, n = B * T, V = c.vocab_size;
      auto tokens = testing::random_ids(3, n, V), targets = testing::random_ids(4, n, V);
      const double train_loss = model.forward_backward(tokens.data(), targets.data(), B, T, 1.0f);
      const double eval_loss = model.forward_loss(tokens.data(), targets.data(), B, T);
      EXPECT_NEAR(train_loss, eval_loss, 1e-6 * eval_loss);
      std::vector<float> logits(static_cast<size_t>(n * V));
      model.forward_logits(tokens.data(), B, T, logits.data());
      const double tol = prec == Precision::fp32 ? 1e-5 : 1e-3;
      EXPECT_NEAR(cross_entropy(logits, targets, V), eval_loss, tol * eval_loss);
    }
  }
}

TEST(ModelPasses, DecodeTokenByTokenEqualsFullForward) {
  for (const ModelConfig& c : configs()) {
    SCOPED_TRACE(fmt::format("{} window {}", family_name(c.family), c.sliding_window));
    testing::CpuModel m(c, Precision::fp32);
    Model& model = m.model;
    testing::init_for_test(model, 9);
    const int64_t B = 2, T = 10, V = c.vocab_size;
    auto tokens = testing::random_ids(5, B * T, V);
    std::vector<float> full(static_cast<size_t>(B * T * V));
    model.forward_logits(tokens.data(), B, T, full.data());

    // A 3-token prompt in one call, then one token at a time.
    KVCache cache = model.make_kv_cache(B, T);
    std::vector<float> last(static_cast<size_t>(B * V));
    int64_t pos = 0;
    while (pos < T) {
      const int64_t step = pos == 0 ? 3 : 1;
      std::vector<int32_t> chunk;
      for (int64_t b = 0; b < B; ++b)
        for (int64_t t = pos; t < pos + step; ++t) chunk.push_back(tokens[b * T + t]);
      model.decode(chunk.data(), B, step, cache, last.data());
      pos += step;
      EXPECT_EQ(cache.length, pos);
      for (int64_t b = 0; b < B; ++b)
        for (int64_t v = 0; v < V; ++v) {
          const float want = full[((b * T) + pos - 1) * V + v];
          ASSERT_NEAR(last[b * V + v], want, 1e-5 * (1 + std::abs(want)))
              << "batch " << b << " position " << pos - 1 << " token " << v;
        }
    }
    EXPECT_THROW(model.decode(tokens.data(), B, 1, cache, last.data()), Error);  // cache full

    // A bf16 model decodes in f32 on its master weights: the fp32 logits.
    Model half(c, Precision::bf16, m.ctx);
    testing::init_for_test(half, 9);
    KVCache half_cache = half.make_kv_cache(1, T);
    half.decode(tokens.data(), 1, T, half_cache, last.data());
    for (int64_t v = 0; v < V; ++v) {
      const float want = full[(T - 1) * V + v];
      ASSERT_NEAR(last[v], want, 1e-5 * (1 + std::abs(want))) << "bf16 model, token " << v;
    }
  }
}

TEST(ModelPasses, ChangingBatchShapeLeavesNoStaleState) {
  for (const ModelConfig& c : configs()) {
    SCOPED_TRACE(family_name(c.family));
    MemoryTracker tracker;
    cpu::CpuBackend ctx(2, tracker);
    auto tokens = testing::random_ids(14, 32, c.vocab_size), targets = testing::random_ids(15, 32, c.vocab_size);
    Model used(c, Precision::bf16, ctx), fresh(c, Precision::bf16, ctx);
    used.init_weights(4);
    fresh.init_weights(4);
    used.forward_backward(tokens.data(), targets.data(), 2, 8, 1.0f);
    used.forward_loss(tokens.data(), targets.data(), 4, 8);
    used.zero_grads();
    const double a = used.forward_backward(tokens.data(), targets.data(), 3, 5, 1.0f);
    const double b = fresh.forward_backward(tokens.data(), targets.data(), 3, 5, 1.0f);
    EXPECT_EQ(a, b);
    EXPECT_EQ(grads_of(used), grads_of(fresh));
  }
}

// At initialisation (std 0.02) the logits are nearly uniform: loss ~ ln(vocab).
TEST(ModelPasses, SmallPresetsStartNearUniform) {
  for (const char* name : {"llama-tiny", "stories260K"}) {
    SCOPED_TRACE(name);
    const ModelConfig c = model_preset(name);
    testing::CpuModel m(c, Precision::bf16);
    Model& model = m.model;
    EXPECT_EQ(model.num_params(), c.num_params());
    model.init_weights(1);
    const int64_t B = 2, T = 32, n = B * T;
    auto tokens = testing::random_ids(16, n, c.vocab_size), targets = testing::random_ids(17, n, c.vocab_size);
    const double loss = model.forward_backward(tokens.data(), targets.data(), B, T, 1.0f / n) / n;
    EXPECT_NEAR(loss, std::log(static_cast<double>(c.vocab_size)), 0.05);
  }
}

TEST(ModelPasses, GradientsAccumulateAndIgnoredTargetsContributeNothing) {
  const ModelConfig c = testing::tiny_llama(false);
  testing::CpuModel m(c, Precision::fp32);
  Model& model = m.model;
  testing::init_for_test(model, 2);
  const int64_t B = 2, T = 6, n = B * T;
  auto tokens = testing::random_ids(6, n, c.vocab_size), targets = testing::random_ids(7, n, c.vocab_size);
  model.zero_grads();
  model.forward_backward(tokens.data(), targets.data(), B, T, 1.0f);
  const std::vector<float> once = grads_of(model);
  model.zero_grads();
  model.forward_backward(tokens.data(), targets.data(), B, T, 0.5f);
  model.forward_backward(tokens.data(), targets.data(), B, T, 0.5f);
  const std::vector<float> twice = grads_of(model);
  for (size_t i = 0; i < once.size(); ++i) ASSERT_NEAR(twice[i], once[i], 1e-6 + 1e-5 * std::abs(once[i]));

  // All targets ignored: zero loss, zero gradient.
  std::vector<int32_t> none(static_cast<size_t>(n), -1);
  model.zero_grads();
  EXPECT_EQ(model.forward_backward(tokens.data(), none.data(), B, T, 1.0f), 0.0);
  for (float g : grads_of(model)) ASSERT_EQ(g, 0.0f);
}

TEST(ModelPasses, TwoRunsGiveBitIdenticalGradients) {
  for (const ModelConfig& c : configs()) {
    for (Precision prec : {Precision::fp32, Precision::bf16, Precision::fp16}) {
      const LossAndGrads a = loss_and_grads(c, prec, 17, 8, 2, 8);
      const LossAndGrads b = loss_and_grads(c, prec, 17, 8, 2, 8);
      EXPECT_EQ(a.loss, b.loss);
      EXPECT_EQ(0, std::memcmp(a.grads.data(), b.grads.data(), a.grads.size() * sizeof(float)))
          << family_name(c.family) << " " << precision_name(prec);
    }
  }
}

// bf16 / fp16 compute with f32 master weights stays close to fp32: the loss
// within 1% and the gradient direction within cosine 0.99 (fp16, with 3 more
// mantissa bits: 0.1% and 0.999).
TEST(ModelPasses, Bf16AndFp16AreCloseToFp32) {
  for (const ModelConfig& base : configs()) {
    for (Precision prec : {Precision::bf16, Precision::fp16}) {
      SCOPED_TRACE(std::string(family_name(base.family)) + " " + std::string(precision_name(prec)));
      const double loss_tol = prec == Precision::bf16 ? 1e-2 : 1e-3;
      const double min_cosine = prec == Precision::bf16 ? 0.99 : 0.999;
      ModelConfig c = base;
      c.init_std = 0.1f;
      const LossAndGrads full = loss_and_grads(c, Precision::fp32, 23, 10, 2, 12);
      const LossAndGrads half = loss_and_grads(c, prec, 23, 10, 2, 12);
      EXPECT_NEAR(half.loss, full.loss, loss_tol * full.loss);
      double dot = 0, a2 = 0, b2 = 0;
      for (size_t i = 0; i < full.grads.size(); ++i) {
        dot += double(full.grads[i]) * half.grads[i];
        a2 += double(full.grads[i]) * full.grads[i];
        b2 += double(half.grads[i]) * half.grads[i];
      }
      EXPECT_GT(dot / std::sqrt(a2 * b2), min_cosine);
    }
  }
}

// A unit's gradients reported complete by after(u, backward) do not change
// afterwards in the same pass (what data parallelism relies on).
TEST(ModelPasses, UnitGradientsAreCompleteAtAfterBackward) {
  for (const ModelConfig& c : configs()) {
    SCOPED_TRACE(family_name(c.family));
    testing::CpuModel m(c, Precision::bf16);
    Model& model = m.model;
    model.init_weights(1);
    const int64_t B = 2, T = 5, n = B * T;
    auto tokens = testing::random_ids(12, n, c.vocab_size), targets = testing::random_ids(13, n, c.vocab_size);
    model.forward_backward(tokens.data(), targets.data(), B, T, 1.0f);  // non-zero grads before
    std::vector<std::vector<float>> at_done(model.units().size());
    size_t done = 0;
    model.unit_hooks.after = [&](size_t u, UnitPass pass) {
      if (pass != UnitPass::backward) return;
      const ParamUnit& unit = model.units()[u];
      const float* g = model.params()[unit.first_param].grad.data<float>();
      const int64_t end = unit.end_param < model.params().size()
                              ? model.params()[unit.end_param].offset
                              : model.num_params();
      at_done[u].assign(g, g + (end - model.params()[unit.first_param].offset));
      ++done;
    };
    model.forward_backward(tokens.data(), targets.data(), B, T, 1.0f);
    EXPECT_EQ(done, model.units().size());
    for (size_t u = 0; u < at_done.size(); ++u) {
      const float* g = model.params()[model.units()[u].first_param].grad.data<float>();
      EXPECT_EQ(std::memcmp(at_done[u].data(), g, at_done[u].size() * sizeof(float)), 0)
          << model.units()[u].name;
    }
  }
}

TEST(ModelPasses, MemoryTrackerSeesParamsGradsAndActivations) {
  for (Precision prec : {Precision::fp32, Precision::bf16, Precision::fp16}) {
    const ModelConfig c = testing::tiny_llama(false);
    testing::CpuModel m(c, prec);
    Model& model = m.model;
    const MemoryTracker& tracker = m.tracker;
    model.init_weights(1);
    int64_t matmul_numel = 0;
    for (const Parameter& p : model.params()) matmul_numel += p.spec.matmul_weight ? p.spec.numel() : 0;
    const size_t n = static_cast<size_t>(model.num_params());
    const size_t compute = prec != Precision::fp32 ? 2 * static_cast<size_t>(matmul_numel) : 0;
    EXPECT_GE(tracker.live(MemCategory::params), 4 * n + compute);
    EXPECT_LT(tracker.live(MemCategory::params), 4 * n + compute + (1 << 16));  // + rope table
    EXPECT_EQ(tracker.live(MemCategory::grads), 4 * n);
    EXPECT_EQ(tracker.live(MemCategory::activations), 0u);

    const int64_t B = 2, T = 16, rows = B * T;
    auto tokens = testing::random_ids(1, rows, c.vocab_size), targets = testing::random_ids(2, rows, c.vocab_size);
    model.forward_backward(tokens.data(), targets.data(), B, T, 1.0f);
    // At least the residual stream of every layer plus the attention probabilities.
    const size_t probs = static_cast<size_t>(B * c.n_heads * T * T) * dtype_size(compute_dtype(prec));
    const size_t floor = static_cast<size_t>(c.n_layers) * (4 * rows * c.dim + probs);
    EXPECT_GE(tracker.live(MemCategory::activations), floor);
    EXPECT_GT(tracker.peak(MemCategory::workspace), 0u);
  }
}

TEST(ModelPasses, RejectsBadInput) {
  const ModelConfig c = testing::tiny_llama(false);
  testing::CpuModel m(c, Precision::fp32, 1);
  Model& model = m.model;
  model.init_weights(1);
  std::vector<int32_t> tokens(8, 1), targets(8, 2);
  tokens[5] = static_cast<int32_t>(c.vocab_size);
  EXPECT_THROW(model.forward_backward(tokens.data(), targets.data(), 2, 4, 1.0f), Error);
  tokens[5] = -1;
  EXPECT_THROW(model.forward_loss(tokens.data(), targets.data(), 2, 4), Error);
  tokens[5] = 1;
  targets[2] = 999;
  EXPECT_THROW(model.forward_loss(tokens.data(), targets.data(), 2, 4), Error);
  std::vector<int32_t> long_seq(static_cast<size_t>(c.max_seq_len + 1), 1);
  EXPECT_THROW(model.forward_loss(long_seq.data(), long_seq.data(), 1, c.max_seq_len + 1), Error);
  EXPECT_THROW(model.make_kv_cache(1, c.max_seq_len + 1), Error);
  ModelConfig bad = c;
  bad.n_heads = 5;
  EXPECT_THROW(Model(bad, Precision::fp32, m.ctx), Error);
}

}  // namespace
}  // namespace meshtrain
