#include "meshtrain/ckpt/hf.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <map>
#include <set>
#include <sstream>
#include <vector>

#include "meshtrain/ckpt/atomic_file.h"
#include "meshtrain/ckpt/safetensors.h"
#include "meshtrain/util/error.h"

namespace meshtrain {

namespace {

using json = nlohmann::json;

// 1e-5f printed as 1e-05, not 9.999999747378752e-06.
double short_double(float value) { return std::stod(fmt::format("{}", value)); }

std::string_view torch_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::f32: return "float32";
    case DType::bf16: return "bfloat16";
    case DType::f16: return "float16";
    case DType::i32: return "int32";
  }
  return "float32";
}

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

// Reads config.json fields with errors naming the file and key; `prefix` names
// a nested object ("rope_parameters.").
class ConfigFields {
 public:
  ConfigFields(const json& root, std::string_view source, std::string prefix = "")
      : root_(root), source_(source), prefix_(std::move(prefix)) {}

  bool has(const char* key) const { return root_.contains(key) && !root_[key].is_null(); }
  int64_t positive_int(const char* key) const {
    MESHTRAIN_CHECK(has(key), "{}: key '{}{}' is missing", source_, prefix_, key);
    const json& v = root_[key];
    MESHTRAIN_CHECK(v.is_number_integer() && v.get<int64_t>() > 0,
                    "{}: key '{}{}' must be a positive integer, got {}", source_, prefix_, key,
                    v.dump());
    return v.get<int64_t>();
  }
  int64_t positive_int(const char* key, int64_t fallback) const {
    return has(key) ? positive_int(key) : fallback;
  }
  float positive_float(const char* key) const {
    MESHTRAIN_CHECK(has(key), "{}: key '{}{}' is missing", source_, prefix_, key);
    const json& v = root_[key];
    MESHTRAIN_CHECK(v.is_number() && v.get<double>() > 0,
                    "{}: key '{}{}' must be a positive number, got {}", source_, prefix_, key,
                    v.dump());
    return static_cast<float>(v.get<double>());
  }
  float positive_float(const char* key, float fallback) const {
    return has(key) ? positive_float(key) : fallback;
  }
  bool boolean(const char* key, bool fallback) const {
    if (!has(key)) return fallback;
    MESHTRAIN_CHECK(root_[key].is_boolean(), "{}: key '{}{}' must be true or false, got {}",
                    source_, prefix_, key, root_[key].dump());
    return root_[key].get<bool>();
  }
  std::string string(const char* key, const char* fallback) const {
    if (!has(key)) return fallback;
    MESHTRAIN_CHECK(root_[key].is_string(), "{}: key '{}{}' must be a string, got {}", source_,
                    prefix_, key, root_[key].dump());
    return root_[key].get<std::string>();
  }
  // Features meshtrain does not implement must be absent, null or `allowed`.
  void require(const char* key, const json& allowed, const char* why) const {
    MESHTRAIN_CHECK(!has(key) || root_[key] == allowed,
                    "{}: key '{}{}' = {} is not supported ({})", source_, prefix_, key,
                    root_[key].dump(), why);
  }
  // Every non-null key of the object is one of `known`.
  void only(std::initializer_list<std::string_view> known, const char* why) const {
    for (const auto& [key, value] : root_.items()) {
      if (value.is_null()) continue;
      bool found = false;
      for (std::string_view k : known) found = found || k == key;
      MESHTRAIN_CHECK(found, "{}: key '{}{}' = {} is not supported ({})", source_, prefix_, key,
                      value.dump(), why);
    }
  }

 private:
  const json& root_;
  std::string_view source_;
  std::string prefix_;
};

// One RoPE object ("rope_parameters" or "rope_scaling" = `key`): its scaling,
// and its rope_theta when it has one (else `theta` is left as it is).
RopeScaling read_rope_object(const json& r, const char* key, std::string_view source,
                             float& theta) {
  MESHTRAIN_CHECK(r.is_object(), "{}: key '{}' must be an object, got {}", source, key, r.dump());
  const ConfigFields f(r, source, std::string(key) + ".");
  if (f.has("rope_theta")) theta = f.positive_float("rope_theta");
  MESHTRAIN_CHECK(!(f.has("rope_type") && f.has("type")) || r["rope_type"] == r["type"],
                  "{}: keys '{}.rope_type' and '{}.type' disagree", source, key, key);
  const char* type_key = f.has("rope_type") ? "rope_type" : "type";
  const std::string type = f.string(type_key, "default");
  RopeScaling s;
  if (type == "default") {
    f.only({"rope_type", "type", "rope_theta"}, "the default RoPE has no scaling parameters");
  } else if (type == "linear") {
    s.type = RopeType::linear;
    s.factor = f.positive_float("factor");
    f.only({"rope_type", "type", "rope_theta", "factor"}, "not implemented for linear RoPE");
  } else if (type == "llama3") {
    s.type = RopeType::llama3;
    s.factor = f.positive_float("factor");
    s.low_freq_factor = f.positive_float("low_freq_factor");
    s.high_freq_factor = f.positive_float("high_freq_factor");
    s.original_max_seq = f.positive_int("original_max_position_embeddings");
    f.only({"rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
            "original_max_position_embeddings"},
           "not implemented for llama3 RoPE");
  } else {
    fail("{}: key '{}.{}' = \"{}\" is not supported (meshtrain implements RoPE types default, "
         "linear and llama3)", source, key, type_key, type);
  }
  return s;
}

