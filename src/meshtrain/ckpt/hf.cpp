#include "meshtrain/ckpt/hf.h"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

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
  }
  return "float32";
}

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

// Which RoPE rows a parameter has, as (heads, head_dim); heads == 0 when none.
std::pair<int64_t, int64_t> rope_rows(const ModelConfig& c, const std::string& name) {
  if (c.family != Family::llama) return {0, 0};
  if (ends_with(name, ".self_attn.q_proj.weight")) return {c.n_heads, c.head_dim()};
  if (ends_with(name, ".self_attn.k_proj.weight")) return {c.n_kv_heads, c.head_dim()};
  return {0, 0};
}

// Reads config.json fields with errors naming the file and key.
class ConfigFields {
 public:
  ConfigFields(const json& root, std::string_view source) : root_(root), source_(source) {}

  bool has(const char* key) const { return root_.contains(key) && !root_[key].is_null(); }
  int64_t positive_int(const char* key) const {
    MESHTRAIN_CHECK(has(key), "{}: key '{}' is missing", source_, key);
    const json& v = root_[key];
    MESHTRAIN_CHECK(v.is_number_integer() && v.get<int64_t>() > 0,
                    "{}: key '{}' must be a positive integer, got {}", source_, key, v.dump());
    return v.get<int64_t>();
  }
  int64_t positive_int(const char* key, int64_t fallback) const {
    return has(key) ? positive_int(key) : fallback;
  }
  float positive_float(const char* key, float fallback) const {
    if (!has(key)) return fallback;
    const json& v = root_[key];
    MESHTRAIN_CHECK(v.is_number() && v.get<double>() > 0, "{}: key '{}' must be a positive number, "
                    "got {}", source_, key, v.dump());
    return static_cast<float>(v.get<double>());
  }
  bool boolean(const char* key, bool fallback) const {
    if (!has(key)) return fallback;
    MESHTRAIN_CHECK(root_[key].is_boolean(), "{}: key '{}' must be true or false, got {}", source_,
                    key, root_[key].dump());
    return root_[key].get<bool>();
  }
  std::string string(const char* key, const char* fallback) const {
    if (!has(key)) return fallback;
    MESHTRAIN_CHECK(root_[key].is_string(), "{}: key '{}' must be a string, got {}", source_, key,
                    root_[key].dump());
    return root_[key].get<std::string>();
  }
  // Features meshtrain does not implement must be absent, null or `allowed`.
  void require(const char* key, const json& allowed, const char* why) const {
    MESHTRAIN_CHECK(!has(key) || root_[key] == allowed, "{}: key '{}' = {} is not supported ({})",
                    source_, key, root_[key].dump(), why);
  }

 private:
  const json& root_;
  std::string_view source_;
};

