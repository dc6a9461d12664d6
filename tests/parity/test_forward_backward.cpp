// (a) fp32 logits, loss and every parameter gradient against the float64
// PyTorch reference. Error per tensor: ||meshtrain - reference|| / ||reference||.
#include <gtest/gtest.h>

#include "fixtures.h"

namespace meshtrain::parity {
namespace {

constexpr double kTol = 1e-5;

class ForwardBackward : public ::testing::TestWithParam<const char*> {};

// A fixture's batch: tokens and targets [batch, seq].
struct RefBatch {
  explicit RefBatch(const SafetensorsReader& ref)
      : batch(ref.info("tokens").shape[0]), seq(ref.info("tokens").shape[1]),
        tokens(to_i32(ref.read_ints("tokens"))), targets(to_i32(ref.read_ints("targets"))) {}
  int64_t batch, seq;
  std::vector<int32_t> tokens, targets;
};

TEST_P(ForwardBackward, LogitsLossAndEveryGradientMatchFloat64Reference) {
  const std::string name = GetParam();
  FixtureModel f(name, Precision::fp32);
  Model& model = *f.model;
  SafetensorsReader ref(fixture_path(name + ".reference.safetensors"));
  const RefBatch b(ref);
  const int64_t batch = b.batch, seq = b.seq, n = batch * seq;
  const std::vector<int32_t>& tokens = b.tokens;
  const std::vector<int32_t>& targets = b.targets;

  Tensor ref_logits = ref.read_tensor("logits", DType::f32, MemCategory::workspace, f.tracker);
  std::vector<float> logits = f.logits(tokens, batch, seq);
  ASSERT_EQ(static_cast<int64_t>(logits.size()), ref_logits.numel());
  const double logits_err = rel_error(logits.data(), ref_logits.data<float>(), ref_logits.numel());
  EXPECT_LE(logits_err, kTol) << "logits";

  model.zero_grads();
  const double loss = model.forward_backward(tokens.data(), targets.data(), batch, seq,
                                             1.0f / static_cast<float>(n)) / static_cast<double>(n);
  Tensor ref_loss = ref.read_tensor("loss", DType::f32, MemCategory::workspace, f.tracker);
  const double ref_loss_value = ref_loss.data<float>()[0];
  EXPECT_LE(std::abs(loss - ref_loss_value) / std::abs(ref_loss_value), kTol)
      << "loss " << loss << " vs " << ref_loss_value;

  double worst = 0;
  std::string worst_name;
  for (const Parameter& p : model.params()) {
    Tensor g = ref.read_tensor("grad/" + p.spec.name, DType::f32, MemCategory::workspace,
                               f.tracker);
    ASSERT_EQ(g.shape(), p.spec.shape) << p.spec.name;
    const double err = rel_error(p.grad.data<float>(), g.data<float>(), g.numel());
    EXPECT_LE(err, kTol) << "gradient of " << p.spec.name;
    if (err > worst) worst = err, worst_name = p.spec.name;
  }
  std::printf("%s: logits rel err %.2e, loss rel err %.2e, worst gradient rel err %.2e (%s)\n",
              name.c_str(), logits_err, std::abs(loss - ref_loss_value) / ref_loss_value, worst,
              worst_name.c_str());
}

// Packed SFT rows (records with positions restarting at 0, attention within
// each record, prompt and padding targets -1) against PyTorch's float64
// reference with a block-diagonal causal mask and cross_entropy(ignore_index=-1):
// the mean over loss tokens and every gradient.
TEST_P(ForwardBackward, PackedSftRowsMatchFloat64ReferenceWithIgnoreIndex) {
  const std::string name = GetParam();
  FixtureModel f(name, Precision::fp32);
  Model& model = *f.model;
  SafetensorsReader ref(fixture_path(name + ".sft.safetensors"));
  const RefBatch b(ref);
  const int64_t batch = b.batch, seq = b.seq;
  const std::vector<int32_t>& tokens = b.tokens;
  const std::vector<int32_t>& targets = b.targets;
  const auto positions = to_i32(ref.read_ints("positions"));
  int64_t loss_tokens = 0;
  for (int32_t t : targets) loss_tokens += t >= 0;
  ASSERT_GT(loss_tokens, 0);
  ASSERT_LT(loss_tokens, batch * seq);
  model.zero_grads();
  const double loss = model.forward_backward(tokens.data(), targets.data(), batch, seq,
                                             1.0f / static_cast<float>(loss_tokens),
                                             positions.data()) /
                      static_cast<double>(loss_tokens);
  Tensor ref_loss = ref.read_tensor("loss", DType::f32, MemCategory::workspace, f.tracker);
  EXPECT_LE(std::abs(loss - ref_loss.data<float>()[0]) / ref_loss.data<float>()[0], kTol);
  for (const Parameter& p : model.params()) {
    Tensor g = ref.read_tensor("grad/" + p.spec.name, DType::f32, MemCategory::workspace, f.tracker);
    EXPECT_LE(rel_error(p.grad.data<float>(), g.data<float>(), g.numel()), kTol)
        << "gradient of " << p.spec.name;
  }
}

// Mixed precision against the same float64 reference: the worst relative error
// of the logits, the loss and any parameter gradient. fp16 runs with a loss
// scale of 1024 on the loss gradient (divided out of the gradients after), as
// training does; its 11-bit mantissa must beat bf16's 8 bits.
struct MixedErrors {
  double logits = 0, loss = 0, grad = 0;
};

MixedErrors mixed_errors(const std::string& name, Precision precision, float loss_scale) {
  FixtureModel f(name, precision);
  Model& model = *f.model;
  SafetensorsReader ref(fixture_path(name + ".reference.safetensors"));
  const auto& shape = ref.info("tokens").shape;
  const int64_t batch = shape[0], seq = shape[1], n = batch * seq;
  const auto tokens = to_i32(ref.read_ints("tokens"));
  const auto targets = to_i32(ref.read_ints("targets"));
  MixedErrors e;
  Tensor ref_logits = ref.read_tensor("logits", DType::f32, MemCategory::workspace, f.tracker);
  std::vector<float> logits = f.logits(tokens, batch, seq);
  e.logits = rel_error(logits.data(), ref_logits.data<float>(), ref_logits.numel());
  model.zero_grads();
  const double loss = model.forward_backward(tokens.data(), targets.data(), batch, seq,
                                             loss_scale / static_cast<float>(n)) /
                      static_cast<double>(n);
  Tensor ref_loss = ref.read_tensor("loss", DType::f32, MemCategory::workspace, f.tracker);
  e.loss = std::abs(loss - ref_loss.data<float>()[0]) / std::abs(ref_loss.data<float>()[0]);
  for (const Parameter& p : model.params()) {
    Tensor g = ref.read_tensor("grad/" + p.spec.name, DType::f32, MemCategory::workspace, f.tracker);
    std::vector<float> unscaled(p.grad.data<float>(), p.grad.data<float>() + p.grad.numel());
    for (float& x : unscaled) x /= loss_scale;
    e.grad = std::max(e.grad, rel_error(unscaled.data(), g.data<float>(), g.numel()));
  }
  std::printf("%s %s: logits rel err %.2e, loss rel err %.2e, worst gradient rel err %.2e\n",
              name.c_str(), std::string(precision_name(precision)).c_str(), e.logits, e.loss,
              e.grad);
  return e;
}

TEST_P(ForwardBackward, Fp16MatchesFloat64ReferenceCloserThanBf16) {
  const MixedErrors half = mixed_errors(GetParam(), Precision::fp16, 1024.0f);
  const MixedErrors brain = mixed_errors(GetParam(), Precision::bf16, 1.0f);
  // Stated tolerances for fp16 (f16 operands, f32 accumulation).
  EXPECT_LE(half.logits, 2e-3);
  EXPECT_LE(half.loss, 1e-3);
  EXPECT_LE(half.grad, 5e-3);
  EXPECT_LT(half.logits, brain.logits);
  EXPECT_LT(half.grad, brain.grad);
}

INSTANTIATE_TEST_SUITE_P(Families, ForwardBackward, ::testing::Values("llama_gqa", "gpt2"));

}  // namespace
}  // namespace meshtrain::parity
