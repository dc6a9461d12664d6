// (c) stories260K, a model nobody here trained, imported from its llama2.c
// file: logits of a fixed id sequence within 1e-4 (max abs) of the float64
// PyTorch reference, and greedy decoding from BOS with the KV cache gives the
// reference's ids (the reference agrees with a port of llama2.c's run.c).
#include <gtest/gtest.h>

#include <algorithm>

#include "fixtures.h"
#include "meshtrain/backend/cpu/cpu_backend.h"
#include "meshtrain/ckpt/llama2c.h"

namespace meshtrain::parity {
namespace {

TEST(Stories260K, LogitsMatchReference) {
  MemoryTracker tracker;
  cpu::CpuBackend ctx(0, tracker);
  auto model = import_llama2c(stories_path(), Precision::fp32, ctx);
  SafetensorsReader ref(fixture_path("stories260k.reference.safetensors"));
  const auto tokens = to_i32(ref.read_ints("tokens"));
  const auto seq = static_cast<int64_t>(tokens.size());
  const int64_t vocab = model->config().vocab_size;
  Tensor expected = ref.read_tensor("logits", DType::f32, MemCategory::workspace, tracker);
  ASSERT_EQ(expected.shape(), (Shape{seq, vocab}));
  std::vector<float> logits(static_cast<size_t>(seq * vocab));
  model->forward_logits(tokens.data(), 1, seq, logits.data());
  double max_abs = 0;
  for (int64_t i = 0; i < seq * vocab; ++i) {
    max_abs = std::max(max_abs, static_cast<double>(std::abs(logits[static_cast<size_t>(i)] -
                                                             expected.data<float>()[i])));
  }
  EXPECT_LE(max_abs, 1e-4);
  std::printf("stories260K: %lld positions, max |logit - reference| = %.2e\n",
              static_cast<long long>(seq), max_abs);
}

TEST(Stories260K, GreedyDecodingFromBosMatchesReference) {
  MemoryTracker tracker;
  cpu::CpuBackend ctx(0, tracker);
  auto model = import_llama2c(stories_path(), Precision::fp32, ctx);
  SafetensorsReader ref(fixture_path("stories260k.reference.safetensors"));
  const auto expected = ref.read_ints("greedy");
  const auto steps = static_cast<int64_t>(expected.size());
  KVCache cache = model->make_kv_cache(1, steps);
  std::vector<float> logits(static_cast<size_t>(model->config().vocab_size));
  int32_t token = 1;  // BOS
  std::vector<int64_t> got;
  for (int64_t i = 0; i < steps; ++i) {
    model->decode(&token, 1, 1, cache, logits.data());
    token = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    got.push_back(token);
  }
  EXPECT_EQ(got, expected);
}

}  // namespace
}  // namespace meshtrain::parity
