#include "meshtrain/model/config.h"

#include <cmath>
#include <numbers>

#include <algorithm>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "meshtrain/backend/backend.h"
#include "meshtrain/model/params.h"
#include "meshtrain/util/error.h"

namespace meshtrain {

namespace {

// Indexed by Family.
const Recipe kRecipes[] = {
    {.name = "llama",
     .norm = NormKind::rms,
     .feed_forward = FeedForward::swiglu,
     .positions = Positions::rope,
     .linear_bias = false,
     .grouped_query = true,
     .always_tied = false,
     .conv1d = false,
     .dropout = false,
     .omittable_prefix = "",
     .layer_prefix = "model.layers.{}.",
     .norm_modules = {"input_layernorm", "post_attention_layernorm"},
     .gemm_modules = {{{"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"},
                       {"self_attn.o_proj"},
                       {"mlp.gate_proj", "mlp.up_proj"},
                       {"mlp.down_proj"}}},
     .lora_targets = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},
     .lora_default = {"q_proj", "v_proj"}},
    {.name = "gpt2",
     .norm = NormKind::layer,
     .feed_forward = FeedForward::gelu,
     .positions = Positions::learned,
     .linear_bias = true,
     .grouped_query = false,
     .always_tied = true,
     .conv1d = true,
     .dropout = true,
     .omittable_prefix = "transformer.",
     .layer_prefix = "transformer.h.{}.",
     .norm_modules = {"ln_1", "ln_2"},
     .gemm_modules = {{{"attn.c_attn"}, {"attn.c_proj"}, {"mlp.c_fc"}, {"mlp.c_proj"}}},
     .lora_targets = {"c_attn", "c_proj", "c_fc"},
     .lora_default = {"c_attn"}},
};

}  // namespace

const Recipe& recipe(Family family) { return kRecipes[static_cast<size_t>(family)]; }

std::string_view family_name(Family family) { return recipe(family).name; }

std::vector<std::string> family_names() {
  std::vector<std::string> names;
  for (const Recipe& r : kRecipes) names.emplace_back(r.name);
  return names;
}

Family parse_family(std::string_view name, std::string_view field) {
  std::vector<std::string> known;
  for (size_t i = 0; i < std::size(kRecipes); ++i) {
    if (kRecipes[i].name == name) return static_cast<Family>(i);
    known.push_back(fmt::format("\"{}\"", kRecipes[i].name));
  }
  fail("{} must be {}, got \"{}\"", field, fmt::join(known, " or "), name);
}

Precision parse_precision(std::string_view name) {
  if (name == "fp32") return Precision::fp32;
  if (name == "bf16") return Precision::bf16;
  if (name == "fp16") return Precision::fp16;
  fail("unknown precision '{}' (expected \"fp32\", \"bf16\" or \"fp16\")", name);
}

std::string_view precision_name(Precision precision) {
  switch (precision) {
    case Precision::bf16: return "bf16";
    case Precision::fp16: return "fp16";
    case Precision::fp32: break;
  }
  return "fp32";
}

Recompute parse_recompute(std::string_view name) {
  if (name == "none") return Recompute::none;
  if (name == "selective") return Recompute::selective;
  if (name == "full") return Recompute::full;
  fail("unknown recompute '{}' (expected none, selective, full)", name);
}

std::string_view recompute_name(Recompute recompute) {
  switch (recompute) {
    case Recompute::selective: return "selective";
    case Recompute::full: return "full";
    case Recompute::none: break;
  }
  return "none";
}