// RoPE settings in every form transformers writes: transformers >= 5 puts theta
// and the scaling in "rope_parameters" {rope_type, rope_theta, factor, ...};
// earlier versions have a top-level "rope_theta" and "rope_scaling" {type or
// rope_type, factor, ...} (null when unscaled). Where a file has several, they
// must agree. Anything not implemented is refused by key.
void read_rope(const json& root, const ConfigFields& top, std::string_view source,
               ModelConfig& c) {
  const float top_theta = top.positive_float("rope_theta", 10000.0f);
  c.rope_theta = top_theta;
  if (top.has("rope_scaling")) {
    c.rope_scaling = read_rope_object(root["rope_scaling"], "rope_scaling", source, c.rope_theta);
  }
  if (top.has("rope_parameters")) {
    float theta = c.rope_theta;
    const RopeScaling s = read_rope_object(root["rope_parameters"], "rope_parameters", source, theta);
    MESHTRAIN_CHECK(!top.has("rope_scaling") || s == c.rope_scaling,
                    "{}: keys 'rope_parameters' and 'rope_scaling' describe different RoPE "
                    "scalings", source);
    MESHTRAIN_CHECK(!top.has("rope_theta") || theta == top_theta,
                    "{}: key 'rope_parameters.rope_theta' = {} disagrees with 'rope_theta' = {}",
                    source, theta, top_theta);
    c.rope_theta = theta;
    c.rope_scaling = s;
  }
}

// The config.json "rope_parameters" object (transformers >= 5's form).
nlohmann::ordered_json rope_parameters_json(const ModelConfig& c) {
  nlohmann::ordered_json r;
  const RopeScaling& s = c.rope_scaling;
  r["rope_type"] = rope_type_name(s.type);
  r["rope_theta"] = short_double(c.rope_theta);
  if (s.type == RopeType::linear || s.type == RopeType::llama3) r["factor"] = short_double(s.factor);
  if (s.type == RopeType::llama3) {
    r["low_freq_factor"] = short_double(s.low_freq_factor);
    r["high_freq_factor"] = short_double(s.high_freq_factor);
    r["original_max_position_embeddings"] = s.original_max_seq;
  }
  return r;
}

// The tensors of a Hugging Face directory: model.safetensors, or the files a
// sharded checkpoint's model.safetensors.index.json maps every name to.
class HfTensors {
 public:
  explicit HfTensors(const std::filesystem::path& dir) {
    const std::filesystem::path single = dir / "model.safetensors";
    const std::filesystem::path index = dir / "model.safetensors.index.json";
    if (std::filesystem::exists(single) || !std::filesystem::exists(index)) {
      source_ = single.string();
      const SafetensorsReader& reader = open(source_);
      for (const StTensorInfo& t : reader.tensors()) owner_[t.name] = &reader;
      return;
    }
    source_ = index.string();
    const std::string& source = source_;
    json root;
    try {
      root = json::parse(read_file_text(source));
    } catch (const json::exception& e) {
      fail("{}: not valid JSON: {}", source, e.what());
    }
    MESHTRAIN_CHECK(root.is_object() && root.contains("weight_map") &&
                        root["weight_map"].is_object(),
                    "{}: key 'weight_map' (an object of tensor name -> file) is missing", source);
    std::map<std::string, size_t> file_index;
    for (const auto& [name, file] : root["weight_map"].items()) {
      MESHTRAIN_CHECK(file.is_string(), "{}: weight_map['{}'] must be a file name, got {}", source,
                      name, file.dump());
      const std::string f = file.get<std::string>();
      MESHTRAIN_CHECK(f.find('/') == std::string::npos && f != ".." && !f.empty(),
                      "{}: weight_map['{}'] = '{}' is not a file in the directory", source, name, f);
      auto [it, added] = file_index.emplace(f, readers_.size());
      if (added) open((dir / f).string());
      const SafetensorsReader& reader = *readers_[it->second];
      MESHTRAIN_CHECK(reader.contains(name), "{}: tensor '{}' is not in {} (weight_map says it is)",
                      source, name, f);
      owner_[name] = &reader;
    }
    for (const auto& reader : readers_) {
      for (const StTensorInfo& t : reader->tensors()) {
        MESHTRAIN_CHECK(owner_.count(t.name) == 1, "{}: tensor '{}' of {} is not in its weight_map",
                        source, t.name, reader->path());
      }
    }
  }

  // The file holding `name`, or null.
  const SafetensorsReader* find(const std::string& name) const {
    auto it = owner_.find(name);
    return it == owner_.end() ? nullptr : it->second;
  }
  const std::map<std::string, const SafetensorsReader*>& all() const { return owner_; }
  // model.safetensors, or the index of a sharded checkpoint (for errors).
  const std::string& source() const { return source_; }

 private:
  const SafetensorsReader& open(const std::string& path) {
    readers_.push_back(std::make_unique<SafetensorsReader>(path));
    return *readers_.back();
  }
  std::string source_;
  std::vector<std::unique_ptr<SafetensorsReader>> readers_;
  std::map<std::string, const SafetensorsReader*> owner_;
};

