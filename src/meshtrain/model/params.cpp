#include "meshtrain/model/params.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "meshtrain/util/error.h"
#include "meshtrain/util/rng.h"

namespace meshtrain {

DType param_compute_dtype(const ParamSpec& spec, Precision precision) {
  return spec.matmul_weight ? compute_dtype(precision) : DType::f32;
}

nf4::Layout nf4_layout(const ParamSpec& spec) {
  // Every run of the slice (its rows, or all of it) starts and ends on a block boundary.
  bool whole_blocks = spec.numel() % nf4::kBlock == 0;
  for_each_local_run(spec.split, [&](int64_t local, int64_t global, int64_t count) {
    whole_blocks = whole_blocks && local % nf4::kBlock == 0 && global % nf4::kBlock == 0 &&
                   count % nf4::kBlock == 0;
  });
  MESHTRAIN_CHECK_AS(ErrorKind::config, whole_blocks,
                     "lora.quantize_base = \"nf4\": this rank's slice of '{}' ({} of {} elements) "
                     "cuts NF4 blocks of {}; choose dimensions (and a tp degree) whose slices are "
                     "whole blocks of every row",
                     spec.name, spec.numel(), shape_numel(spec.split.global_shape), nf4::kBlock);
  return nf4::layout(spec.numel(), spec.split.split() ? nf4::Form::slice : nf4::Form::whole);
}

std::vector<int64_t> nf4_slice_blocks(const ParamSpec& spec) {
  std::vector<int64_t> blocks;
  for_each_local_run(spec.split, [&](int64_t, int64_t global, int64_t count) {
    for (int64_t b = 0; b < count / nf4::kBlock; ++b) blocks.push_back(global / nf4::kBlock + b);
  });
  return blocks;
}

ParamSpec whole_spec(const ParamSpec& spec) {
  ParamSpec whole = spec;
  whole.shape = spec.split.global_shape;
  whole.split = TensorSplit{};
  whole.split.global_shape = whole.shape;
  return whole;
}

bool param_has_master(const ParamSpec& spec, Precision precision) {
  return spec.trainable || (!spec.nf4 && param_compute_dtype(spec, precision) == DType::f32);
}

std::string block_param_prefix(Family family, int64_t layer) {
  return fmt::format(fmt::runtime(recipe(family).layer_prefix), layer);
}

std::array<std::vector<std::string>, 4> block_gemm_modules(Family family) {
  return recipe(family).gemm_modules;
}

void init_parameter(const ParamSpec& spec, uint64_t seed, float* out) {
  const int64_t n = spec.numel();
  if (spec.split.split() && spec.init == InitKind::normal) {
    const uint64_t key = stream_key(seed, spec.name);
    const float scale = spec.init_std;
    for (int64_t i = 0; i < n; ++i) out[i] = 0.0f;  // padding
    for_each_local_run(spec.split, [&](int64_t local, int64_t global, int64_t count) {
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < count; ++i) {
        out[local + i] = scale * normal_at(key, static_cast<uint64_t>(global + i));
      }
    });
    return;
  }
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
  Registry(const ModelConfig& config, int tp_rank, int tp_size, int ep_rank, int ep_size)
      : config_(config), tp_rank_(tp_rank), tp_size_(tp_size), ep_rank_(ep_rank),
        ep_size_(ep_size) {}

  // Starts a unit at the next parameter; it ends where the next one starts.
  void unit(std::string name) {
    if (!units_.empty()) units_.back().end_param = specs_.size();
    units_.push_back(ParamUnit{std::move(name), specs_.size(), specs_.size()});
  }