namespace {

void validate_mla(const ModelConfig& c) {
  const MlaConfig& m = c.mla;
  if (!m.enabled()) return;
  MESHTRAIN_CHECK(c.recipe().positions == Positions::rope,
                  "model.mla: latent attention needs a RoPE family, not {}", c.recipe().name);
  MESHTRAIN_CHECK(m.q_rank >= 0 && m.nope_dim > 0 && m.rope_dim > 0 && m.rope_dim % 2 == 0 &&
                      m.v_dim > 0,
                  "model.mla: needs q_rank >= 0, nope_dim > 0, an even rope_dim > 0 and v_dim > 0");
  MESHTRAIN_CHECK(c.n_kv_heads == c.n_heads,
                  "model.mla: every head has its own key and value (n_kv_heads = n_heads)");
}

void validate_moe(const ModelConfig& c) {
  const MoeConfig& m = c.moe;
  if (!m.enabled()) {
    MESHTRAIN_CHECK(m.experts == 0, "moe.experts: must be >= 0, got {}", m.experts);
    return;
  }
  MESHTRAIN_CHECK(c.recipe().feed_forward == FeedForward::swiglu && !c.recipe().linear_bias,
                  "moe: {} blocks cannot be mixtures of experts yet (SwiGLU experts "
                  "without biases only)",
                  c.recipe().name);
  MESHTRAIN_CHECK(m.top_k >= 1 && m.top_k <= m.experts,
                  "moe.top_k: must be in [1, experts = {}], got {}", m.experts, m.top_k);
  MESHTRAIN_CHECK(m.hidden_dim > 0, "moe.hidden_dim: must be > 0, got {}", m.hidden_dim);
  MESHTRAIN_CHECK(m.n_groups >= 1 && m.experts % m.n_groups == 0,
                  "moe.n_groups: {} must divide experts = {}", m.n_groups, m.experts);
  MESHTRAIN_CHECK(m.topk_groups >= 1 && m.topk_groups <= m.n_groups &&
                      m.top_k <= m.topk_groups * (m.experts / m.n_groups),
                  "moe.topk_groups: {} of n_groups = {} must hold top_k = {} experts",
                  m.topk_groups, m.n_groups, m.top_k);
  MESHTRAIN_CHECK(std::isfinite(m.scaling) && m.scaling > 0,
                  "moe.scaling: must be > 0, got {}", m.scaling);
  MESHTRAIN_CHECK(m.shared_hidden >= 0, "moe.shared_hidden: must be >= 0, got {}",
                  m.shared_hidden);
  MESHTRAIN_CHECK(!m.shared_gate || m.shared_hidden > 0,
                  "moe.shared_gate: needs shared experts (shared_hidden > 0)");
  MESHTRAIN_CHECK(m.first_dense >= 0 && m.first_dense < c.n_layers,
                  "moe.first_dense: must be in [0, n_layers = {}), got {}", c.n_layers,
                  m.first_dense);
  MESHTRAIN_CHECK(m.every >= 1, "moe.every: must be >= 1, got {}", m.every);
  MESHTRAIN_CHECK(m.aux_loss >= 0 && std::isfinite(m.aux_loss),
                  "moe.aux_loss: must be >= 0, got {}", m.aux_loss);
  MESHTRAIN_CHECK(m.z_loss >= 0 && std::isfinite(m.z_loss),
                  "moe.z_loss: must be >= 0, got {}", m.z_loss);
  MESHTRAIN_CHECK(!m.aux_per_step || m.aux_loss > 0,
                  "moe.aux_scope: \"step\" counts the load-balancing loss's statistic over the "
                  "step, which needs moe.aux_loss > 0");
  MESHTRAIN_CHECK(m.bias_update_rate >= 0 && std::isfinite(m.bias_update_rate),
                  "moe.bias_update_rate: must be >= 0 (0: off), got {}", m.bias_update_rate);
  MESHTRAIN_CHECK(m.capacity_factor >= 0 && std::isfinite(m.capacity_factor),
                  "moe.capacity_factor: must be >= 0 (0: dropless), got {}", m.capacity_factor);
  MESHTRAIN_CHECK(!c.lora.enabled(), "lora: LoRA on a mixture of experts is not supported yet");
}

}  // namespace