std::string hf_name_in_file(const HfTensors& files, const ModelConfig& c,
                            const std::string& name) {
  if (files.find(name)) return name;
  const std::string_view prefix = c.recipe().omittable_prefix;
  if (!prefix.empty() && name.rfind(prefix, 0) == 0) {
    std::string bare = name.substr(prefix.size());
    if (files.find(bare)) return bare;
  }
  return name;
}

bool ignorable_extra(const ModelConfig& c, const std::string& name) {
  if (ends_with(name, ".attn.bias") || ends_with(name, ".attn.masked_bias") ||
      ends_with(name, "rotary_emb.inv_freq")) {
    return true;
  }
  return c.tie_embeddings && name == "lm_head.weight";
}

// How save_pretrained names a MoE layer's routed experts (meshtrain and
// transformers 5 in memory hold them as one [E, ...] tensor, which newer
// checkpoints ship too): Mixtral's block_sparse_moe.experts.<e>.w1 (gate), w3
// (up), w2 (down) with its router block_sparse_moe.gate; Qwen2-MoE's,
// Qwen3-MoE's and OLMoE's mlp.experts.<e>.gate_proj, up_proj, down_proj with
// the router mlp.gate (meshtrain's own name).
enum class ExpertNames : uint8_t { none, mixtral, qwen };

// A registry tensor as checkpoint files store it: file tensors, each filling
// a contiguous range of its elements.
struct FilePiece {
  std::string name;
  Shape shape;
  int64_t offset = 0;
};

std::vector<FilePiece> file_pieces(const ModelConfig& c, const ParamSpec& spec,
                                   ExpertNames names) {
  const std::string& name = spec.name;
  const bool router = ends_with(name, ".mlp.gate.weight");
  if (names == ExpertNames::none || (!router && name.find(".mlp.experts.") == std::string::npos)) {
    return {{name, spec.shape, 0}};
  }
  const std::string layer = name.substr(0, name.find(".mlp.") + 1);  // "model.layers.L."
  const bool mixtral = names == ExpertNames::mixtral;
  const std::string moe = layer + (mixtral ? "block_sparse_moe." : "mlp.");
  if (router) return {{moe + "gate.weight", spec.shape, 0}};
  const int64_t E = c.moe.experts, I = c.moe.hidden_dim, H = c.dim;
  const char* gate = mixtral ? "w1" : "gate_proj";
  const char* up = mixtral ? "w3" : "up_proj";
  const char* down = mixtral ? "w2" : "down_proj";
  std::vector<FilePiece> pieces;
  for (int64_t e = 0; e < E; ++e) {
    const std::string expert = fmt::format("{}experts.{}.", moe, e);
    if (ends_with(name, ".experts.gate_up_proj")) {
      pieces.push_back({expert + gate + ".weight", {I, H}, e * 2 * I * H});
      pieces.push_back({expert + up + ".weight", {I, H}, e * 2 * I * H + I * H});
    } else {
      pieces.push_back({expert + down + ".weight", {H, I}, e * H * I});
    }
  }
  return pieces;
}

// How `files` hold `spec`: the tensor itself (its registry name, or the
// family's without its omittable prefix), else the pieces of whichever
// per-expert naming the files use.
std::vector<FilePiece> pieces_in_files(const HfTensors& files, const ModelConfig& c,
                                       const ParamSpec& spec) {
  const std::string whole = hf_name_in_file(files, c, spec.name);
  if (files.find(whole) != nullptr) return {{whole, spec.shape, 0}};
  std::vector<FilePiece> pieces = file_pieces(c, spec, ExpertNames::mixtral);
  if (files.find(pieces.front().name) != nullptr) return pieces;
  return file_pieces(c, spec, ExpertNames::qwen);
}

}  // namespace

std::pair<int64_t, int64_t> rope_rows(const ModelConfig& c, const std::string& name) {
  if (c.recipe().positions != Positions::rope) return {0, 0};
  const int64_t hd = c.head_dim();
  const bool per_head = c.qk_norm == QkNorm::head;
  for (const char* suffix : {".self_attn.q_proj.weight", ".self_attn.q_proj.bias"}) {
    if (ends_with(name, suffix)) return {c.n_heads, hd};
  }
  for (const char* suffix : {".self_attn.k_proj.weight", ".self_attn.k_proj.bias"}) {
    if (ends_with(name, suffix)) return {c.n_kv_heads, hd};
  }
  if (ends_with(name, ".self_attn.q_norm.weight")) return {per_head ? 1 : c.n_heads, hd};
  if (ends_with(name, ".self_attn.k_norm.weight")) return {per_head ? 1 : c.n_kv_heads, hd};
  return {0, 0};
}

void rope_rows_to_hf(const float* src, float* dst, int64_t heads, int64_t head_dim, int64_t cols) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t i = 0; i < half; ++i) {
      for (int64_t c = 0; c < 2; ++c) {
        const float* from = src + (h * head_dim + 2 * i + c) * cols;
        float* to = dst + (h * head_dim + c * half + i) * cols;
        std::memcpy(to, from, static_cast<size_t>(cols) * sizeof(float));
      }
    }
  }
}

