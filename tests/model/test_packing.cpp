// Supervised fine-tuning in the model: ignored (prompt) targets carry exactly
// zero weight, and packed records (positions restarting at 0, attention kept
// within each record) give each record's losses and gradients as if it ran
// alone — for llama (GQA, RoPE) and gpt2 (learned positions), with and
// without recomputation.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "meshtrain/model/model.h"
#include "support/tiny_models.h"

namespace meshtrain {
namespace {

std::vector<float> grads_of(Model& model) {
  const float* g = model.flat_grad().data<float>();
  return std::vector<float>(g, g + model.num_params());
}

void expect_near_all(const std::vector<float>& got, const std::vector<float>& want, double rel,
                     const char* what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], 1e-5 + rel * std::abs(want[i])) << what << " element " << i;
  }
}

std::vector<ModelConfig> configs() { return {testing::tiny_llama(false), testing::tiny_gpt2()}; }

// Three records of 5, 4 and 3 (input, target) pairs in one row of 14: two
// padding pairs at the end (target -1, a segment of their own).
constexpr int64_t kRow = 14;
const std::vector<int64_t> kLengths = {5, 4, 3};

TEST(Packing, PackedRecordsEqualTheRecordsRunAlone) {
  for (const ModelConfig& c : configs()) {
    for (Recompute mode : {Recompute::none, Recompute::full}) {
      SCOPED_TRACE(::testing::Message() << family_name(c.family) << " recompute "
                                        << recompute_name(mode));
      testing::CpuModel m(c, Precision::fp32);
      testing::init_for_test(m.model, 11);
      m.model.set_recompute({mode, 0});
      const auto tokens = testing::random_ids(40, kRow, c.vocab_size);
      auto targets = testing::random_ids(41, kRow, c.vocab_size);
      std::vector<int32_t> positions;
      for (int64_t len : kLengths)
        for (int64_t i = 0; i < len; ++i) positions.push_back(static_cast<int32_t>(i));
      for (int32_t i = 0; positions.size() < static_cast<size_t>(kRow); ++i) positions.push_back(i);
      targets[12] = targets[13] = -1;  // padding

      // Packed: one forward/backward of the whole row.
      m.model.zero_grads();
      const double packed_loss =
          m.model.forward_backward(tokens.data(), targets.data(), 1, kRow, 1.0f, positions.data());
      const std::vector<float> packed = grads_of(m.model);

      // Alone: each record as its own sequence, gradients summed.
      m.model.zero_grads();
      double alone_loss = 0;
      int64_t at = 0;
      for (int64_t len : kLengths) {
        const double loss = m.model.forward_backward(tokens.data() + at, targets.data() + at, 1,
                                                     len, 1.0f);
        // The record's loss inside the packed row (others' targets ignored).
        std::vector<int32_t> only(static_cast<size_t>(kRow), -1);
        std::copy_n(targets.begin() + at, len, only.begin() + at);
        const double in_row = m.model.forward_loss(tokens.data(), only.data(), 1, kRow, positions.data());
        EXPECT_NEAR(in_row, loss, 1e-5 * std::abs(loss)) << "record at " << at;
        alone_loss += loss;
        at += len;
      }
      EXPECT_NEAR(packed_loss, alone_loss, 1e-5 * std::abs(alone_loss));
      expect_near_all(packed, grads_of(m.model), 1e-4, "summed gradients");

      // Without positions the records see each other: the losses differ.
      const double unmasked = m.model.forward_loss(tokens.data(), targets.data(), 1, kRow);
      EXPECT_GT(std::abs(unmasked - packed_loss), 1e-3);
    }
  }
}

// Prompt targets (-1) carry exactly zero weight: whatever id a prompt
// position would have had, the gradients are bit-identical to leaving it out,
// and the masked and complementary gradients add up to the full batch's.
TEST(Packing, PromptTargetsAreExactlyZeroWeighted) {
  for (const ModelConfig& c : configs()) {
    SCOPED_TRACE(family_name(c.family));
    testing::CpuModel m(c, Precision::fp32);
    testing::init_for_test(m.model, 12);
    const int64_t B = 2, T = 8, n = B * T;
    const auto tokens = testing::random_ids(50, n, c.vocab_size);
    const auto full = testing::random_ids(51, n, c.vocab_size);
    std::vector<int32_t> response = full, prompt = full;
    for (int64_t i = 0; i < n; ++i) {
      const bool is_prompt = i % T < 3;  // each row: 3 prompt positions, then the response
      (is_prompt ? response : prompt)[static_cast<size_t>(i)] = -1;
    }
    auto run = [&](const std::vector<int32_t>& targets) {
      m.model.zero_grads();
      const double loss = m.model.forward_backward(tokens.data(), targets.data(), B, T, 0.1f);
      return std::pair{loss, grads_of(m.model)};
    };
    const auto [loss_r, g_r] = run(response);
    // A different would-be target at a prompt position, still masked: same bits.
    std::vector<int32_t> other = response;
    other[1] = -5;
    const auto [loss_o, g_o] = run(other);
    EXPECT_EQ(loss_r, loss_o);
    EXPECT_EQ(0, std::memcmp(g_r.data(), g_o.data(), g_r.size() * sizeof(float)));
    // Linearity: masked + complement = all targets.
    const auto [loss_p, g_p] = run(prompt);
    const auto [loss_f, g_f] = run(full);
    EXPECT_NEAR(loss_r + loss_p, loss_f, 1e-5 * loss_f);
    std::vector<float> sum(g_r.size());
    for (size_t i = 0; i < sum.size(); ++i) sum[i] = g_r[i] + g_p[i];
    expect_near_all(sum, g_f, 1e-4, "masked + complement");
    // And a prompt target's change does move the full batch's gradients.
    std::vector<int32_t> moved = full;
    moved[1] = (moved[1] + 1) % static_cast<int32_t>(c.vocab_size);
    const auto [loss_m, g_m] = run(moved);
    EXPECT_NE(0, std::memcmp(g_m.data(), g_f.data(), g_f.size() * sizeof(float)));
  }
}

}  // namespace
}  // namespace meshtrain