void ModelConfig::validate() const {
  auto positive = [](std::string_view field, int64_t value) {
    MESHTRAIN_CHECK(value > 0, "model.{}: must be > 0, got {}", field, value);
  };
  positive("dim", dim);
  positive("n_layers", n_layers);
  positive("n_heads", n_heads);
  positive("n_kv_heads", n_kv_heads);
  positive("hidden_dim", hidden_dim);
  positive("vocab_size", vocab_size);
  positive("max_seq_len", max_seq_len);
  MESHTRAIN_CHECK(head_width >= 0, "model.head_dim: must be >= 0 (0: dim / n_heads), got {}",
                  head_width);
  MESHTRAIN_CHECK(head_width > 0 || dim % n_heads == 0,
                  "model.n_heads: {} does not divide dim {} (or set model.head_dim)", n_heads, dim);
  MESHTRAIN_CHECK(n_heads % n_kv_heads == 0, "model.n_kv_heads: {} does not divide n_heads {}",
                  n_kv_heads, n_heads);
  MESHTRAIN_CHECK(vocab_size <= (int64_t{1} << 31) - 1, "model.vocab_size: {} does not fit int32",
                  vocab_size);
  MESHTRAIN_CHECK(norm_eps > 0, "model.norm_eps: must be > 0, got {}", norm_eps);
  MESHTRAIN_CHECK(init_std > 0, "model.init_std: must be > 0, got {}", init_std);
  const Recipe& r = recipe();
  if (r.positions == Positions::rope) {
    MESHTRAIN_CHECK(head_dim() % 2 == 0, "model.head_dim: {} must be even for RoPE", head_dim());
    MESHTRAIN_CHECK(rope_theta > 0, "model.rope_theta: must be > 0, got {}", rope_theta);
    const RopeScaling& s = rope_scaling;
    if (s.type != RopeType::none) {
      MESHTRAIN_CHECK(s.factor > 0, "model.rope_scaling.factor: must be > 0, got {}", s.factor);
    }
    if (s.type == RopeType::llama3) {
      MESHTRAIN_CHECK(s.low_freq_factor > 0 && s.high_freq_factor > s.low_freq_factor,
                      "model.rope_scaling: llama3 needs 0 < low_freq_factor < high_freq_factor, "
                      "got {} and {}", s.low_freq_factor, s.high_freq_factor);
      MESHTRAIN_CHECK(s.original_max_seq > 0,
                      "model.rope_scaling.original_max_seq: must be > 0, got {}",
                      s.original_max_seq);
    }
  } else {
    MESHTRAIN_CHECK(rope_scaling.type == RopeType::none,
                    "model.rope_scaling: {} has no RoPE (learned positions)", r.name);
    // These options belong to the rope families' attention (Qwen2, Qwen3, OLMoE).
    MESHTRAIN_CHECK(head_width == 0 || head_width * n_heads == dim,
                    "model.head_dim: {} has no head width of its own (dim / n_heads = {})",
                    r.name, dim / n_heads);
    MESHTRAIN_CHECK(!qkv_bias, "model.qkv_bias: {} has biases on every linear layer already",
                    r.name);
    MESHTRAIN_CHECK(qk_norm == QkNorm::none, "model.qk_norm: not implemented for {}", r.name);
  }
  MESHTRAIN_CHECK(sliding_window >= 0, "model.sliding_window: must be >= 0 (0: none), got {}",
                  sliding_window);
  MESHTRAIN_CHECK(qk_norm == QkNorm::none || r.norm == NormKind::rms,
                  "model.qk_norm: {} normalises with LayerNorm; QK-norm is an RMSNorm", r.name);
  MESHTRAIN_CHECK(r.grouped_query || n_kv_heads == n_heads,
                  "model.n_kv_heads: {} has no grouped-query attention, so it must equal "
                  "n_heads {} (got {})",
                  r.name, n_heads, n_kv_heads);
  MESHTRAIN_CHECK(!r.always_tied || tie_embeddings,
                  "model.tie_embeddings: {} always ties its output layer", r.name);
  MESHTRAIN_CHECK(lora.quantize_base == BaseQuant::none || lora.rank >= 1,
                  "lora.quantize_base: \"{}\" quantises the frozen base of a LoRA run; it needs "
                  "lora.rank >= 1",
                  base_quant_name(lora.quantize_base));
  if (lora.rank != 0 || !lora.targets.empty()) {
    MESHTRAIN_CHECK(lora.rank >= 1, "lora.rank: must be >= 1 (0 or no [lora] section: no LoRA), got {}",
                    lora.rank);
    MESHTRAIN_CHECK(std::isfinite(lora.alpha) && lora.alpha > 0, "lora.alpha: must be > 0, got {}",
                    lora.alpha);
    MESHTRAIN_CHECK(lora.dropout >= 0 && lora.dropout < 1, "lora.dropout: must be in [0, 1), got {}",
                    lora.dropout);
    const std::vector<std::string> known = lora_target_names(family);
    for (const std::string& t : lora.targets) {
      MESHTRAIN_CHECK(std::find(known.begin(), known.end(), t) != known.end(),
                      "lora.targets: \"{}\" is not a {} module; choose from {}", t,
                      family_name(family), fmt::join(known, ", "));
    }
  }
  validate_moe(*this);
  validate_mla(*this);
}