void rope_rows_from_hf(const float* src, float* dst, int64_t heads, int64_t head_dim,
                       int64_t cols) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t i = 0; i < half; ++i) {
      for (int64_t c = 0; c < 2; ++c) {
        const float* from = src + (h * head_dim + c * half + i) * cols;
        float* to = dst + (h * head_dim + 2 * i + c) * cols;
        std::memcpy(to, from, static_cast<size_t>(cols) * sizeof(float));
      }
    }
  }
}

namespace {

// The Hugging Face architectures of the llama recipe, as data: config.json's
// model_type and architectures, the attention options each implies and how
// it names and places its experts. Export writes the first that expresses
// the model (hf_arch_for); import reads any of them.
struct HfArch {
  std::string_view model_type, architecture;
  ExpertNames experts = ExpertNames::none;  // none: dense
  bool qkv_bias = false;        // q, k, v biases (Qwen2 always; Qwen2-MoE unless qkv_bias_key says not)
  bool qkv_bias_key = false;    // "qkv_bias" (Qwen2-MoE)
  bool mlp_bias_key = false;    // "mlp_bias" (must be false)
  QkNorm qk_norm = QkNorm::none;
  bool shared_experts = false;  // Qwen2-MoE's sigmoid-gated shared expert
  bool dense_layers = false;    // "mlp_only_layers" / "decoder_sparse_step" (Qwen MoEs)
  bool renormalize_key = false; // "norm_topk_prob" (Mixtral always renormalises)
  bool attention_bias_key = false;  // "attention_bias" (must be false: it would bias o_proj too)
  bool head_dim_key = false;        // "head_dim" of its own
  bool sliding_window_key = false;  // "sliding_window" (null: none)
  bool use_sliding_window_key = false;  // Qwen's "use_sliding_window" (must be false)
};

constexpr HfArch kHfArchs[] = {
    {.model_type = "llama", .architecture = "LlamaForCausalLM", .mlp_bias_key = true,
     .attention_bias_key = true, .head_dim_key = true},
    {.model_type = "qwen2", .architecture = "Qwen2ForCausalLM", .qkv_bias = true,
     .use_sliding_window_key = true},
    {.model_type = "qwen3", .architecture = "Qwen3ForCausalLM", .qk_norm = QkNorm::head,
     .attention_bias_key = true, .head_dim_key = true, .use_sliding_window_key = true},
    {.model_type = "mistral", .architecture = "MistralForCausalLM", .head_dim_key = true,
     .sliding_window_key = true},
    {.model_type = "mixtral", .architecture = "MixtralForCausalLM",
     .experts = ExpertNames::mixtral, .head_dim_key = true, .sliding_window_key = true},
    {.model_type = "qwen2_moe", .architecture = "Qwen2MoeForCausalLM",
     .experts = ExpertNames::qwen, .qkv_bias = true, .qkv_bias_key = true, .shared_experts = true,
     .dense_layers = true, .renormalize_key = true, .use_sliding_window_key = true},
    {.model_type = "qwen3_moe", .architecture = "Qwen3MoeForCausalLM",
     .experts = ExpertNames::qwen, .qk_norm = QkNorm::head, .dense_layers = true,
     .renormalize_key = true, .attention_bias_key = true, .head_dim_key = true,
     .use_sliding_window_key = true},
    {.model_type = "olmoe", .architecture = "OlmoeForCausalLM", .experts = ExpertNames::qwen,
     .qk_norm = QkNorm::full, .renormalize_key = true, .attention_bias_key = true},
};

// Why `arch` cannot express `c` (empty: it can).
std::string arch_mismatch(const HfArch& arch, const ModelConfig& c) {
  const MoeConfig& m = c.moe;
  const bool moe = arch.experts != ExpertNames::none;
  if (moe != m.enabled()) return moe ? "it has experts" : "it has no experts";
  if (arch.qk_norm != c.qk_norm) return fmt::format("its QK-norm is {}", qk_norm_name(arch.qk_norm));
  if (arch.qkv_bias != c.qkv_bias && !arch.qkv_bias_key) {
    return arch.qkv_bias ? "it has q/k/v biases" : "it has no q/k/v biases";
  }
  if (c.head_dim() * c.n_heads != c.dim && !arch.head_dim_key) return "its head_dim is dim / n_heads";
  if (c.sliding_window > 0 && !arch.sliding_window_key) return "it has no sliding window";
  if (!moe) return "";
  if (arch.shared_experts && (m.shared_hidden == 0 || !m.shared_gate)) {
    return "it always has a gated shared expert (moe.shared_hidden, moe.shared_gate)";
  }
  const struct {
    bool ok;
    const char* setting;
  } needs[] = {{m.score == ops::RouterScore::softmax, "moe.score = \"sigmoid\""},
               {m.renormalize || arch.renormalize_key, "moe.renormalize = false"},
               {m.scaling == 1.0f, "moe.scaling != 1"},
               {m.n_groups == 1, "moe.n_groups > 1"},
               {m.shared_hidden == 0 || (arch.shared_experts && m.shared_gate),
                "shared experts (moe.shared_hidden, moe.shared_gate)"},
               {(m.first_dense == 0 && m.every == 1) || arch.dense_layers,
                "dense layers (moe.first_dense, moe.every)"},
               {m.z_loss == 0, "moe.z_loss > 0"},
               {m.bias_update_rate == 0, "moe.bias_update_rate > 0"}};
  for (const auto& n : needs) {
    if (!n.ok) return fmt::format("it has no {}", n.setting);
  }
  return "";
}

// The architecture export writes for `c`; refuses, by setting, a model none expresses.
const HfArch& hf_arch_for(const ModelConfig& c) {
  std::vector<std::string> why;
  for (const HfArch& arch : kHfArchs) {
    std::string mismatch = arch_mismatch(arch, c);
    if (mismatch.empty()) return arch;
    why.push_back(fmt::format("{}: {}", arch.model_type, mismatch));
  }
  fail("export: no Hugging Face architecture expresses this model ({})", fmt::join(why, "; "));
}

const HfArch* find_hf_arch(std::string_view model_type) {
  for (const HfArch& arch : kHfArchs) {
    if (arch.model_type == model_type) return &arch;
  }
  return nullptr;
}

// The MoE keys of `arch`'s config.json.
void moe_fields(const HfArch& arch, const ModelConfig& c, nlohmann::ordered_json& j) {
  const MoeConfig& m = c.moe;
  j[arch.experts == ExpertNames::mixtral ? "num_local_experts" : "num_experts"] = m.experts;
  j["num_experts_per_tok"] = m.top_k;
  if (arch.renormalize_key) j["norm_topk_prob"] = m.renormalize;
  if (arch.dense_layers) {
    j["intermediate_size"] = c.hidden_dim;  // the dense layers'
    j["moe_intermediate_size"] = m.hidden_dim;
    // Every dense layer named: exact whatever first_dense and every are.
    std::vector<int64_t> dense;
    for (int64_t l = 0; l < c.n_layers; ++l) {
      if (!m.is_moe_layer(l)) dense.push_back(l);
    }
    j["decoder_sparse_step"] = 1;
    j["mlp_only_layers"] = dense;
  }
  if (arch.shared_experts) j["shared_expert_intermediate_size"] = m.shared_hidden;
  j["router_aux_loss_coef"] = short_double(m.aux_loss);
  j["output_router_logits"] = m.aux_loss > 0;
  if (arch.experts == ExpertNames::mixtral) j["router_jitter_noise"] = 0.0;
}

// Which layers are MoE layers by a Qwen MoE config (mlp_only_layers,
// decoder_sparse_step), as meshtrain's first_dense and every; refuses a
// pattern they cannot express.
void read_dense_layers(const json& root, const ConfigFields& f, std::string_view source,
                       ModelConfig& c) {
  const int64_t step = f.positive_int("decoder_sparse_step", 1);
  std::set<int64_t> dense;
  if (f.has("mlp_only_layers")) {
    const json& list = root["mlp_only_layers"];
    MESHTRAIN_CHECK(list.is_array(), "{}: key 'mlp_only_layers' must be a list of layer indices",
                    source);
    for (const json& v : list) {
      MESHTRAIN_CHECK(v.is_number_integer(),
                      "{}: key 'mlp_only_layers' must be a list of layer indices, got {}", source,
                      list.dump());
      dense.insert(v.get<int64_t>());
    }
  }
  std::vector<int64_t> sparse;
  for (int64_t l = 0; l < c.n_layers; ++l) {
    if (dense.count(l) == 0 && (l + 1) % step == 0) sparse.push_back(l);
  }
  MESHTRAIN_CHECK(!sparse.empty(), "{}: keys 'mlp_only_layers' and 'decoder_sparse_step' leave no "
                  "MoE layer", source);
  MoeConfig& m = c.moe;
  m.first_dense = sparse.front();
  // One MoE layer: every 1 when it is the last layer (no layer after it), else past the end.
  m.every = sparse.size() > 1 ? sparse[1] - sparse[0]
                              : (sparse[0] == c.n_layers - 1 ? 1 : c.n_layers);
  for (int64_t l = 0; l < c.n_layers; ++l) {
    const bool want = std::find(sparse.begin(), sparse.end(), l) != sparse.end();
    MESHTRAIN_CHECK(m.is_moe_layer(l) == want,
                    "{}: keys 'mlp_only_layers' = {} and 'decoder_sparse_step' = {} make MoE layers "
                    "{} (meshtrain places them from a first layer at a fixed interval)",
                    source, f.has("mlp_only_layers") ? root["mlp_only_layers"].dump() : "[]", step,
                    fmt::join(sparse, ", "));
  }
}

// The llama recipe's fields of an `arch` config.json.
void read_llama_arch(const HfArch& arch, const json& root, const ConfigFields& f,
                     std::string_view source, ModelConfig& c) {
  c.family = Family::llama;
  c.dim = f.positive_int("hidden_size");
  c.hidden_dim = f.positive_int("intermediate_size");
  c.n_layers = f.positive_int("num_hidden_layers");
  c.n_heads = f.positive_int("num_attention_heads");
  c.n_kv_heads = f.positive_int("num_key_value_heads", c.n_heads);
  c.vocab_size = f.positive_int("vocab_size");
  c.max_seq_len = f.positive_int("max_position_embeddings", 2048);
  c.norm_eps = f.positive_float("rms_norm_eps", 1e-6f);  // HF LlamaConfig's defaults
  read_rope(root, f, source, c);
  c.tie_embeddings = f.boolean("tie_word_embeddings", false);
  if (arch.head_dim_key) {
    c.head_width = f.positive_int("head_dim", c.dim / c.n_heads);
    if (c.head_width * c.n_heads == c.dim) c.head_width = 0;
  } else {
    f.require("head_dim", json(c.dim / c.n_heads),
              "this architecture's head_dim is hidden_size / num_attention_heads");
  }
  c.qkv_bias = arch.qkv_bias && (!arch.qkv_bias_key || f.boolean("qkv_bias", true));
  c.qk_norm = arch.qk_norm;
  f.require("hidden_act", "silu", "meshtrain's llama recipe uses SwiGLU with silu");
  if (arch.attention_bias_key) {
    f.require("attention_bias", false, "it would bias o_proj as well; not implemented");
  }
  f.require("mlp_bias", false, "feed-forward layers have no bias in meshtrain");
  if (arch.sliding_window_key && f.has("sliding_window") && !root["sliding_window"].is_null()) {
    c.sliding_window = f.positive_int("sliding_window");
  }
  if (arch.use_sliding_window_key) {
    f.require("use_sliding_window", false,
              "Qwen's sliding window (from max_window_layers on) is not implemented");
  }
  // Every layer the same: full attention, or the sliding window where there is one.
  const std::string layer_type = c.sliding_window > 0 ? "sliding_attention" : "full_attention";
  if (root.contains("layer_types") && root["layer_types"].is_array()) {
    for (const json& t : root["layer_types"]) {
      MESHTRAIN_CHECK(t == layer_type,
                      "{}: key 'layer_types' has {} (every layer must be {}: per-layer attention "
                      "kinds are not implemented)", source, t.dump(), layer_type);
    }
  }
  f.require("clip_qkv", nullptr, "clipping q, k and v is not implemented");
  f.require("attention_dropout", 0.0, "meshtrain trains without attention dropout");
  if (arch.experts == ExpertNames::none) return;
  MoeConfig& m = c.moe;
  const bool mixtral = arch.experts == ExpertNames::mixtral;
  m.experts = f.has("num_local_experts") || mixtral ? f.positive_int("num_local_experts")
                                                    : f.positive_int("num_experts");
  m.top_k = f.positive_int("num_experts_per_tok");
  m.renormalize = !arch.renormalize_key || f.boolean("norm_topk_prob", false);
  m.hidden_dim = arch.dense_layers ? f.positive_int("moe_intermediate_size") : c.hidden_dim;
  if (arch.dense_layers) read_dense_layers(root, f, source, c);
  if (arch.shared_experts) {
    m.shared_hidden = f.positive_int("shared_expert_intermediate_size");
    m.shared_gate = true;
  }
  // HF's loss over all layers at once becomes Megatron's per-layer form.
  m.aux_loss = f.boolean("output_router_logits", false)
                   ? f.positive_float("router_aux_loss_coef", 0.001f)
                   : 0.0f;
  f.require("router_jitter_noise", 0.0, "router jitter noise is not implemented");
}

}  // namespace