  // A linear/embedding weight; `residual_out` marks projections that write into
  // the residual stream (scaled by 1/sqrt(2 * n_layers), GPT-2's convention).
  // `split`/`parts`: how tensor parallelism divides it (split.h).
  void weight(std::string name, Shape shape, bool matmul, bool residual_out = false,
              SplitKind split = SplitKind::none, int parts = 1) {
    ParamSpec spec;
    spec.name = std::move(name);
    spec.split = make_split(std::move(shape), split, parts);
    spec.shape = spec.split.local_shape();
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
  void bias(std::string name, int64_t n, SplitKind split = SplitKind::none, int parts = 1) {
    vector(std::move(name), n, InitKind::zeros);
    specs_.back().split = make_split({n}, split, parts);
    specs_.back().shape = specs_.back().split.local_shape();
  }

  // LoRA adapters of the linear `module` (short name `target`, e.g.
  // "q_proj") with `in` inputs and `out` outputs, if lora.targets names it.
  // Column-parallel layers (tp splits the outputs, in `parts` blocks): B is
  // split by rows like them, A replicated; row-parallel layers: A split by
  // its input columns, B replicated. A: normal with PEFT's kaiming-uniform
  // variance, 1 / (3 in); B: zeros (step 0 is the base model).
  void adapter(const std::string& module, const char* target, int64_t in, int64_t out,
               bool column_parallel, int parts = 1) {
    linear_modules_.push_back(module);
    if (std::find(targets_.begin(), targets_.end(), target) == targets_.end()) return;
    const int64_t r = config_.lora.rank;
    ParamSpec a;
    a.name = module + ".lora_A.weight";
    a.split = make_split({r, in}, column_parallel ? SplitKind::none : cols, 1);
    a.init_std = 1.0f / std::sqrt(3.0f * static_cast<float>(in));
    ParamSpec b;
    b.name = module + ".lora_B.weight";
    b.split = make_split({out, r}, column_parallel ? rows : SplitKind::none, parts);
    b.init = InitKind::zeros;
    b.init_std = 0.0f;
    for (ParamSpec* spec : {&a, &b}) {
      spec->shape = spec->split.local_shape();
      spec->role = ParamRole::decay;
      spec->matmul_weight = true;
      spec->lora_adapter = true;
      specs_.push_back(std::move(*spec));
    }
  }
  // Marks the last parameter: a share of it per token (ParamSpec::active); an f32 GEMM operand.
  void active(double share) { specs_.back().active = share; }
  void f32_gemm() { specs_.back().f32_gemm = true; }
  // Marks the last parameter as routed experts: their rows split over ep.
  void experts(double share) {
    ParamSpec& spec = specs_.back();
    spec.active = share;
    spec.expert = true;
    if (ep_size_ == 1) return;
    spec.split.kind = SplitKind::rows;
    spec.split.parts = 1;
    spec.split.rank = ep_rank_;
    spec.split.size = ep_size_;
    spec.shape = spec.split.local_shape();
  }
  void frozen() { specs_.back().trainable = false; }
  // With LoRA on: every parameter but the adapters frozen.
  // QLoRA: the weights of every block linear (adapted or not) held as NF4.
  void freeze_base() {
    if (!config_.lora.enabled()) return;
    for (ParamSpec& spec : specs_) spec.trainable = spec.lora_adapter;
    if (config_.lora.quantize_base != BaseQuant::nf4) return;
    for (ParamSpec& spec : specs_) {
      spec.nf4 = std::find_if(linear_modules_.begin(), linear_modules_.end(),
                              [&](const std::string& m) { return spec.name == m + ".weight"; }) !=
                 linear_modules_.end();
    }
  }

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
    spec.split.global_shape = spec.shape;
    spec.role = ParamRole::no_decay;
    spec.init = init;
    spec.init_std = 0.0f;
    specs_.push_back(std::move(spec));
  }

  TensorSplit make_split(Shape shape, SplitKind kind, int parts) const {
    TensorSplit s;
    s.global_shape = std::move(shape);
    if (tp_size_ > 1) {
      s.kind = kind;
      s.parts = parts;
      s.rank = tp_rank_;
      s.size = tp_size_;
    }
    return s;
  }

  static constexpr SplitKind rows = SplitKind::rows, cols = SplitKind::cols;
  const ModelConfig& config_;
  std::vector<std::string> targets_ = lora_targets(config_.lora, config_.family);
  std::vector<std::string> linear_modules_;  // every block linear, "<prefix><module>"
  int tp_rank_ = 0, tp_size_ = 1, ep_rank_ = 0, ep_size_ = 1;
  std::vector<ParamSpec> specs_;
  std::vector<ParamUnit> units_;
};

constexpr SplitKind rows = SplitKind::rows, cols = SplitKind::cols;