ModelConfig::QkNormSizes ModelConfig::qk_norm_sizes(double q, double kv) const {
  if (qk_norm == QkNorm::none) return {};
  const auto hd = static_cast<double>(head_dim());
  const bool per_head = qk_norm == QkNorm::head;
  return {per_head ? 2 * hd : q + kv, q + kv + (per_head ? (q + kv) / hd : 2)};
}

std::string_view qk_norm_name(QkNorm norm) {
  switch (norm) {
    case QkNorm::head: return "head";
    case QkNorm::full: return "full";
    case QkNorm::none: break;
  }
  return "none";
}

QkNorm parse_qk_norm(std::string_view name) {
  for (QkNorm n : {QkNorm::none, QkNorm::head, QkNorm::full}) {
    if (name == qk_norm_name(n)) return n;
  }
  fail("model.qk_norm: unknown QK-norm \"{}\" (none, head, full)", name);
}

std::string_view router_score_name(ops::RouterScore score) {
  return score == ops::RouterScore::sigmoid ? "sigmoid" : "softmax";
}

ops::RouterScore parse_router_score(std::string_view name) {
  if (name == "softmax") return ops::RouterScore::softmax;
  if (name == "sigmoid") return ops::RouterScore::sigmoid;
  fail("moe.score: unknown router score \"{}\" (softmax, sigmoid)", name);
}

std::string_view base_quant_name(BaseQuant quant) {
  return quant == BaseQuant::nf4 ? "nf4" : "none";
}

BaseQuant parse_base_quant(std::string_view name) {
  if (name == "none") return BaseQuant::none;
  if (name == "nf4") return BaseQuant::nf4;
  fail("lora.quantize_base: unknown quantisation \"{}\" (none, nf4)", name);
}

std::vector<std::string> lora_target_names(Family family) { return recipe(family).lora_targets; }

std::vector<std::string> lora_targets(const LoraConfig& lora, Family family) {
  if (!lora.enabled()) return {};
  if (!lora.targets.empty()) return lora.targets;
  return recipe(family).lora_default;
}

std::string_view rope_type_name(RopeType type) {
  switch (type) {
    case RopeType::none: return "default";
    case RopeType::linear: return "linear";
    case RopeType::llama3: return "llama3";
  }
  return "default";
}