std::string hf_config_json(const ModelConfig& c, DType dtype, const SpecialIds* special) {
  nlohmann::ordered_json j;
  if (c.family == Family::llama) {
    const HfArch& arch = hf_arch_for(c);
    j["architectures"] = {arch.architecture};
    j["model_type"] = arch.model_type;
    j["hidden_size"] = c.dim;
    j["intermediate_size"] = c.moe.enabled() ? c.moe.hidden_dim : c.hidden_dim;
    if (c.moe.enabled()) moe_fields(arch, c, j);
    j["num_hidden_layers"] = c.n_layers;
    j["num_attention_heads"] = c.n_heads;
    j["num_key_value_heads"] = c.n_kv_heads;
    if (arch.head_dim_key) j["head_dim"] = c.head_dim();
    j["vocab_size"] = c.vocab_size;
    j["max_position_embeddings"] = c.max_seq_len;
    j["rms_norm_eps"] = short_double(c.norm_eps);
    // Both forms: transformers >= 5 reads rope_parameters, earlier versions
    // rope_theta and rope_scaling.
    j["rope_parameters"] = rope_parameters_json(c);
    j["rope_theta"] = short_double(c.rope_theta);
    j["rope_scaling"] = c.rope_scaling.type == RopeType::none ? nlohmann::ordered_json(nullptr)
                                                              : rope_parameters_json(c);
    j["hidden_act"] = "silu";
    if (arch.attention_bias_key) j["attention_bias"] = false;
    if (arch.qkv_bias_key) j["qkv_bias"] = c.qkv_bias;
    if (arch.mlp_bias_key) j["mlp_bias"] = false;
    if (arch.sliding_window_key) {
      j["sliding_window"] = c.sliding_window > 0 ? nlohmann::ordered_json(c.sliding_window)
                                                 : nlohmann::ordered_json(nullptr);
    }
    if (arch.use_sliding_window_key) j["use_sliding_window"] = false;
    j["tie_word_embeddings"] = c.tie_embeddings;
  } else {
    j["architectures"] = {"GPT2LMHeadModel"};
    j["model_type"] = "gpt2";
    j["n_embd"] = c.dim;
    j["n_layer"] = c.n_layers;
    j["n_head"] = c.n_heads;
    j["n_inner"] = c.hidden_dim == 4 * c.dim ? json(nullptr) : json(c.hidden_dim);
    j["n_positions"] = c.max_seq_len;
    j["n_ctx"] = c.max_seq_len;
    j["vocab_size"] = c.vocab_size;
    j["layer_norm_epsilon"] = short_double(c.norm_eps);
    j["activation_function"] = "gelu_new";
    j["resid_pdrop"] = 0.0;
    j["embd_pdrop"] = 0.0;
    j["attn_pdrop"] = 0.0;
    j["tie_word_embeddings"] = true;
  }
  j["initializer_range"] = short_double(c.init_std);
  j["torch_dtype"] = torch_dtype_name(dtype);
  if (special != nullptr) {
    j["bos_token_id"] = special->bos;
    j["eos_token_id"] = special->eos;
  }
  return j.dump(2) + "\n";
}