// A MoE layer's feed-forward (config.h MoeConfig), after its norm: the
// router [E, d] (f32), the routed experts as global [E, ...] tensors in
// transformers 5's fused layout (gate|up [E, 2I, d], down [E, d, I]) after
// the router and its selection bias (bias balancing only), then
// the shared experts (a SwiGLU of width shared_hidden) and their gate [1, d].
void moe_registry(const ModelConfig& c, Registry& r, const std::string& p) {
  const MoeConfig& m = c.moe;
  const int64_t d = c.dim, e = m.experts, h = m.hidden_dim;
  const double active = static_cast<double>(m.top_k) / static_cast<double>(e);
  r.weight(p + "mlp.gate.weight", {e, d}, false);
  r.f32_gemm();
  if (m.bias_update_rate > 0) {  // updated by the balancing rule, not by the optimizer
    r.bias(p + "mlp.gate.e_score_correction_bias", e);
    r.frozen();
  }
  r.weight(p + "mlp.experts.gate_up_proj", {e, 2 * h, d}, true);
  r.experts(active);
  r.weight(p + "mlp.experts.down_proj", {e, d, h}, true, true);
  r.experts(active);
  if (m.shared_hidden == 0) return;
  // The shared experts split over tp like a dense MLP; the router, gate and
  // routed experts are whole on every tp rank.
  r.weight(p + "mlp.shared_expert.gate_proj.weight", {m.shared_hidden, d}, true, false,
           SplitKind::rows);
  r.weight(p + "mlp.shared_expert.up_proj.weight", {m.shared_hidden, d}, true, false,
           SplitKind::rows);
  r.weight(p + "mlp.shared_expert.down_proj.weight", {d, m.shared_hidden}, true, true,
           SplitKind::cols);
  if (!m.shared_gate) return;
  r.weight(p + "mlp.shared_expert_gate.weight", {1, d}, false);
  r.f32_gemm();
}

// Column-parallel layers split their outputs, row-parallel layers their inputs
// (nn.Linear stores [out, in], Conv1D [in, out]).
void llama_registry(const ModelConfig& c, Registry& r) {
  const int64_t d = c.dim, hd = c.head_dim();
  const int64_t q_width = c.n_heads * hd, kv_width = c.n_kv_heads * hd;
  r.unit("embed");
  r.weight("model.embed_tokens.weight", {c.vocab_size, d}, c.tie_embeddings, false, rows);
  for (int64_t i = 0; i < c.n_layers; ++i) {
    const std::string p = fmt::format("model.layers.{}.", i);
    r.unit(fmt::format("layers.{}", i));
    r.norm_weight(p + "input_layernorm.weight", d);
    r.weight(p + "self_attn.q_proj.weight", {q_width, d}, true, false, rows);
    r.weight(p + "self_attn.k_proj.weight", {kv_width, d}, true, false, rows);
    r.weight(p + "self_attn.v_proj.weight", {kv_width, d}, true, false, rows);
    // The q|k|v biases follow the weights (one bias vector of the fused GEMM).
    if (c.qkv_bias) {
      r.bias(p + "self_attn.q_proj.bias", q_width, rows);
      r.bias(p + "self_attn.k_proj.bias", kv_width, rows);
      r.bias(p + "self_attn.v_proj.bias", kv_width, rows);
    }
    // Adapters follow their group, so q|k|v and gate|up stay adjacent.
    r.adapter(p + "self_attn.q_proj", "q_proj", d, q_width, true);
    r.adapter(p + "self_attn.k_proj", "k_proj", d, kv_width, true);
    r.adapter(p + "self_attn.v_proj", "v_proj", d, kv_width, true);
    // QK-norm: per head, a [head_dim] weight each, replicated over tp; over
    // the whole projection (never split: check_tensor_parallel_split). After
    // the qkv GEMM's tensors, as its backward completes them before the GEMM's.
    if (c.qk_norm != QkNorm::none) {
      const bool head = c.qk_norm == QkNorm::head;
      r.norm_weight(p + "self_attn.q_norm.weight", head ? hd : q_width);
      r.norm_weight(p + "self_attn.k_norm.weight", head ? hd : kv_width);
    }
    r.weight(p + "self_attn.o_proj.weight", {d, q_width}, true, true, cols);
    r.adapter(p + "self_attn.o_proj", "o_proj", q_width, d, false);
    r.norm_weight(p + "post_attention_layernorm.weight", d);
    if (c.moe.is_moe_layer(i)) {
      moe_registry(c, r, p);
      continue;
    }
    r.weight(p + "mlp.gate_proj.weight", {c.hidden_dim, d}, true, false, rows);
    r.weight(p + "mlp.up_proj.weight", {c.hidden_dim, d}, true, false, rows);
    r.adapter(p + "mlp.gate_proj", "gate_proj", d, c.hidden_dim, true);
    r.adapter(p + "mlp.up_proj", "up_proj", d, c.hidden_dim, true);
    r.weight(p + "mlp.down_proj.weight", {d, c.hidden_dim}, true, true, cols);
    r.adapter(p + "mlp.down_proj", "down_proj", c.hidden_dim, d, false);
  }
  r.unit("head");
  r.norm_weight("model.norm.weight", d);
  if (!c.tie_embeddings) r.weight("lm_head.weight", {c.vocab_size, d}, true, false, rows);
}

