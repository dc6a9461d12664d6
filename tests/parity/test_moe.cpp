// Mixture-of-experts blocks (config.h MoeConfig) against the float64 PyTorch
// reference (reference_model.py moe_ffn): logits, the cross-entropy, the
// auxiliary losses and every gradient of their sum, for each routing variant.
#include <gtest/gtest.h>

#include <numeric>

#include "fixtures.h"

namespace meshtrain::parity {
namespace {

constexpr double kTol = 1e-5;

struct MoeRun {
  double loss = 0, aux = 0;
  std::vector<std::vector<int64_t>> tokens;  // per MoE layer: each expert's choices
  std::vector<std::vector<float>> grads;  // registry order
};

// One forward_backward over the case's batch, weighted so the loss is the
// token mean (then the auxiliary losses weigh 1, as in the reference).
MoeRun run_case(FixtureModel& f, const SafetensorsReader& ref) {
  Model& model = *f.model;
  const auto& shape = ref.info("tokens").shape;
  const int64_t batch = shape[0], seq = shape[1], n = batch * seq;
  const auto tokens = to_i32(ref.read_ints("tokens"));
  const auto targets = to_i32(ref.read_ints("targets"));
  model.zero_grads();
  model.reset_moe_stats();
  MoeRun r;
  r.loss = model.forward_backward(tokens.data(), targets.data(), batch, seq,
                                  1.0f / static_cast<float>(n)) / static_cast<double>(n);
  const MoeConfig& m = model.config().moe;
  for (const MoeLayerStats& st : model.moe_stats()) {
    EXPECT_EQ(st.micro_batches, 1);
    EXPECT_EQ(std::accumulate(st.tokens.begin(), st.tokens.end(), int64_t{0}), n * m.top_k)
        << "layer " << st.layer << ": every token's top_k choices are counted";
    r.aux += m.aux_loss * st.aux + m.z_loss * st.z;
    r.tokens.push_back(st.tokens);
  }
  for (const Parameter& p : model.params()) {
    r.grads.emplace_back(p.grad.data<float>(), p.grad.data<float>() + p.grad.numel());
  }
  return r;
}

// The worst gradient error of a run against the reference's grad/<name>
// tensors and its parameter, skipping those `skip` names.
struct WorstGradient {
  double err = 0;
  std::string name;
};
template <typename Skip>
WorstGradient worst_gradient(FixtureModel& f, const SafetensorsReader& ref, const MoeRun& r,
                             Skip&& skip) {
  WorstGradient w;
  const auto& params = f.model->params();
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string& name = params[i].spec.name;
    Tensor g = ref.read_tensor("grad/" + name, DType::f32, MemCategory::workspace, f.tracker);
    EXPECT_EQ(g.shape(), params[i].spec.shape) << name;
    if (skip(name) || g.shape() != params[i].spec.shape) continue;
    const double err = rel_error(r.grads[i].data(), g.data<float>(), g.numel());
    if (err > w.err) w = {err, name};
  }
  return w;
}

class MoeReference : public ::testing::TestWithParam<const char*> {};

TEST_P(MoeReference, LogitsLossAuxiliaryLossesAndEveryGradientMatchFloat64) {
  const std::string name = GetParam();
  FixtureModel f(name, Precision::fp32);
  SafetensorsReader ref(fixture_path(name + ".reference.safetensors"));
  const auto& shape = ref.info("tokens").shape;
  const auto tokens = to_i32(ref.read_ints("tokens"));
  Tensor ref_logits = ref.read_tensor("logits", DType::f32, MemCategory::workspace, f.tracker);
  const std::vector<float> logits = f.logits(tokens, shape[0], shape[1]);
  const double logits_err = rel_error(logits.data(), ref_logits.data<float>(), ref_logits.numel());
  EXPECT_LE(logits_err, kTol) << "logits";

  const MoeRun r = run_case(f, ref);
  const double ref_loss = ref.read_tensor("loss", DType::f32, MemCategory::workspace, f.tracker)
                              .data<float>()[0];
  const double ref_aux = ref.read_tensor("aux", DType::f32, MemCategory::workspace, f.tracker)
                             .data<float>()[0];
  EXPECT_LE(std::abs(r.loss - ref_loss) / ref_loss, kTol) << r.loss << " vs " << ref_loss;
  EXPECT_NEAR(r.aux, ref_aux, kTol * std::max(1.0, ref_aux)) << "auxiliary losses";
  const WorstGradient worst = worst_gradient(f, ref, r, [](const std::string&) { return false; });
  EXPECT_LE(worst.err, kTol) << "gradient of " << worst.name;
  std::printf("%s: logits %.2e, loss %.2e, aux %.6f vs %.6f, worst gradient %.2e (%s)\n",
              name.c_str(), logits_err, std::abs(r.loss - ref_loss) / ref_loss, r.aux, ref_aux,
              worst.err, worst.name.c_str());
}

// Activation checkpointing recomputes routing and experts from the same
// inputs: losses and gradients bit-identical to keeping everything.
TEST_P(MoeReference, RecomputeIsBitIdentical) {
  const std::string name = GetParam();
  SafetensorsReader ref(fixture_path(name + ".reference.safetensors"));
  FixtureModel base(name, Precision::fp32);
  const MoeRun kept = run_case(base, ref);
  for (const RecomputePolicy policy :
       {RecomputePolicy{Recompute::selective, 0}, RecomputePolicy{Recompute::full, 0}}) {
    FixtureModel f(name, Precision::fp32);
    f.model->set_recompute(policy);
    const MoeRun r = run_case(f, ref);
    EXPECT_EQ(r.loss, kept.loss) << recompute_name(policy.mode);
    EXPECT_EQ(r.aux, kept.aux) << recompute_name(policy.mode) << ": counted once";
    EXPECT_EQ(r.grads, kept.grads) << recompute_name(policy.mode);
  }
}

// bf16: the compute-dtype experts and the f32 router against the same
// reference, within bf16's error (stated bound). A token whose k-th and
// k+1-th scores are within bf16's rounding may choose another expert than in
// fp32; the routers' and routed experts' gradients then differ by more
// (that token's whole term), so they are held to the bound only where every
// choice agrees (and the rest, downstream of the flipped token, to 0.1).
TEST_P(MoeReference, Bf16StaysWithinItsTolerance) {
  const std::string name = GetParam();
  SafetensorsReader ref(fixture_path(name + ".reference.safetensors"));
  FixtureModel f32_model(name, Precision::fp32);
  const MoeRun exact = run_case(f32_model, ref);
  FixtureModel f(name, Precision::bf16);
  const MoeRun r = run_case(f, ref);
  const bool same_choices = r.tokens == exact.tokens;
  const double ref_loss = ref.read_tensor("loss", DType::f32, MemCategory::workspace, f.tracker)
                              .data<float>()[0];
  EXPECT_LE(std::abs(r.loss - ref_loss) / ref_loss, 1e-2);
  const WorstGradient worst = worst_gradient(f, ref, r, [&](const std::string& param) {
    const bool routed =
        param.ends_with("mlp.gate.weight") || param.find("mlp.experts.") != std::string::npos;
    return routed && !same_choices;
  });
  std::printf("%s bf16: loss rel err %.2e, worst gradient rel err %.2e (%s)%s\n", name.c_str(),
              std::abs(r.loss - ref_loss) / ref_loss, worst.err, worst.name.c_str(),
              same_choices ? "" : "; routing differs from fp32: routers and routed experts not compared");
  EXPECT_LE(worst.err, same_choices ? 0.05 : 0.1);
}

INSTANTIATE_TEST_SUITE_P(Routers, MoeReference,
                         ::testing::Values("moe_mixtral", "moe_qwen2", "moe_deepseek",
                                           "moe_dense_mixture", "moe_capacity",
                                           // With their families' attention options.
                                           "attn_qwen2_moe", "attn_qwen3_moe", "attn_olmoe"));

// A capacity of at least every choice (N * top_k per expert) drops nothing:
// the dropless run, bit for bit; below it choices are dropped and counted.
TEST(MoeCapacity, AtLeastEveryChoiceEqualsDroplessAndLessDrops) {
  SafetensorsReader ref(fixture_path("moe_mixtral.reference.safetensors"));
  FixtureModel dropless("moe_mixtral", Precision::fp32);
  const MoeRun want = run_case(dropless, ref);
  for (const float factor : {4.0f, 0.5f}) {
    FixtureModel f("moe_mixtral", Precision::fp32);
    ModelConfig c = f.model->config();
    c.moe.capacity_factor = factor;  // experts 4, top 2: C = N * 2 at factor 4
    auto model = std::make_unique<Model>(c, Precision::fp32, f.ctx);
    for (size_t i = 0; i < model->params().size(); ++i) {
      model->params()[i].master.copy_from(f.model->params()[i].master);
    }
    f.model = std::move(model);
    const MoeRun got = run_case(f, ref);
    int64_t dropped = 0;
    for (const MoeLayerStats& st : f.model->moe_stats()) dropped += st.dropped;
    if (factor >= 4.0f) {
      EXPECT_EQ(dropped, 0);
      EXPECT_EQ(got.loss, want.loss);
      EXPECT_EQ(got.grads, want.grads);
    } else {
      EXPECT_GT(dropped, 0);
      EXPECT_NE(got.loss, want.loss);
    }
  }
}

// DeepSeek-V3's balancing: the selection bias is a frozen parameter; an
// update raises an under-loaded expert's bias and lowers an over-loaded one's
// by the rate, zero-mean; a bias steers the choice, not the weights.
TEST(MoeBalancing, BiasUpdateMovesLoadTowardTheMeanAndOnlySteersTheChoice) {
  MemoryTracker tracker;
  cpu::CpuBackend ctx(1, tracker);
  ModelConfig c = llama_shape(16, 2, 2, 2, 32, 31, 8, false);
  c.moe = MoeConfig{.experts = 4, .top_k = 2, .hidden_dim = 8, .score = ops::RouterScore::sigmoid,
                    .bias_update_rate = 0.25f};
  Model model(c, Precision::fp32, ctx);
  model.init_weights(3);
  const Parameter& bias = model.param("model.layers.1.mlp.gate.e_score_correction_bias");
  EXPECT_FALSE(bias.spec.trainable);
  EXPECT_EQ(model.selection_bias(1), std::vector<float>(4, 0.0f));
  const std::vector<int64_t> loads{10, 0, 5, 5};  // mean 5
  model.update_selection_bias(1, loads);
  // sign(mean - load) * 0.25 = {-0.25, 0.25, 0, 0}, already zero-mean.
  EXPECT_EQ(model.selection_bias(1), (std::vector<float>{-0.25f, 0.25f, 0.0f, 0.0f}));
  model.update_selection_bias(1, std::vector<int64_t>{9, 1, 1, 1});  // {-.25, .25, .25, .25} - 0.125
  EXPECT_EQ(model.selection_bias(1), (std::vector<float>{-0.625f, 0.375f, 0.125f, 0.125f}));

  // A large bias on experts 2 and 3: every token chooses them; the loss moves
  // only through the choice (sigmoid weights ignore the bias).
  std::vector<int32_t> tokens(16), targets(16);
  for (int i = 0; i < 16; ++i) tokens[i] = i % 31, targets[i] = (i * 7) % 31;
  std::vector<float> steer{-100, -100, 100, 100};
  for (const char* name : {"model.layers.0.mlp.gate.e_score_correction_bias",
                           "model.layers.1.mlp.gate.e_score_correction_bias"}) {
    model.copy_master_from_host(model.param(name), steer.data());
  }
  model.reset_moe_stats();
  model.zero_grads();
  model.forward_backward(tokens.data(), targets.data(), 2, 8, 1.0f / 16);
  for (const MoeLayerStats& st : model.moe_stats()) {
    EXPECT_EQ(st.tokens, (std::vector<int64_t>{0, 0, 16, 16})) << "layer " << st.layer;
  }
}

}  // namespace
}  // namespace meshtrain::parity
