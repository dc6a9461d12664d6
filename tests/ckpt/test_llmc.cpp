// llm.c GPT-2 checkpoints: the file layout against llm.c's format (header
// words, sizes, padded vocabulary rows zero, [out, in] matrices in llm.c's
// tensor order), the round trip, and the errors.
#include <gtest/gtest.h>

#include <array>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <vector>

#include "meshtrain/ckpt/llmc.h"
#include "util.h"

namespace meshtrain {
namespace {

using LlmcTest = ckpt_test::CkptTest;

std::vector<char> read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

TEST_F(LlmcTest, FileLayoutIsLlmcs) {
  Model model(testing::small_gpt2(), Precision::fp32, ctx);
  model.init_weights(7);
  const ModelConfig& c = model.config();  // dim 16, 2 layers, 2 heads, vocab 19, seq 8
  export_llmc(model, dir + "/gpt2.bin");
  const std::vector<char> bytes = read_all(dir + "/gpt2.bin");
  std::array<int32_t, 256> h{};
  std::memcpy(h.data(), bytes.data(), sizeof(h));
  EXPECT_EQ(h[0], 20240326);
  EXPECT_EQ(h[1], 3);
  EXPECT_EQ(h[2], c.max_seq_len);
  EXPECT_EQ(h[3], c.vocab_size);
  EXPECT_EQ(h[4], c.n_layers);
  EXPECT_EQ(h[5], c.n_heads);
  EXPECT_EQ(h[6], c.dim);
  EXPECT_EQ(h[7], 128);  // 19 padded to a multiple of 128
  for (size_t i = 8; i < h.size(); ++i) EXPECT_EQ(h[i], 0);

  const int64_t C = c.dim, L = c.n_layers, V = c.vocab_size, Vp = 128, T = c.max_seq_len;
  // llm.c's fill_in_parameter_sizes, in order.
  const std::vector<int64_t> sizes = {Vp * C, T * C, L * C, L * C, L * 3 * C * C, L * 3 * C,
                                      L * C * C, L * C, L * C, L * C, L * 4 * C * C, L * 4 * C,
                                      L * C * 4 * C, L * C, C, C};
  int64_t total = 0;
  std::vector<int64_t> offset;
  for (int64_t s : sizes) {
    offset.push_back(1024 + 4 * total);
    total += s;
  }
  ASSERT_EQ(static_cast<int64_t>(bytes.size()), 1024 + 4 * total);
  auto at = [&](size_t tensor, int64_t index) {
    float v;
    std::memcpy(&v, bytes.data() + offset[tensor] + 4 * index, 4);
    return v;
  };
  const float* wte = model.param("transformer.wte.weight").master.data<float>();
  EXPECT_EQ(at(0, 5 * C + 3), wte[5 * C + 3]);
  for (int64_t i = V * C; i < Vp * C; ++i) ASSERT_EQ(at(0, i), 0.0f) << "padding row element " << i;
  // qkvw of layer 1: [3C, C] rows = outputs; the registry's c_attn is [C, 3C].
  const float* c_attn = model.param("transformer.h.1.attn.c_attn.weight").master.data<float>();
  for (int64_t o : {0L, 17L, 3 * C - 1}) {
    for (int64_t i : {0L, 5L, C - 1}) {
      EXPECT_EQ(at(4, 3 * C * C + o * C + i), c_attn[i * 3 * C + o]);
    }
  }
  // fcprojw of layer 0: [C, 4C]; the registry's mlp.c_proj is [4C, C].
  const float* fc_proj = model.param("transformer.h.0.mlp.c_proj.weight").master.data<float>();
  EXPECT_EQ(at(12, 3 * 4 * C + 7), fc_proj[7 * C + 3]);
  EXPECT_EQ(at(5, 3 * C + 2), model.param("transformer.h.1.attn.c_attn.bias").master.data<float>()[2]);
  EXPECT_EQ(at(15, 4), model.param("transformer.ln_f.bias").master.data<float>()[4]);
}

TEST_F(LlmcTest, RoundTripIsTheIdentity) {
  Model model(testing::small_gpt2(), Precision::fp32, ctx);
  model.init_weights(3);
  export_llmc(model, dir + "/gpt2.bin");
  const LlmcHeader header = read_llmc_header(dir + "/gpt2.bin");
  EXPECT_EQ(header.version, 3);
  EXPECT_EQ(header.padded_vocab, 128);
  auto back = import_llmc(dir + "/gpt2.bin", Precision::fp32, ctx);
  ASSERT_EQ(back->params().size(), model.params().size());
  for (size_t i = 0; i < model.params().size(); ++i) {
    EXPECT_EQ(std::memcmp(model.params()[i].master.raw(), back->params()[i].master.raw(),
                          model.params()[i].master.bytes()), 0)
        << model.params()[i].spec.name;
  }
  // bf16 (version 5): every weight is its bf16 rounding, and a second trip changes nothing.
  export_llmc(model, dir + "/gpt2_bf16.bin", DType::bf16);
  EXPECT_EQ(read_llmc_header(dir + "/gpt2_bf16.bin").version, 5);
  auto half = import_llmc(dir + "/gpt2_bf16.bin", Precision::fp32, ctx);
  for (size_t i = 0; i < model.params().size(); ++i) {
    const float* a = model.params()[i].master.data<float>();
    const float* b = half->params()[i].master.data<float>();
    for (int64_t k = 0; k < model.params()[i].master.numel(); ++k) {
      ASSERT_EQ(b[k], bf16_to_float(float_to_bf16(a[k])));
    }
  }
  export_llmc(*half, dir + "/again.bin", DType::bf16);
  EXPECT_EQ(read_all(dir + "/again.bin"), read_all(dir + "/gpt2_bf16.bin"));
}

TEST_F(LlmcTest, ErrorsNameTheFile) {
  Model llama(testing::small_llama(true), Precision::fp32, ctx);
  EXPECT_ERROR(export_llmc(llama, dir + "/l.bin"), "l.bin", "needs a gpt2 model");
  Model model(testing::small_gpt2(), Precision::fp32, ctx);
  export_llmc(model, dir + "/g.bin");
  std::vector<char> bytes = read_all(dir + "/g.bin");
  testing::write_file(dir + "/short.bin", std::string(bytes.begin(), bytes.end() - 4));
  EXPECT_ERROR(read_llmc_header(dir + "/short.bin"), "short.bin", "truncated");
  int32_t version = 4;
  std::memcpy(bytes.data() + 4, &version, 4);
  testing::write_file(dir + "/v4.bin", std::string(bytes.begin(), bytes.end()));
  EXPECT_ERROR(read_llmc_header(dir + "/v4.bin"), "v4.bin", "version 4");
  testing::write_file(dir + "/tiny.bin", "abc");
  EXPECT_ERROR(read_llmc_header(dir + "/tiny.bin"), "tiny.bin", "too short");
  EXPECT_ERROR(export_llmc(model, dir + "/h.bin", DType::f16), "h.bin", "f32 or bf16");
}

}  // namespace
}  // namespace meshtrain