ModelConfig parse_hf_config(std::string_view json_text, std::string_view source) {
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::exception& e) {
    fail("{}: not valid JSON: {}", source, e.what());
  }
  MESHTRAIN_CHECK(root.is_object(), "{}: not a JSON object", source);
  ConfigFields f(root, source);
  std::string type = f.string("model_type", "");
  if (type.empty() && root.contains("architectures") && root["architectures"].is_array() &&
      !root["architectures"].empty() && root["architectures"][0].is_string()) {
    const auto name = root["architectures"][0].get<std::string>();
    if (name == "GPT2LMHeadModel") type = "gpt2";
    for (const HfArch& arch : kHfArchs) {
      if (arch.architecture == name) type = arch.model_type;
    }
  }
  const HfArch* arch = find_hf_arch(type);
  if (type != "gpt2" && arch == nullptr) {
    std::vector<std::string_view> known{"gpt2"};
    for (const HfArch& a : kHfArchs) known.push_back(a.model_type);
    fail("{}: model_type '{}' is not supported (expected one of {})", source, type,
         fmt::join(known, ", "));
  }

  ModelConfig c;
  c.init_std = f.positive_float("initializer_range", 0.02f);
  if (arch != nullptr) {
    read_llama_arch(*arch, root, f, source, c);
  } else {
    c.family = Family::gpt2;
    c.dim = f.positive_int("n_embd");
    c.n_layers = f.positive_int("n_layer");
    c.n_heads = f.positive_int("n_head");
    c.n_kv_heads = c.n_heads;
    c.hidden_dim = f.positive_int("n_inner", 4 * c.dim);
    c.vocab_size = f.positive_int("vocab_size");
    c.max_seq_len = f.positive_int("n_positions", f.positive_int("n_ctx", 1024));
    c.norm_eps = f.positive_float("layer_norm_epsilon", 1e-5f);
    c.tie_embeddings = true;
    const std::string act = f.string("activation_function", "gelu_new");
    MESHTRAIN_CHECK(act == "gelu_new" || act == "gelu_pytorch_tanh",
                    "{}: key 'activation_function' = '{}' is not supported (meshtrain's GPT-2 uses "
                    "the tanh GELU, gelu_new)", source, act);
    f.require("tie_word_embeddings", true, "GPT-2's output layer is tied");
    f.require("scale_attn_weights", true, "attention is always scaled by 1/sqrt(head_dim)");
    f.require("scale_attn_by_inverse_layer_idx", false, "not implemented");
  }
  try {
    c.validate();
  } catch (const Error& e) {
    fail("{}: {}", source, e.what());
  }
  return c;
}

