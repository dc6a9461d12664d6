// The fp32 model against the float64 reference (reference.h): logits, loss,
// and every parameter gradient against central differences of the reference.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "meshtrain/model/model.h"
#include "reference.h"
#include "support/tiny_models.h"

namespace meshtrain {
namespace {

using testing::reference_logits;
using testing::reference_loss;

struct Case {
  const char* label;
  ModelConfig config;
};

std::vector<Case> cases() {
  return {{"llama_gqa_untied", testing::tiny_llama(false)},
          {"llama_gqa_tied", testing::tiny_llama(true)},
          {"gpt2", testing::tiny_gpt2()}};
}

constexpr int64_t kBatch = 2, kSeq = 7;

TEST(ModelMath, LogitsAndLossMatchFloat64Reference) {
  for (const Case& tc : cases()) {
    SCOPED_TRACE(tc.label);
    testing::CpuModel m(tc.config, Precision::fp32);
    Model& model = m.model;
    testing::init_for_test(model, 3);
    const int64_t V = tc.config.vocab_size, n = kBatch * kSeq;
    auto tokens = testing::random_ids(1, n, V);
    auto targets = testing::random_ids(2, n, V);
    targets[3] = -1;  // ignored

    std::vector<float> logits(static_cast<size_t>(n * V));
    model.forward_logits(tokens.data(), kBatch, kSeq, logits.data());
    const std::vector<double> ref = reference_logits(model.config(), testing::weights_of(model),
                                                     tokens, kBatch, kSeq);
    double max_err = 0, max_ref = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
      max_err = std::max(max_err, std::abs(logits[i] - ref[i]));
      max_ref = std::max(max_ref, std::abs(ref[i]));
    }
    EXPECT_GT(max_ref, 0.5);  // not trivially small
    EXPECT_LT(max_err, 2e-6 * max_ref) << "max |logit| " << max_ref;

    const double loss = model.forward_loss(tokens.data(), targets.data(), kBatch, kSeq);
    const double ref_loss = reference_loss(ref, targets, V);
    EXPECT_NEAR(loss, ref_loss, 1e-6 * ref_loss);
  }
}

// d(loss)/d(theta) of the reference by central differences, for every element.
TEST(ModelMath, EveryGradientMatchesFiniteDifferencesOfReference) {
  for (const Case& tc : cases()) {
    SCOPED_TRACE(tc.label);
    testing::CpuModel m(tc.config, Precision::fp32);
    Model& model = m.model;
    testing::init_for_test(model, 5);
    const int64_t V = tc.config.vocab_size, n = kBatch * kSeq;
    auto tokens = testing::random_ids(11, n, V);
    auto targets = testing::random_ids(12, n, V);
    targets[0] = -1;
    const float scale = 1.0f / static_cast<float>(n - 1);
    model.zero_grads();
    model.forward_backward(tokens.data(), targets.data(), kBatch, kSeq, scale);

    testing::Weights w = testing::weights_of(model);
    auto loss_at = [&] {
      return reference_loss(reference_logits(model.config(), w, tokens, kBatch, kSeq), targets, V) *
             scale;
    };
    const double h = 1e-4;
    for (const Parameter& p : model.params()) {
      std::vector<double>& values = w.at(p.spec.name);
      const float* g = p.grad.data<float>();
      double max_err = 0, max_g = 0;
      for (size_t i = 0; i < values.size(); ++i) {
        const double saved = values[i];
        values[i] = saved + h;
        const double up = loss_at();
        values[i] = saved - h;
        const double down = loss_at();
        values[i] = saved;
        const double fd = (up - down) / (2 * h);
        max_err = std::max(max_err, std::abs(g[i] - fd));
        max_g = std::max(max_g, std::abs(fd));
      }
      // f32 engine vs float64 differences: error relative to the tensor's largest gradient.
      EXPECT_GT(max_g, 1e-6) << p.spec.name << " has no gradient";
      EXPECT_LT(max_err, 1e-5 * max_g + 1e-8) << p.spec.name << " max |g| " << max_g;
    }
  }
}

}  // namespace
}  // namespace meshtrain
