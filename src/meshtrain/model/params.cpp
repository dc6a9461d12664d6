#include "meshtrain/model/params.h"

#include <fmt/format.h>

#include <cmath>

#include "meshtrain/util/rng.h"

namespace meshtrain {

DType param_compute_dtype(const ParamSpec& spec, Precision precision) {
  return spec.matmul_weight ? compute_dtype(precision) : DType::f32;
}

void init_parameter(const ParamSpec& spec, uint64_t seed, float* out) {
  const int64_t n = spec.numel();
  switch (spec.init) {
    case InitKind::zeros:
      for (int64_t i = 0; i < n; ++i) out[i] = 0.0f;
      return;
    case InitKind::ones:
      for (int64_t i = 0; i < n; ++i) out[i] = 1.0f;
      return;
    case InitKind::normal: {
      const uint64_t key = stream_key(seed, spec.name);
      const float scale = spec.init_std;
      // Each element is a function of (key, index), so any thread split gives the same values.
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < n; ++i) out[i] = scale * normal_at(key, static_cast<uint64_t>(i));
      return;
    }
  }
}

namespace {

class Registry {
 public:
  explicit Registry(const ModelConfig& config) : config_(config) {}

  // Starts a unit at the next parameter; it ends where the next one starts.
  void unit(std::string name) {
    if (!units_.empty()) units_.back().end_param = specs_.size();
    units_.push_back(ParamUnit{std::move(name), specs_.size(), specs_.size()});
  }

  // A linear/embedding weight; `residual_out` marks projections that write into
  // the residual stream (scaled by 1/sqrt(2 * n_layers), GPT-2's convention).
  void weight(std::string name, Shape shape, bool matmul, bool residual_out = false) {
    ParamSpec spec;
    spec.name = std::move(name);
    spec.shape = std::move(shape);
    spec.role = ParamRole::decay;
    spec.init = InitKind::normal;
    spec.init_std = config_.init_std;
    if (residual_out) {
      spec.init_std /= std::sqrt(2.0f * static_cast<float>(config_.n_layers));
    }
    spec.matmul_weight = matmul;
    specs_.push_back(std::move(spec));
  }
  void norm_weight(std::string name, int64_t n) { vector(std::move(name), n, InitKind::ones); }
  void bias(std::string name, int64_t n) { vector(std::move(name), n, InitKind::zeros); }

  std::vector<ParamSpec> take_specs() { return std::move(specs_); }
  std::vector<ParamUnit> take_units() {
    units_.back().end_param = specs_.size();
    return std::move(units_);
  }

 private:
  void vector(std::string name, int64_t n, InitKind init) {
    ParamSpec spec;
    spec.name = std::move(name);
    spec.shape = {n};
    spec.role = ParamRole::no_decay;
    spec.init = init;
    spec.init_std = 0.0f;
    specs_.push_back(std::move(spec));
  }

  const ModelConfig& config_;
  std::vector<ParamSpec> specs_;
  std::vector<ParamUnit> units_;
};

void llama_registry(const ModelConfig& c, Registry& r) {
  const int64_t d = c.dim, hd = c.head_dim();
  const int64_t q_width = c.n_heads * hd, kv_width = c.n_kv_heads * hd;
  r.unit("embed");
  r.weight("model.embed_tokens.weight", {c.vocab_size, d}, c.tie_embeddings);
  for (int64_t i = 0; i < c.n_layers; ++i) {
    const std::string p = fmt::format("model.layers.{}.", i);
    r.unit(fmt::format("layers.{}", i));
    r.norm_weight(p + "input_layernorm.weight", d);
    r.weight(p + "self_attn.q_proj.weight", {q_width, d}, true);
    r.weight(p + "self_attn.k_proj.weight", {kv_width, d}, true);
    r.weight(p + "self_attn.v_proj.weight", {kv_width, d}, true);
    r.weight(p + "self_attn.o_proj.weight", {d, q_width}, true, true);
    r.norm_weight(p + "post_attention_layernorm.weight", d);
    r.weight(p + "mlp.gate_proj.weight", {c.hidden_dim, d}, true);
    r.weight(p + "mlp.up_proj.weight", {c.hidden_dim, d}, true);
    r.weight(p + "mlp.down_proj.weight", {d, c.hidden_dim}, true, true);
  }
  r.unit("head");
  r.norm_weight("model.norm.weight", d);
  if (!c.tie_embeddings) r.weight("lm_head.weight", {c.vocab_size, d}, true);
}

// Hugging Face GPT-2 uses Conv1D: weights are stored [in, out].
void gpt2_registry(const ModelConfig& c, Registry& r) {
  const int64_t d = c.dim, h = c.hidden_dim;
  r.unit("embed");
  r.weight("transformer.wte.weight", {c.vocab_size, d}, true);
  r.weight("transformer.wpe.weight", {c.max_seq_len, d}, false);
  for (int64_t i = 0; i < c.n_layers; ++i) {
    const std::string p = fmt::format("transformer.h.{}.", i);
    r.unit(fmt::format("layers.{}", i));
    r.norm_weight(p + "ln_1.weight", d);
    r.bias(p + "ln_1.bias", d);
    r.weight(p + "attn.c_attn.weight", {d, 3 * d}, true);
    r.bias(p + "attn.c_attn.bias", 3 * d);
    r.weight(p + "attn.c_proj.weight", {d, d}, true, true);
    r.bias(p + "attn.c_proj.bias", d);
    r.norm_weight(p + "ln_2.weight", d);
    r.bias(p + "ln_2.bias", d);
    r.weight(p + "mlp.c_fc.weight", {d, h}, true);
    r.bias(p + "mlp.c_fc.bias", h);
    r.weight(p + "mlp.c_proj.weight", {h, d}, true, true);
    r.bias(p + "mlp.c_proj.bias", d);
  }
  r.unit("head");
  r.norm_weight("transformer.ln_f.weight", d);
  r.bias("transformer.ln_f.bias", d);
}

Registry build_registry(const ModelConfig& config) {
  Registry r(config);
  if (config.family == Family::llama) {
    llama_registry(config, r);
  } else {
    gpt2_registry(config, r);
  }
  return r;
}

}  // namespace

std::vector<ParamSpec> build_param_specs(const ModelConfig& config) {
  return build_registry(config).take_specs();
}

std::vector<ParamUnit> build_param_units(const ModelConfig& config) {
  return build_registry(config).take_units();
}

}  // namespace meshtrain
