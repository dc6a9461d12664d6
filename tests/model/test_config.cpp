#include <gtest/gtest.h>

#include <string>

#include "meshtrain/model/config.h"
#include "meshtrain/model/params.h"
#include "meshtrain/util/error.h"

namespace meshtrain {
namespace {

TEST(ModelConfig, PresetParameterCounts) {
  // Hugging Face's gpt2 has exactly this many parameters.
  EXPECT_EQ(model_preset("gpt2-124M").num_params(), 124'439'808);

  // stories260K from its shape: embedding + 5 layers of (2 norms, q, k, v, o, SwiGLU) + norm.
  const int64_t d = 64, kv = 4 * 8, hidden = 172;
  const int64_t layer = 2 * d + d * d + 2 * kv * d + d * d + 3 * d * hidden;
  EXPECT_EQ(model_preset("stories260K").num_params(), 512 * d + 5 * layer + d);
  EXPECT_EQ(model_preset("stories260K").num_params(), 260'032);

  // llama-60M is tied: 53.0M (untied it would be 78.7M).
  const ModelConfig l60 = model_preset("llama-60M");
  EXPECT_TRUE(l60.tie_embeddings);
  EXPECT_EQ(l60.num_params(), 53'003'264);

  for (const std::string& name : model_preset_names()) {
    EXPECT_NO_THROW(model_preset(name).validate()) << name;
  }
  EXPECT_THROW(model_preset("llama-7B"), Error);
}

TEST(ModelConfig, TrainFlopsCountMatmulsAndAttention) {
  const ModelConfig c = model_preset("gpt2-124M");
  // Matmul weights: 12 layers of (c_attn, attn c_proj, c_fc, mlp c_proj) + the tied classifier.
  const double matmul = 12.0 * (768.0 * 2304 + 768.0 * 768 + 2.0 * 768 * 3072) + 50257.0 * 768;
  EXPECT_DOUBLE_EQ(c.train_flops_per_token(1024), 6 * matmul + 12.0 * 12 * 1024 * 768);

  // An untied llama counts lm_head but not the embedding lookup.
  ModelConfig t = model_preset("llama-tiny");
  ASSERT_FALSE(t.tie_embeddings);
  const double layer = 64.0 * 64 + 2.0 * 32 * 64 + 64.0 * 64 + 3.0 * 64 * 176;
  EXPECT_DOUBLE_EQ(t.train_flops_per_token(100), 6 * (2 * layer + 256.0 * 64) + 12.0 * 2 * 100 * 64);

  // LoRA on q and v (rank 4): the frozen weights lose their weight gradient
  // (4 per weight), the adapters count 6; num_params stays the base's.
  ModelConfig l = t;
  l.lora.rank = 4;
  const double adapters = 2.0 * 4.0 * (64 + 64) + 2.0 * 4.0 * (64 + 32);
  EXPECT_DOUBLE_EQ(l.train_flops_per_token(100),
                   4 * (2 * layer + 256.0 * 64) + 6 * adapters + 12.0 * 2 * 100 * 64);
  EXPECT_EQ(l.num_params(), t.num_params());
}

std::string validate_message(const ModelConfig& c) {
  try {
    c.validate();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(ModelConfig, ValidateNamesTheField) {
  ModelConfig c = model_preset("llama-tiny");
  c.n_heads = 7;
  EXPECT_EQ(validate_message(c), "model.n_heads: 7 does not divide dim 64 (or set model.head_dim)");

  c = model_preset("llama-tiny");
  c.n_kv_heads = 3;
  EXPECT_NE(validate_message(c).find("model.n_kv_heads: 3 does not divide n_heads 4"),
            std::string::npos);

  c = model_preset("llama-tiny");
  c.dim = 0;
  EXPECT_NE(validate_message(c).find("model.dim"), std::string::npos);

  c = model_preset("llama-tiny");
  c.vocab_size = -1;
  EXPECT_NE(validate_message(c).find("model.vocab_size"), std::string::npos);

  c = model_preset("llama-tiny");
  c.norm_eps = 0;
  EXPECT_NE(validate_message(c).find("model.norm_eps"), std::string::npos);

  c = model_preset("llama-tiny");
  c.n_heads = 32;  // head_dim 2 is fine, 64/64 = 1 is odd
  EXPECT_EQ(validate_message(c), "");
  c.n_heads = 64;
  c.n_kv_heads = 64;
  EXPECT_NE(validate_message(c).find("must be even for RoPE"), std::string::npos);

  c = model_preset("gpt2-124M");
  c.n_kv_heads = 4;
  EXPECT_NE(validate_message(c).find("model.n_kv_heads"), std::string::npos);

  c = model_preset("gpt2-124M");
  c.tie_embeddings = false;
  EXPECT_NE(validate_message(c).find("model.tie_embeddings"), std::string::npos);
}

TEST(ModelConfig, ParsesNames) {
  EXPECT_EQ(parse_family("llama"), Family::llama);
  EXPECT_EQ(parse_family("gpt2"), Family::gpt2);
  EXPECT_EQ(family_name(Family::gpt2), "gpt2");
  EXPECT_THROW(parse_family("mamba"), Error);
  EXPECT_EQ(parse_precision("bf16"), Precision::bf16);
  EXPECT_EQ(parse_precision("fp16"), Precision::fp16);
  EXPECT_EQ(precision_name(Precision::fp16), "fp16");
  EXPECT_EQ(compute_dtype(Precision::fp16), DType::f16);
  EXPECT_EQ(precision_name(Precision::fp32), "fp32");
  EXPECT_THROW(parse_precision("fp8"), Error);
}

}  // namespace
}  // namespace meshtrain