std::vector<float> ModelConfig::rope_frequencies() const {
  std::vector<float> freq = ops::rope_inv_freq(head_dim(), rope_theta);
  const RopeScaling& r = rope_scaling;
  if (r.type == RopeType::linear) {
    for (float& f : freq) f /= r.factor;
  } else if (r.type == RopeType::llama3) {
    // HF's _compute_llama3_parameters, step for step in float.
    const float old_len = static_cast<float>(r.original_max_seq);
    const float low_freq_wavelen = old_len / r.low_freq_factor;
    const float high_freq_wavelen = old_len / r.high_freq_factor;
    for (float& f : freq) {
      const float wavelen = 2.0f * std::numbers::pi_v<float> / f;
      const float scaled = wavelen > low_freq_wavelen ? f / r.factor : f;
      const bool medium = !(wavelen < high_freq_wavelen) && !(wavelen > low_freq_wavelen);
      if (medium) {
        const float smooth =
            (old_len / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
        f = (1.0f - smooth) * scaled / r.factor + smooth * scaled;
      } else {
        f = scaled;
      }
    }
  }
  return freq;
}

int64_t ModelConfig::num_params() const {
  int64_t total = 0;
  // The base model's (what exports hold); LoRA adapters are not counted.
  for (const ParamSpec& spec : build_param_specs(*this)) {
    if (!spec.lora_adapter) total += spec.numel();
  }
  return total;
}

double ModelConfig::attention_seq(double seq) const {
  const auto w = static_cast<double>(sliding_window);
  if (w <= 0 || w >= seq) return seq;
  const double causal = seq * (seq + 1) / 2, windowed = w * (w + 1) / 2 + (seq - w) * w;
  return seq * windowed / causal;
}

double ModelConfig::train_flops_per_token(int64_t seq) const {
  // 6 FLOPs per weight (forward, d input, d weight); a frozen weight (LoRA)
  // has no weight gradient: 4.
  double matmul_flops = 0;
  for (const ParamSpec& spec : build_param_specs(*this)) {
    if (spec.matmul_weight || spec.f32_gemm) {
      matmul_flops += (spec.trainable ? 6.0 : 4.0) * spec.active * static_cast<double>(spec.numel());
    }
  }
  // A tied embedding is a matmul weight already; an untied one is a lookup
  // and lm_head is the output layer.
  return matmul_flops + 12.0 * static_cast<double>(n_layers) *
                            attention_seq(static_cast<double>(seq)) *
                            static_cast<double>(attention_width());
}

ModelConfig llama_shape(int64_t dim, int64_t layers, int64_t heads, int64_t kv_heads,
                        int64_t hidden, int64_t vocab, int64_t max_seq, bool tied,
                        float rope_theta) {
  ModelConfig c;
  c.family = Family::llama;
  c.dim = dim;
  c.n_layers = layers;
  c.n_heads = heads;
  c.n_kv_heads = kv_heads;
  c.hidden_dim = hidden;
  c.vocab_size = vocab;
  c.max_seq_len = max_seq;
  c.norm_eps = 1e-5f;
  c.rope_theta = rope_theta;
  c.tie_embeddings = tied;
  return c;
}

ModelConfig gpt2_shape(int64_t dim, int64_t layers, int64_t heads, int64_t vocab,
                       int64_t max_seq) {
  ModelConfig c;
  c.family = Family::gpt2;
  c.dim = dim;
  c.n_layers = layers;
  c.n_heads = heads;
  c.n_kv_heads = heads;
  c.hidden_dim = 4 * dim;
  c.vocab_size = vocab;
  c.max_seq_len = max_seq;
  c.norm_eps = 1e-5f;
  c.tie_embeddings = true;
  return c;
}

ModelConfig model_preset(std::string_view name) {
  // llama-tiny: a byte-level model for quick runs; untied like Llama 2.
  if (name == "llama-tiny") return llama_shape(64, 2, 4, 2, 176, 256, 128, false);
  // llama-60M: the benchmark model. Tied output: 53.0M parameters (untied would be
  // 78.7M; 27.3M of it is non-embedding), so tied is the closer reading of the name.
  if (name == "llama-60M") return llama_shape(512, 8, 8, 8, 1536, 50257, 256, true);
  // llama2.c's stories260K (tied output).
  if (name == "stories260K") return llama_shape(64, 5, 8, 4, 172, 512, 512, true);
  if (name == "gpt2-124M") return gpt2_shape(768, 12, 12, 50257, 1024);
  fail("unknown model preset '{}' (known: {})", name, fmt::join(model_preset_names(), ", "));
}

std::vector<std::string> model_preset_names() {
  return {"llama-tiny", "llama-60M", "gpt2-124M", "stories260K"};
}

}  // namespace meshtrain