ModelConfig read_hf_config(const std::string& path) {
  return parse_hf_config(read_file_text(path), path);
}

void export_hf(Model& model, const std::string& dir, DType dtype, const Tokenizer* tokenizer) {
  export_hf(model.config(), model_tensors(model), dir, dtype, tokenizer);
}

void export_hf(const ModelConfig& c, const TensorSource& source, const std::string& dir,
               DType dtype, const Tokenizer* tokenizer) {
  // Adapters in model.safetensors would be ignored by transformers: a silently different model.
  MESHTRAIN_CHECK_AS(ErrorKind::config, !c.lora.enabled(),
                     "{}: the model has LoRA adapters (lora.rank = {}); export it merged "
                     "(ckpt/lora_export.h merge_lora) or the adapters in PEFT's layout",
                     dir, c.lora.rank);
  MESHTRAIN_CHECK(tokenizer == nullptr || tokenizer->vocab_size() <= c.vocab_size,
                  "{}: tokenizer '{}' has {} ids, the model only {}", dir, tokenizer->name(),
                  tokenizer->vocab_size(), c.vocab_size);
  const std::string config_json = hf_config_json(c, dtype);  // refuses what HF cannot express
  const ExpertNames names = c.family == Family::llama ? hf_arch_for(c).experts : ExpertNames::none;
  const std::vector<ParamSpec> specs = build_param_specs(c);
  std::vector<SafetensorsStreamWriter::Entry> entries;
  for (const ParamSpec& spec : specs) {
    for (const FilePiece& piece : file_pieces(c, spec, names)) {
      entries.push_back({piece.name, to_st_dtype(dtype), piece.shape});
    }
  }
  const std::filesystem::path d(dir);
  // "pt": what transformers expects to find.
  SafetensorsStreamWriter writer((d / "model.safetensors").string(), entries, {{"format", "pt"}});
  std::vector<float> values, permuted;
  std::vector<char> stored;
  for (const ParamSpec& spec : specs) {
    values.resize(static_cast<size_t>(spec.numel()));
    source(spec, values.data());
    const float* out = values.data();
    if (auto [heads, head_dim] = rope_rows(c, spec.name); heads != 0) {
      permuted.resize(values.size());
      rope_rows_to_hf(values.data(), permuted.data(), heads, head_dim,
                      spec.numel() / (heads * head_dim));
      out = permuted.data();
    }
    for (const FilePiece& piece : file_pieces(c, spec, names)) {
      const auto n = static_cast<size_t>(shape_numel(piece.shape));
      stored.resize(n * dtype_size(dtype));
      convert(DType::f32, out + piece.offset, dtype, stored.data(), n);
      writer.write(stored.data(), stored.size());
    }
  }
  writer.commit();
  if (tokenizer == nullptr) {
    write_file_atomic((d / "config.json").string(), config_json);
    return;
  }
  const SpecialIds special = special_ids(*tokenizer);
  write_hf_tokenizer(*tokenizer, c.max_seq_len, dir);
  write_file_atomic((d / "config.json").string(), hf_config_json(c, dtype, &special));
}

