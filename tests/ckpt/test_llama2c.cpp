// llama2.c legacy (v0) files: round trip, header and size validation.
#include <gtest/gtest.h>

#include <array>
#include <cstring>

#include "meshtrain/ckpt/llama2c.h"
#include "util.h"

namespace meshtrain {
namespace {

using testing::read_file;
using testing::write_file;

class Llama2c : public ckpt_test::CkptTest {};

TEST_F(Llama2c, TiedRoundTripAndLayout) {
  Model model(testing::small_llama(true), Precision::fp32, ctx);
  model.init_weights(5);
  const std::string path = dir + "/m.bin";
  export_llama2c(model, path);
  const std::string bytes = read_file(path);
  std::array<int32_t, 7> header{};
  std::memcpy(header.data(), bytes.data(), 28);
  EXPECT_EQ(header, (std::array<int32_t, 7>{16, 24, 2, 4, 2, 19, 8}));  // positive vocab: tied
  // The first tensor is the embedding; wq of layer 0 follows both layers' rms_att.
  EXPECT_EQ(std::memcmp(bytes.data() + 28, model.param("model.embed_tokens.weight").master.raw(), 4), 0);
  const size_t wq0 = 28 + 4 * (19 * 16 + 2 * 16);
  EXPECT_EQ(std::memcmp(bytes.data() + wq0,
                        model.param("model.layers.0.self_attn.q_proj.weight").master.raw(), 16 * 16 * 4), 0);

  auto back = import_llama2c(path, Precision::fp32, ctx);
  EXPECT_TRUE(back->config().tie_embeddings);
  for (size_t i = 0; i < model.params().size(); ++i) {
    EXPECT_EQ(std::memcmp(model.params()[i].master.raw(), back->params()[i].master.raw(),
                          model.params()[i].master.bytes()), 0);
  }
}

TEST_F(Llama2c, UntiedHeaderHasNegativeVocab) {
  Model model(testing::small_llama(false), Precision::fp32, ctx);
  const std::string path = dir + "/m.bin";
  export_llama2c(model, path);
  int32_t vocab = 0;
  std::memcpy(&vocab, read_file(path).data() + 20, 4);
  EXPECT_EQ(vocab, -19);
  EXPECT_FALSE(read_llama2c_config(path).tie_embeddings);
}

TEST_F(Llama2c, TruncatedOrPaddedFileIsAnError) {
  Model model(testing::small_llama(true), Precision::fp32, ctx);
  const std::string path = dir + "/m.bin";
  export_llama2c(model, path);
  const std::string bytes = read_file(path);
  write_file(path, bytes.substr(0, bytes.size() - 4));
  EXPECT_ERROR(import_llama2c(path, Precision::fp32, ctx), "m.bin",
               fmt::format("file is {} bytes but its header", bytes.size() - 4));
  write_file(path, bytes + "xxxx");
  EXPECT_ERROR(import_llama2c(path, Precision::fp32, ctx), "m.bin", "truncated or not a llama2.c");
  write_file(path, bytes.substr(0, 10));
  EXPECT_ERROR(import_llama2c(path, Precision::fp32, ctx), "m.bin", "too short for the 28-byte");
}

TEST_F(Llama2c, BadHeadersAreErrors) {
  const std::string path = dir + "/h.bin";
  auto write_header = [&](std::array<int32_t, 7> h) {
    write_file(path, std::string(reinterpret_cast<const char*>(h.data()), 28) + std::string(1 << 20, '\0'));
  };
  write_header({-64, 172, 5, 8, 4, 512, 512});
  EXPECT_ERROR(read_llama2c_config(path), "h.bin", "header dim = -64 is out of range");
  write_header({64, 172, 5, 8, 3, 512, 512});
  EXPECT_ERROR(read_llama2c_config(path), "h.bin", "header describes an invalid model");
  write_header({0x616b3432, 1, 0, 0, 0, 0, 0});
  EXPECT_ERROR(read_llama2c_config(path), "h.bin", "version 1+");
  EXPECT_ERROR(read_llama2c_config(dir + "/missing.bin"), "missing.bin", "cannot open");
}

TEST_F(Llama2c, ExportRejectsWhatTheFormatCannotHold) {
  Model gpt2(testing::small_gpt2(), Precision::fp32, ctx);
  EXPECT_ERROR(export_llama2c(gpt2, dir + "/g.bin"), "g.bin", "needs a llama model");
  ModelConfig c = testing::small_llama(true);
  c.rope_theta = 500000.0f;
  Model llama(c, Precision::fp32, ctx);
  EXPECT_ERROR(export_llama2c(llama, dir + "/l.bin"), "l.bin", "rope_theta 10000");
  EXPECT_FALSE(std::filesystem::exists(dir + "/l.bin"));
}

}  // namespace
}  // namespace meshtrain