std::string hf_name_in_file(const SafetensorsReader& reader, const ModelConfig& c,
                            const std::string& name) {
  if (reader.contains(name)) return name;
  constexpr std::string_view prefix = "transformer.";
  if (c.family == Family::gpt2 && name.rfind(prefix, 0) == 0) {
    std::string bare = name.substr(prefix.size());
    if (reader.contains(bare)) return bare;
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

}  // namespace

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

std::string hf_config_json(const ModelConfig& c, DType dtype) {
  nlohmann::ordered_json j;
  if (c.family == Family::llama) {
    j["architectures"] = {"LlamaForCausalLM"};
    j["model_type"] = "llama";
    j["hidden_size"] = c.dim;
    j["intermediate_size"] = c.hidden_dim;
    j["num_hidden_layers"] = c.n_layers;
    j["num_attention_heads"] = c.n_heads;
    j["num_key_value_heads"] = c.n_kv_heads;
    j["head_dim"] = c.head_dim();
    j["vocab_size"] = c.vocab_size;
    j["max_position_embeddings"] = c.max_seq_len;
    j["rms_norm_eps"] = short_double(c.norm_eps);
    j["rope_theta"] = short_double(c.rope_theta);
    j["rope_scaling"] = nullptr;
    j["hidden_act"] = "silu";
    j["attention_bias"] = false;
    j["mlp_bias"] = false;
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
    const auto arch = root["architectures"][0].get<std::string>();
    if (arch == "LlamaForCausalLM") type = "llama";
    if (arch == "GPT2LMHeadModel") type = "gpt2";
  }
  MESHTRAIN_CHECK(type == "llama" || type == "gpt2",
                  "{}: model_type '{}' is not supported (expected llama or gpt2)", source, type);

  ModelConfig c;
  c.init_std = f.positive_float("initializer_range", 0.02f);
  if (type == "llama") {
    c.family = Family::llama;
    c.dim = f.positive_int("hidden_size");
    c.hidden_dim = f.positive_int("intermediate_size");
    c.n_layers = f.positive_int("num_hidden_layers");
    c.n_heads = f.positive_int("num_attention_heads");
    c.n_kv_heads = f.positive_int("num_key_value_heads", c.n_heads);
    c.vocab_size = f.positive_int("vocab_size");
    c.max_seq_len = f.positive_int("max_position_embeddings", 2048);
    c.norm_eps = f.positive_float("rms_norm_eps", 1e-6f);  // HF LlamaConfig's defaults
    c.rope_theta = f.positive_float("rope_theta", 10000.0f);
    c.tie_embeddings = f.boolean("tie_word_embeddings", false);
    MESHTRAIN_CHECK(!f.has("head_dim") || f.positive_int("head_dim") * c.n_heads == c.dim,
                    "{}: key 'head_dim' = {} is not hidden_size / num_attention_heads = {}", source,
                    root["head_dim"].dump(), c.dim / c.n_heads);
    f.require("hidden_act", "silu", "meshtrain's Llama uses SwiGLU with silu");
    f.require("rope_scaling", nullptr, "RoPE scaling is not implemented");
    f.require("attention_bias", false, "Llama projections have no bias in meshtrain");
    f.require("mlp_bias", false, "Llama projections have no bias in meshtrain");
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
  std::ifstream in(path, std::ios::binary);
  MESHTRAIN_CHECK(in.good(), "{}: cannot open", path);
  std::stringstream text;
  text << in.rdbuf();
  return parse_hf_config(text.str(), path);
}

void export_hf(Model& model, const std::string& dir, DType dtype) {
  export_hf(model.config(), model_tensors(model), dir, dtype);
}

void export_hf(const ModelConfig& c, const TensorSource& source, const std::string& dir,
               DType dtype) {
  const std::vector<ParamSpec> specs = build_param_specs(c);
  std::vector<SafetensorsStreamWriter::Entry> entries;
  for (const ParamSpec& spec : specs) entries.push_back({spec.name, to_st_dtype(dtype), spec.shape});
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
      rope_rows_to_hf(values.data(), permuted.data(), heads, head_dim, spec.shape[1]);
      out = permuted.data();
    }
    stored.resize(values.size() * dtype_size(dtype));
    convert(DType::f32, out, dtype, stored.data(), values.size());
    writer.write(stored.data(), stored.size());
  }
  writer.commit();
  write_file_atomic((d / "config.json").string(), hf_config_json(c, dtype));
}

void load_hf_weights(Model& model, const std::string& path) {
  const ModelConfig& c = model.config();
  SafetensorsReader reader(path);
  std::set<std::string> used;
  for (Parameter& p : model.params()) {
    const std::string name = hf_name_in_file(reader, c, p.spec.name);
    MESHTRAIN_CHECK(reader.contains(name), "{}: tensor '{}' is missing (model needs {})", path,
                    p.spec.name, shape_str(p.spec.shape));
    used.insert(name);
    auto [heads, head_dim] = rope_rows(c, p.spec.name);
    if (heads == 0) {
      reader.read(name, p.master);
      continue;
    }
    Tensor hf(p.spec.shape, DType::f32, MemCategory::workspace, model.ctx().tracker());
    reader.read(name, hf);
    rope_rows_from_hf(hf.data<float>(), p.master.data<float>(), heads, head_dim, p.spec.shape[1]);
  }
  for (const StTensorInfo& t : reader.tensors()) {
    MESHTRAIN_CHECK(used.count(t.name) == 1 || ignorable_extra(c, t.name),
                    "{}: tensor '{}' is not a parameter of this {} model", path, t.name,
                    family_name(c.family));
  }
  model.sync_compute_weights();
}

std::unique_ptr<Model> import_hf(const std::string& dir, Precision precision,
                                 cpu::CpuContext& ctx) {
  const std::filesystem::path d(dir);
  const std::filesystem::path weights = d / "model.safetensors";
  MESHTRAIN_CHECK(std::filesystem::exists(weights) ||
                      !std::filesystem::exists(d / "model.safetensors.index.json"),
                  "{}: sharded Hugging Face checkpoints (model.safetensors.index.json) are not "
                  "supported", dir);
  ModelConfig config = read_hf_config((d / "config.json").string());
  auto model = std::make_unique<Model>(config, precision, ctx);
  load_hf_weights(*model, weights.string());
  return model;
}

}  // namespace meshtrain
