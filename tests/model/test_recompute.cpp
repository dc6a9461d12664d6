// Activation checkpointing (model.h RecomputePolicy): every policy gives the
// gradients and losses of `none` bit for bit, through forward_backward and
// through stage passes with several micro-batches in flight, while the
// activation memory the tracker sees drops.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "meshtrain/model/model.h"
#include "meshtrain/util/error.h"
#include "support/tiny_models.h"

namespace meshtrain {
namespace {

struct Policy {
  RecomputePolicy policy;
  const char* name;
};

std::vector<Policy> policies() {
  return {{{Recompute::none, 0}, "none"},
          {{Recompute::selective, 0}, "selective"},
          {{Recompute::full, 0}, "full"},
          {{Recompute::full, 2}, "full 2 layers"}};
}

// 4 layers so that recomputing 2 of them is a real subset.
std::vector<ModelConfig> configs() {
  std::vector<ModelConfig> out{testing::tiny_llama(false), testing::tiny_llama(true),
                               testing::tiny_gpt2()};
  for (ModelConfig& c : out) c.n_layers = 4;
  return out;
}

struct Result {
  std::vector<double> losses;
  std::vector<float> grads;
  size_t activation_peak = 0, activation_live = 0;
};

std::vector<float> grads_of(Model& model) {
  const float* g = model.flat_grad().data<float>();
  return std::vector<float>(g, g + model.num_params());
}

constexpr int64_t kBatch = 2, kSeq = 16;

// Two accumulated micro-batches through forward_backward, then (stages) two
// micro-batches in flight through stage_forward / stage_backward.
Result run(const ModelConfig& c, Precision precision, const RecomputePolicy& policy,
           bool stages) {
  testing::CpuModel m(c, precision);
  testing::init_for_test(m.model, 5);
  m.model.set_recompute(policy);
  const int64_t n = kBatch * kSeq;
  Result r;
  m.model.zero_grads();
  for (uint64_t mb = 0; mb < 2; ++mb) {
    const auto tokens = testing::random_ids(10 + mb, n, c.vocab_size);
    const auto targets = testing::random_ids(20 + mb, n, c.vocab_size);
    if (!stages) {
      r.losses.push_back(
          m.model.forward_backward(tokens.data(), targets.data(), kBatch, kSeq, 0.5f / n));
      continue;
    }
    m.model.stage_forward(0, static_cast<int64_t>(mb), tokens.data(), nullptr, kBatch, kSeq,
                          nullptr);
  }
  for (uint64_t mb = 0; stages && mb < 2; ++mb) {
    const auto tokens = testing::random_ids(10 + mb, n, c.vocab_size);
    const auto targets = testing::random_ids(20 + mb, n, c.vocab_size);
    r.losses.push_back(m.model.stage_backward(0, static_cast<int64_t>(mb), tokens.data(),
                                              targets.data(), 0.5f / n, nullptr, nullptr));
  }
  r.grads = grads_of(m.model);
  r.activation_peak = m.tracker.peak(MemCategory::activations);
  r.activation_live = m.tracker.live(MemCategory::activations);
  return r;
}

TEST(Recompute, EveryPolicyGivesBitIdenticalGradients) {
  for (const ModelConfig& c : configs()) {
    for (Precision precision : {Precision::fp32, Precision::bf16}) {
      for (bool stages : {false, true}) {
        const Result ref = run(c, precision, {}, stages);
        for (const Policy& p : policies()) {
          SCOPED_TRACE(std::string(family_name(c.family)) + (c.tie_embeddings ? " tied " : " ") +
                       std::string(precision_name(precision)) + " " + p.name +
                       (stages ? " stages" : ""));
          const Result got = run(c, precision, p.policy, stages);
          ASSERT_EQ(got.losses.size(), ref.losses.size());
          for (size_t i = 0; i < ref.losses.size(); ++i) EXPECT_EQ(got.losses[i], ref.losses[i]);
          ASSERT_EQ(got.grads.size(), ref.grads.size());
          EXPECT_EQ(0, std::memcmp(got.grads.data(), ref.grads.data(),
                                   ref.grads.size() * sizeof(float)));
        }
      }
    }
  }
}

// The activation peak drops none > full 2 layers > full, and none > selective,
// with two micro-batches in flight (what a pipeline stage holds).
TEST(Recompute, ActivationPeakDrops) {
  for (const ModelConfig& c : configs()) {
    for (Precision precision : {Precision::fp32, Precision::bf16}) {
      SCOPED_TRACE(std::string(family_name(c.family)) + " " +
                   std::string(precision_name(precision)));
      const size_t none = run(c, precision, {Recompute::none, 0}, true).activation_peak;
      const size_t selective = run(c, precision, {Recompute::selective, 0}, true).activation_peak;
      const size_t full = run(c, precision, {Recompute::full, 0}, true).activation_peak;
      const size_t half = run(c, precision, {Recompute::full, 2}, true).activation_peak;
      EXPECT_LT(selective, none);
      EXPECT_LT(half, none);
      EXPECT_LT(full, half);
      EXPECT_LT(full, selective);
    }
  }
}

// A new batch shape (and a new policy) leaves nothing stale in the shared set.
TEST(Recompute, ChangingShapesAndPoliciesLeavesNoStaleState) {
  const ModelConfig c = configs()[0];
  auto grads_at = [&](Model& model, int64_t batch, int64_t seq) {
    const auto tokens = testing::random_ids(3, batch * seq, c.vocab_size);
    const auto targets = testing::random_ids(4, batch * seq, c.vocab_size);
    model.zero_grads();
    model.forward_backward(tokens.data(), targets.data(), batch, seq, 1.0f);
    return grads_of(model);
  };
  testing::CpuModel ref(c, Precision::bf16), m(c, Precision::bf16);
  testing::init_for_test(ref.model, 5);
  testing::init_for_test(m.model, 5);
  const std::vector<float> want = grads_at(ref.model, 1, 12);
  for (const Policy& p : policies()) {
    SCOPED_TRACE(p.name);
    m.model.set_recompute(p.policy);
    grads_at(m.model, 2, 16);
    const std::vector<float> got = grads_at(m.model, 1, 12);
    EXPECT_EQ(0, std::memcmp(got.data(), want.data(), want.size() * sizeof(float)));
  }
}

TEST(Recompute, RejectsBadLayerCounts) {
  testing::CpuModel m(testing::tiny_gpt2(), Precision::fp32);
  EXPECT_THROW(m.model.set_recompute({Recompute::full, -1}), Error);
  EXPECT_THROW(m.model.set_recompute({Recompute::selective, 1}), Error);
  m.model.set_recompute({Recompute::full, 1});
  EXPECT_EQ(m.model.recompute().layers, 1);
}

}  // namespace
}  // namespace meshtrain
