#include "meshtrain/plan/models.h"

#include <fmt/format.h>

#include "meshtrain/util/error.h"

namespace meshtrain::plan {
namespace {

// Mixtral: a Llama whose every feed-forward is E SwiGLU experts of width
// `expert`, top k renormalised (model/config.h MoeConfig).
ModelConfig mixtral(int64_t dim, int64_t layers, int64_t heads, int64_t kv_heads, int64_t expert,
                    int64_t experts, int64_t top_k, int64_t vocab, int64_t seq, float rope_theta) {
  ModelConfig c = llama_shape(dim, layers, heads, kv_heads, expert, vocab, seq, /*tied=*/false,
                              rope_theta);
  c.moe.experts = experts;
  c.moe.top_k = top_k;
  c.moe.hidden_dim = expert;
  c.moe.renormalize = true;
  return c;
}

// Qwen3-MoE: a Mixtral with QK-norm per head, a head width of its own and
// experts of width `expert` (moe_intermediate_size); routing renormalised.
ModelConfig qwen3_moe(int64_t dim, int64_t layers, int64_t heads, int64_t kv_heads,
                      int64_t head_dim, int64_t expert, int64_t experts, int64_t top_k,
                      int64_t vocab, int64_t seq, float rope_theta) {
  ModelConfig c = mixtral(dim, layers, heads, kv_heads, expert, experts, top_k, vocab, seq,
                          rope_theta);
  c.head_width = head_dim;
  c.qk_norm = QkNorm::head;
  c.norm_eps = 1e-6f;
  return c;
}

// DeepSeek-V3 (deepseek-ai/DeepSeek-V3 config.json): 61 layers, the first
// 3 dense (SwiGLU 18432), the others 256 routed experts of 2048 choosing 8 by
// sigmoid scores with a selection bias, 8 groups of which 4, weights
// renormalised and scaled by 2.5, plus one shared expert; multi-head latent
// attention with 128 heads. Its multi-token-prediction module (one more
// block, 14B parameters on the hub) is not counted: the 671B main model.
ModelConfig deepseek_v3() {
  ModelConfig c = llama_shape(7168, 61, 128, 128, 18432, 129280, 4096, /*tied=*/false, 1e4f);
  c.norm_eps = 1e-6f;
  c.mla = {.q_rank = 1536, .kv_rank = 512, .nope_dim = 128, .rope_dim = 64, .v_dim = 128};
  MoeConfig& m = c.moe;
  m.experts = 256;
  m.top_k = 8;
  m.hidden_dim = 2048;
  m.score = ops::RouterScore::sigmoid;
  m.renormalize = true;
  m.scaling = 2.5f;
  m.n_groups = 8;
  m.topk_groups = 4;
  m.shared_hidden = 2048;
  m.first_dense = 3;
  m.bias_update_rate = 0.001f;  // the paper's gamma for the first 14.3T tokens
  return c;
}

// Qwen2 / Qwen2.5: a Llama with q, k and v biases.
ModelConfig qwen2(int64_t dim, int64_t layers, int64_t heads, int64_t kv_heads, int64_t ffn,
                  int64_t vocab, int64_t seq) {
  ModelConfig c = llama_shape(dim, layers, heads, kv_heads, ffn, vocab, seq, /*tied=*/false, 1e6f);
  c.qkv_bias = true;
  c.norm_eps = 1e-6f;
  return c;
}

// Qwen3 (dense): per-head QK-norm and a head width of its own.
ModelConfig qwen3(int64_t dim, int64_t layers, int64_t heads, int64_t kv_heads, int64_t head_dim,
                  int64_t ffn, int64_t vocab, int64_t seq) {
  ModelConfig c = llama_shape(dim, layers, heads, kv_heads, ffn, vocab, seq, /*tied=*/false, 1e6f);
  c.head_width = head_dim;
  c.qk_norm = QkNorm::head;
  c.norm_eps = 1e-6f;
  return c;
}

// Every Llama-2 / Llama-3 model has its own lm_head.
ModelConfig llama(int64_t dim, int64_t layers, int64_t heads, int64_t kv_heads, int64_t ffn,
                  int64_t vocab, int64_t seq, float rope_theta) {
  return llama_shape(dim, layers, heads, kv_heads, ffn, vocab, seq, /*tied=*/false, rope_theta);
}

ModelConfig with_window(ModelConfig c, int64_t window) {
  c.sliding_window = window;
  return c;
}

// Shapes are the Hugging Face config.json files of the official checkpoints
// (openai-community/gpt2*, meta-llama/Llama-2-*-hf, meta-llama/Meta-Llama-3-*,
// Meta-Llama-3.1-405B); sizes as their authors publish them.
std::vector<PlanModel> published() {
  const std::string gpt2_src = "openai/gpt-2 model names (124M, 355M, 774M, 1558M); HF config.json";
  const std::string l2_src = "Llama-2 HF config.json; sizes 6.74B / 13.0B / 69.0B as the HF hub lists them";
  const std::string l3_src = "Llama-3 HF config.json; sizes 8B / 70B / 405B (Llama 3 paper, table 3)";
  const std::string l1_src = "LLaMA 65B (Touvron et al. 2023, table 2: 65.2B), the QLoRA paper's largest model";
  const std::string mixtral_src =
      "mistralai/Mixtral-8x7B-v0.1 and Mixtral-8x22B-v0.1 HF config.json; sizes 46.7B (Mixtral "
      "paper, section 2) and 141B (Mistral's announcement)";
  return {
      {"gpt2-124m", gpt_dense(12, 768, 12, 50257, 1024), 124e6, gpt2_src},
      {"gpt2-350m", gpt_dense(24, 1024, 16, 50257, 1024), 355e6, gpt2_src},
      {"gpt2-774m", gpt_dense(36, 1280, 20, 50257, 1024), 774e6, gpt2_src},
      {"gpt2-1.5b", gpt_dense(48, 1600, 25, 50257, 1024), 1558e6, gpt2_src},
      {"llama1-65b", llama(8192, 80, 64, 64, 22016, 32000, 2048, 1e4f), 65.2e9, l1_src},
      {"llama2-7b", llama(4096, 32, 32, 32, 11008, 32000, 4096, 1e4f), 6.74e9, l2_src},
      {"llama2-13b", llama(5120, 40, 40, 40, 13824, 32000, 4096, 1e4f), 13.0e9, l2_src},
      {"llama2-70b", llama(8192, 80, 64, 8, 28672, 32000, 4096, 1e4f), 69.0e9, l2_src},
      {"llama3-8b", llama(4096, 32, 32, 8, 14336, 128256, 8192, 5e5f), 8e9, l3_src},
      {"llama3-70b", llama(8192, 80, 64, 8, 28672, 128256, 8192, 5e5f), 70e9, l3_src},
      {"llama3-405b", llama(16384, 126, 128, 8, 53248, 128256, 8192, 5e5f), 405e9, l3_src},
      {"mixtral-8x7b", mixtral(4096, 32, 32, 8, 14336, 8, 2, 32000, 32768, 1e6f), 46.7e9,
       mixtral_src},
      {"mixtral-8x22b", mixtral(6144, 56, 48, 8, 16384, 8, 2, 32768, 65536, 1e6f), 141e9,
       mixtral_src},
      {"qwen3-30b-a3b", qwen3_moe(2048, 48, 32, 4, 128, 768, 128, 8, 151936, 40960, 1e6f),
       30.5e9,
       "Qwen/Qwen3-30B-A3B HF config.json; 30.5B total, 3.3B activated (its model card)"},
      {"qwen3-235b-a22b",
       qwen3_moe(4096, 94, 64, 4, 128, 1536, 128, 8, 151936, 40960, 1e6f), 235e9,
       "Qwen/Qwen3-235B-A22B HF config.json; 235B total, 22B activated (its model card)"},
      {"qwen2.5-7b", qwen2(3584, 28, 28, 4, 18944, 152064, 32768), 7.61e9,
       "Qwen/Qwen2.5-7B HF config.json; 7.61B (its model card)"},
      {"qwen3-8b", qwen3(4096, 36, 32, 8, 128, 12288, 151936, 40960), 8.2e9,
       "Qwen/Qwen3-8B HF config.json; 8.2B (its model card)"},
      // Its sliding window of 4096 prices attention past 4096 tokens (attention_seq).
      {"mistral-7b", with_window(llama(4096, 32, 32, 8, 14336, 32000, 32768, 1e4f), 4096), 7.24e9,
       "mistralai/Mistral-7B-v0.1 HF config.json; 7.24B (the Mistral 7B paper's table 1: 7.3B)"},
      {"deepseek-v3", deepseek_v3(), 671e9,
       "deepseek-ai/DeepSeek-V3 HF config.json; 671B total, 37B activated (DeepSeek-V3 "
       "technical report, section 2), without the 14B multi-token-prediction module"},
  };
}

}  // namespace

ModelConfig gpt_dense(int64_t layers, int64_t hidden, int64_t heads, int64_t vocab,
                      int64_t max_seq) {
  return gpt2_shape(hidden, layers, heads, vocab, max_seq);
}

PlanModel plan_model(std::string_view name) {
  for (PlanModel& m : published()) {
    if (m.name == name) return m;
  }
  for (const std::string& engine : model_preset_names()) {
    if (engine == name) return {engine, model_preset(engine), 0, "meshtrain preset (model/config.cpp)"};
  }
  std::vector<std::string> known = plan_model_names();
  for (const std::string& engine : model_preset_names()) known.push_back(engine);
  fail("plan: unknown model '{}' (known: {}; or give --layers/--hidden/--heads/--vocab)", name,
       fmt::join(known, ", "));
}

std::vector<std::string> plan_model_names() {
  std::vector<std::string> names;
  for (const PlanModel& m : published()) names.push_back(m.name);
  return names;
}

}  // namespace meshtrain::plan