std::vector<std::string> copy_hf_tokenizer(const std::string& src, const std::string& dst) {
  namespace fs = std::filesystem;
  constexpr const char* kFiles[] = {"tokenizer.json",  "tokenizer_config.json",
                                    "special_tokens_map.json", "generation_config.json",
                                    "vocab.json",      "merges.txt", "tokenizer.model"};
  std::vector<std::string> copied;
  for (const char* name : kFiles) {
    const fs::path from = fs::path(src) / name;
    if (!fs::exists(from)) continue;
    write_file_atomic((fs::path(dst) / name).string(), read_file_text(from.string()));
    copied.emplace_back(name);
  }
  const std::string src_config = (fs::path(src) / "config.json").string();
  const std::string dst_config = (fs::path(dst) / "config.json").string();
  const json from = json::parse(read_file_text(src_config), nullptr, /*allow_exceptions=*/false);
  nlohmann::ordered_json to = nlohmann::ordered_json::parse(read_file_text(dst_config));
  if (from.is_object()) {
    for (const char* key : {"bos_token_id", "eos_token_id", "pad_token_id"}) {
      if (from.contains(key)) to[key] = from[key];
    }
  }
  write_file_atomic(dst_config, to.dump(2) + "\n");
  return copied;
}

TensorSource hf_tensors(const std::string& dir, const ModelConfig& config, MemoryTracker& tracker) {
  auto files = std::make_shared<const HfTensors>(std::filesystem::path(dir));
  std::set<std::string> used;
  for (const ParamSpec& spec : build_param_specs(config)) {
    for (const FilePiece& piece : pieces_in_files(*files, config, spec)) {
      const SafetensorsReader* reader = files->find(piece.name);
      MESHTRAIN_CHECK(reader != nullptr, "{}: tensor '{}' is missing (model needs {})",
                      files->source(), piece.name, shape_str(piece.shape));
      const Shape& stored = reader->info(piece.name).shape;
      MESHTRAIN_CHECK(stored == piece.shape, "{}: tensor '{}' has shape {}, expected {}",
                      reader->path(), piece.name, shape_str(stored), shape_str(piece.shape));
      used.insert(piece.name);
    }
  }
  for (const auto& [name, reader] : files->all()) {
    MESHTRAIN_CHECK(used.count(name) == 1 || ignorable_extra(config, name),
                    "{}: tensor '{}' is not a parameter of this {} model", reader->path(), name,
                    family_name(config.family));
  }
  return [files, config, &tracker](const ParamSpec& spec, float* out) {
    for (const FilePiece& piece : pieces_in_files(*files, config, spec)) {
      Tensor hf(piece.shape, DType::f32, MemCategory::workspace, tracker);
      files->find(piece.name)->read(piece.name, hf);
      auto [heads, head_dim] = rope_rows(config, spec.name);
      if (heads == 0) {
        std::copy_n(hf.data<float>(), hf.numel(), out + piece.offset);
      } else {
        rope_rows_from_hf(hf.data<float>(), out, heads, head_dim,
                          spec.numel() / (heads * head_dim));
      }
    }
  };
}

void load_hf_weights(Model& model, const std::string& dir) {
  const TensorSource source = hf_tensors(dir, model.config(), model.backend().tracker());
  std::vector<float> host;
  for (Parameter& p : model.params()) {
    host.resize(static_cast<size_t>(p.spec.numel()));
    source(p.spec, host.data());
    model.copy_master_from_host(p, host.data());
  }
  model.sync_compute_weights();
}

std::unique_ptr<Model> import_hf(const std::string& dir, Precision precision, Backend& backend) {
  ModelConfig config = read_hf_config((std::filesystem::path(dir) / "config.json").string());
  auto model = std::make_unique<Model>(config, precision, backend);
  load_hf_weights(*model, dir);
  return model;
}

}  // namespace meshtrain