// Hugging Face GPT-2 uses Conv1D: weights are stored [in, out].
void gpt2_registry(const ModelConfig& c, Registry& r) {
  const int64_t d = c.dim, h = c.hidden_dim;
  r.unit("embed");
  r.weight("transformer.wte.weight", {c.vocab_size, d}, true, false, rows);
  r.weight("transformer.wpe.weight", {c.max_seq_len, d}, false);
  for (int64_t i = 0; i < c.n_layers; ++i) {
    const std::string p = fmt::format("transformer.h.{}.", i);
    r.unit(fmt::format("layers.{}", i));
    r.norm_weight(p + "ln_1.weight", d);
    r.bias(p + "ln_1.bias", d);
    r.weight(p + "attn.c_attn.weight", {d, 3 * d}, true, false, cols, 3);
    r.bias(p + "attn.c_attn.bias", 3 * d, rows, 3);
    r.adapter(p + "attn.c_attn", "c_attn", d, 3 * d, true, 3);
    r.weight(p + "attn.c_proj.weight", {d, d}, true, true, rows);
    r.bias(p + "attn.c_proj.bias", d);
    r.adapter(p + "attn.c_proj", "c_proj", d, d, false);
    r.norm_weight(p + "ln_2.weight", d);
    r.bias(p + "ln_2.bias", d);
    r.weight(p + "mlp.c_fc.weight", {d, h}, true, false, cols);
    r.bias(p + "mlp.c_fc.bias", h, rows);
    r.adapter(p + "mlp.c_fc", "c_fc", d, h, true);
    r.weight(p + "mlp.c_proj.weight", {h, d}, true, true, rows);
    r.bias(p + "mlp.c_proj.bias", d);
    r.adapter(p + "mlp.c_proj", "c_proj", h, d, false);
  }
  r.unit("head");
  r.norm_weight("transformer.ln_f.weight", d);
  r.bias("transformer.ln_f.bias", d);
}

// Each family's registry builder, indexed by Family.
using RegistryBuilder = void (*)(const ModelConfig&, Registry&);
constexpr RegistryBuilder kRegistryBuilders[] = {llama_registry, gpt2_registry};

Registry build_registry(const ModelConfig& config, int tp_rank, int tp_size, int ep_rank = 0,
                        int ep_size = 1) {
  MESHTRAIN_CHECK(!config.mla.enabled(),
                  "model.mla: multi-head latent attention is modelled by the planner only; the "
                  "engine does not build it");
  MESHTRAIN_CHECK(ep_size >= 1 && (ep_size == 1 || (config.moe.enabled() &&
                                                    config.moe.experts % ep_size == 0)),
                  "expert parallel: parallel.ep = {} must divide moe.experts = {}", ep_size,
                  config.moe.experts);
  Registry r(config, tp_rank, tp_size, ep_rank, ep_size);
  kRegistryBuilders[static_cast<size_t>(config.family)](config, r);
  r.freeze_base();
  return r;
}

}  // namespace

void check_tensor_parallel_split(const ModelConfig& c, int tp) {
  MESHTRAIN_CHECK(tp >= 1, "tensor parallel: tp = {} must be >= 1", tp);
  MESHTRAIN_CHECK(c.moe.shared_hidden % tp == 0,
                  "tensor parallel: moe.shared_hidden = {} is not divisible by tp = {} (the "
                  "shared experts' columns are split across the tp ranks)",
                  c.moe.shared_hidden, tp);
  MESHTRAIN_CHECK(tp == 1 || c.qk_norm != QkNorm::full,
                  "tensor parallel: model.qk_norm = \"full\" normalises over all heads at once, "
                  "which tp = {} would split (OLMoE's QK-norm needs tp = 1)", tp);
  const struct {
    const char* field;
    int64_t value;
    const char* what;
  } dims[] = {{"n_heads", c.n_heads, "attention heads"},
              {"n_kv_heads", c.n_kv_heads, "key/value heads"},
              {"hidden_dim", c.hidden_dim, "feed-forward columns"}};
  for (const auto& d : dims) {
    MESHTRAIN_CHECK(d.value % tp == 0,
                    "tensor parallel: model.{} = {} is not divisible by tp = {} (the {} are split "
                    "across the tp ranks)",
                    d.field, d.value, tp, d.what);
  }
}

std::vector<ParamSpec> build_param_specs(const ModelConfig& config, int tp_rank, int tp_size,
                                         int ep_rank, int ep_size) {
  return build_registry(config, tp_rank, tp_size, ep_rank, ep_size).take_specs();
}

std::vector<ParamUnit> build_param_units(const ModelConfig& config) {
  return build_registry(config, 0, 1).take_units();
}

}  // namespace meshtrain
