// (d) Export/import round trips keep every weight and the computed function.
// The Hugging Face q/k permutation itself is checked against a rotate_half
// Llama in PyTorch by the ctest reference_hf_export (tests/reference.cmake).
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <iterator>

#include "fixtures.h"
#include "meshtrain/backend/cpu/cpu_backend.h"
#include "meshtrain/ckpt/llama2c.h"

namespace meshtrain::parity {
namespace {

std::vector<int32_t> some_tokens(int64_t n, int64_t vocab) {
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) ids[static_cast<size_t>(i)] = static_cast<int32_t>((i * 37 + 5) % vocab);
  return ids;
}

void expect_same_weights(const Model& a, const Model& b) {
  ASSERT_EQ(a.params().size(), b.params().size());
  for (size_t i = 0; i < a.params().size(); ++i) {
    const Parameter& p = a.params()[i];
    const Parameter& q = b.params()[i];
    ASSERT_EQ(p.spec.name, q.spec.name);
    ASSERT_EQ(p.spec.shape, q.spec.shape);
    EXPECT_EQ(std::memcmp(p.master.raw(), q.master.raw(), p.master.bytes()), 0) << p.spec.name;
  }
}

void expect_same_logits(Model& a, Model& b) {
  const int64_t seq = std::min<int64_t>(a.config().max_seq_len, 12);
  const auto tokens = some_tokens(2 * seq, a.config().vocab_size);
  std::vector<float> la(static_cast<size_t>(2 * seq * a.config().vocab_size)), lb(la.size());
  a.forward_logits(tokens.data(), 2, seq, la.data());
  b.forward_logits(tokens.data(), 2, seq, lb.data());
  EXPECT_EQ(std::memcmp(la.data(), lb.data(), la.size() * sizeof(float)), 0);
}

class HfRoundTrip : public ::testing::TestWithParam<const char*> {};

TEST_P(HfRoundTrip, ExportThenImportGivesIdenticalWeightsAndLogits) {
  FixtureModel f(GetParam(), Precision::fp32);
  const std::string dir = scratch_dir();
  export_hf(*f.model, dir);
  auto back = import_hf(dir, Precision::fp32, f.ctx);
  EXPECT_EQ(hf_config_json(back->config()), hf_config_json(f.model->config()));
  expect_same_weights(*f.model, *back);
  expect_same_logits(*f.model, *back);
}

TEST_P(HfRoundTrip, Bf16ExportRoundsEachWeightOnce) {
  FixtureModel f(GetParam(), Precision::fp32);
  const std::string dir = scratch_dir();
  export_hf(*f.model, dir, DType::bf16);
  SafetensorsReader file(dir + "/model.safetensors");
  for (const StTensorInfo& t : file.tensors()) EXPECT_EQ(t.dtype, StDType::BF16) << t.name;
  auto back = import_hf(dir, Precision::fp32, f.ctx);
  for (size_t i = 0; i < back->params().size(); ++i) {
    const float* a = f.model->params()[i].master.data<float>();
    const float* b = back->params()[i].master.data<float>();
    for (int64_t j = 0; j < back->params()[i].spec.numel(); ++j) {
      ASSERT_EQ(b[j], bf16_to_float(float_to_bf16(a[j]))) << back->params()[i].spec.name;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Families, HfRoundTrip, ::testing::Values("llama_gqa", "gpt2"));

TEST(Llama2cRoundTrip, ExportThenImportGivesIdenticalWeightsAndLogits) {
  FixtureModel f("llama_gqa", Precision::fp32);  // untied: the classifier is written too
  const std::string path = scratch_dir() + "/model.bin";
  export_llama2c(*f.model, path);
  auto back = import_llama2c(path, Precision::fp32, f.ctx);
  EXPECT_FALSE(back->config().tie_embeddings);
  expect_same_weights(*f.model, *back);
  expect_same_logits(*f.model, *back);
}

TEST(Llama2cRoundTrip, Stories260KReexportsByteForByteOutsideRopeTables) {
  MemoryTracker tracker;
  cpu::CpuBackend ctx(0, tracker);
  auto model = import_llama2c(stories_path(), Precision::fp32, ctx);
  const std::string path = scratch_dir() + "/stories.bin";
  export_llama2c(*model, path);
  auto slurp = [](const std::string& p) {
    std::ifstream in(p, std::ios::binary);
    return std::vector<char>(std::istreambuf_iterator<char>(in), {});
  };
  const auto original = slurp(stories_path()), exported = slurp(path);
  ASSERT_EQ(original.size(), exported.size());
  // The RoPE tables follow rms_final and end the (tied) file; llama2.c computed
  // them in float32 with torch, so compare those numerically.
  const ModelConfig& c = model->config();
  const size_t tables = static_cast<size_t>(c.max_seq_len * c.head_dim()) * 4;
  const size_t rope_begin = original.size() - tables;
  EXPECT_EQ(std::memcmp(original.data(), exported.data(), rope_begin), 0);
  double max_diff = 0;
  for (size_t i = rope_begin; i < original.size(); i += 4) {
    float a, b;
    std::memcpy(&a, original.data() + i, 4);
    std::memcpy(&b, exported.data() + i, 4);
    max_diff = std::max(max_diff, static_cast<double>(std::abs(a - b)));
  }
  EXPECT_LE(max_diff, 1e-4);
}

}  // namespace
}  // namespace meshtrain::parity
