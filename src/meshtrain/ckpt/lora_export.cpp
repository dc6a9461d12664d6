#include "meshtrain/ckpt/lora_export.h"

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "meshtrain/ckpt/atomic_file.h"
#include "meshtrain/ckpt/hf.h"
#include "meshtrain/ckpt/safetensors.h"
#include "meshtrain/model/params.h"
#include "meshtrain/util/error.h"

namespace meshtrain {
namespace {

namespace fs = std::filesystem;
using ordered_json = nlohmann::ordered_json;

constexpr std::string_view kWeight = ".weight";
constexpr std::string_view kPeftPrefix = "base_model.model.";  // PeftModel's wrapping of the model

}  // namespace

bool is_lora_tensor(const std::string& name) {
  return name.ends_with(".lora_A.weight") || name.ends_with(".lora_B.weight");
}

ModelConfig without_lora(const ModelConfig& config) {
  ModelConfig base = config;
  base.lora = {};
  return base;
}

std::vector<LoraModule> lora_modules(const ModelConfig& config) {
  constexpr std::string_view kA = ".lora_A.weight";
  const std::vector<ParamSpec> specs = build_param_specs(config);
  std::map<std::string, const ParamSpec*> by_name;
  for (const ParamSpec& spec : specs) by_name[spec.name] = &spec;
  std::vector<LoraModule> modules;
  for (const ParamSpec& spec : specs) {
    if (!spec.lora_adapter || !spec.name.ends_with(kA)) continue;
    LoraModule m;
    m.module = spec.name.substr(0, spec.name.size() - kA.size());
    m.a = spec;
    m.b = *by_name.at(m.module + ".lora_B.weight");
    m.base = *by_name.at(m.module + std::string(kWeight));
    m.conv1d = config.recipe().conv1d;
    m.rank = spec.shape[0];
    m.in_features = spec.shape[1];
    m.out_features = m.b.shape[0];
    modules.push_back(std::move(m));
  }
  return modules;
}

void merge_lora_delta(const float* a, const float* b, int64_t rank, int64_t in_features,
                      int64_t out_features, float scale, bool conv1d, float* w) {
  std::vector<double> a_col(static_cast<size_t>(rank));
  for (int64_t i = 0; i < in_features; ++i) {
    for (int64_t k = 0; k < rank; ++k) a_col[static_cast<size_t>(k)] = a[k * in_features + i];
    for (int64_t o = 0; o < out_features; ++o) {
      double delta = 0;
      for (int64_t k = 0; k < rank; ++k) {
        delta += static_cast<double>(b[o * rank + k]) * a_col[static_cast<size_t>(k)];
      }
      float& target = conv1d ? w[i * out_features + o] : w[o * in_features + i];
      target = static_cast<float>(static_cast<double>(target) + static_cast<double>(scale) * delta);
    }
  }
}

TensorSource merge_lora(const ModelConfig& config, TensorSource source) {
  std::map<std::string, LoraModule> by_base;
  for (LoraModule& m : lora_modules(config)) by_base.emplace(m.base.name, std::move(m));
  return [by_base = std::move(by_base), source = std::move(source),
          scale = config.lora.scale()](const ParamSpec& spec, float* out) {
    MESHTRAIN_CHECK(!is_lora_tensor(spec.name),
                    "merge_lora: '{}' is an adapter; the merged model has none", spec.name);
    source(spec, out);
    auto it = by_base.find(spec.name);
    if (it == by_base.end()) return;
    const LoraModule& m = it->second;
    std::vector<float> a(static_cast<size_t>(m.a.numel())), b(static_cast<size_t>(m.b.numel()));
    source(m.a, a.data());
    source(m.b, b.data());
    merge_lora_delta(a.data(), b.data(), m.rank, m.in_features, m.out_features, scale, m.conv1d,
                     out);
  };
}

void export_peft(const ModelConfig& config, const TensorSource& source, const std::string& dir,
                 const std::string& base_model, DType dtype) {
  const LoraConfig& lora = config.lora;
  MESHTRAIN_CHECK_AS(ErrorKind::config, lora.enabled(),
                     "{}: a PEFT export needs a model with LoRA adapters (lora.rank >= 1)", dir);
  const std::vector<LoraModule> modules = lora_modules(config);
  std::vector<SafetensorsStreamWriter::Entry> entries;
  for (const LoraModule& m : modules) {
    for (const ParamSpec& spec : {m.a, m.b}) {
      entries.push_back({std::string(kPeftPrefix) + spec.name, to_st_dtype(dtype), spec.shape});
    }
  }
  SafetensorsStreamWriter writer((fs::path(dir) / "adapter_model.safetensors").string(), entries,
                                 {{"format", "pt"}});
  std::vector<float> values, permuted;
  std::vector<char> stored;
  for (const LoraModule& m : modules) {
    for (const ParamSpec& spec : {m.a, m.b}) {
      values.resize(static_cast<size_t>(spec.numel()));
      source(spec, values.data());
      const float* out = values.data();
      if (auto [heads, head_dim] = rope_rows(config, m.base.name);
          heads != 0 && spec.name.ends_with(".lora_B.weight")) {
        permuted.resize(values.size());
        rope_rows_to_hf(values.data(), permuted.data(), heads, head_dim, m.rank);
        out = permuted.data();
      }
      stored.resize(values.size() * dtype_size(dtype));
      convert(DType::f32, out, dtype, stored.data(), values.size());
      writer.write(stored.data(), stored.size());
    }
  }
  writer.commit();

  // LoraConfig's fields (peft/tuners/lora/config.py); the ones left out keep PEFT's defaults.
  ordered_json j;
  j["peft_type"] = "LORA";
  j["task_type"] = "CAUSAL_LM";
  j["base_model_name_or_path"] = base_model.empty() ? ordered_json(nullptr) : ordered_json(base_model);
  j["r"] = lora.rank;
  j["lora_alpha"] = std::stod(fmt::format("{}", lora.alpha));  // 16, not 16.000000xyz
  j["lora_dropout"] = std::stod(fmt::format("{}", lora.dropout));
  j["target_modules"] = lora_targets(lora, config.family);
  j["fan_in_fan_out"] = config.recipe().conv1d;  // Conv1D stores [in, out]
  j["bias"] = "none";
  j["modules_to_save"] = nullptr;
  j["layers_to_transform"] = nullptr;
  j["init_lora_weights"] = true;
  j["use_rslora"] = false;
  j["use_dora"] = false;
  j["inference_mode"] = true;
  write_file_atomic((fs::path(dir) / "adapter_config.json").string(), j.dump(2) + "\n");
}

PeftAdapter read_peft_adapter(const std::string& dir, const ModelConfig& base) {
  const std::string config_path = (fs::path(dir) / "adapter_config.json").string();
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_file_text(config_path));
  } catch (const nlohmann::json::exception& e) {
    fail_as(ErrorKind::corrupt, "{}: not valid JSON: {}", config_path, e.what());
  }
  MESHTRAIN_CHECK_AS(ErrorKind::corrupt, j.is_object(), "{}: not a JSON object", config_path);
  auto has = [&](const char* key) { return j.contains(key) && !j[key].is_null(); };
  auto number = [&](const char* key, double fallback) {
    if (!has(key)) return fallback;
    MESHTRAIN_CHECK_AS(ErrorKind::corrupt, j[key].is_number(), "{}: key '{}' must be a number, got {}",
                       config_path, key, j[key].dump());
    return j[key].get<double>();
  };
  // Features that change the math and meshtrain does not implement: absent, null or their default.
  auto require = [&](const char* key, const nlohmann::json& allowed) {
    const bool empty = !has(key) || j[key] == allowed ||
                       (j[key].is_object() && j[key].empty()) || (j[key].is_array() && j[key].empty());
    MESHTRAIN_CHECK_AS(ErrorKind::config, empty, "{}: key '{}' = {} is not supported", config_path,
                       key, j[key].dump());
  };
  MESHTRAIN_CHECK_AS(ErrorKind::config, has("peft_type") && j["peft_type"] == "LORA",
                     "{}: key 'peft_type' must be \"LORA\", got {}", config_path,
                     has("peft_type") ? j["peft_type"].dump() : "nothing");
  require("bias", "none");
  require("use_dora", false);
  require("use_rslora", false);
  require("rank_pattern", nullptr);
  require("alpha_pattern", nullptr);
  require("layers_to_transform", nullptr);
  require("modules_to_save", nullptr);
  require("lora_bias", false);
  require("exclude_modules", nullptr);
  require("layer_replication", nullptr);
  require("target_parameters", nullptr);
  require("trainable_token_indices", nullptr);
  PeftAdapter adapter;
  adapter.config = without_lora(base);
  LoraConfig& lora = adapter.config.lora;
  MESHTRAIN_CHECK_AS(ErrorKind::corrupt, has("r") && j["r"].is_number_integer() && j["r"].get<int64_t>() > 0,
                     "{}: key 'r' must be a positive integer", config_path);
  lora.rank = j["r"].get<int64_t>();
  lora.alpha = static_cast<float>(number("lora_alpha", 8.0));  // PEFT's default
  lora.dropout = static_cast<float>(number("lora_dropout", 0.0));
  MESHTRAIN_CHECK_AS(ErrorKind::config, has("target_modules") && j["target_modules"].is_array(),
                     "{}: key 'target_modules' must be a list of module names (a regex or "
                     "'all-linear' is not supported)", config_path);
  for (const auto& t : j["target_modules"]) {
    MESHTRAIN_CHECK_AS(ErrorKind::corrupt, t.is_string(), "{}: key 'target_modules' holds {}",
                       config_path, t.dump());
    lora.targets.push_back(t.get<std::string>());
  }
  // Registry order, each once (PEFT writes a set).
  std::vector<std::string> targets;
  for (const std::string& t : lora_target_names(base.family)) {
    if (std::find(lora.targets.begin(), lora.targets.end(), t) != lora.targets.end()) targets.push_back(t);
  }
  for (const std::string& t : lora.targets) {
    MESHTRAIN_CHECK_AS(ErrorKind::config, std::find(targets.begin(), targets.end(), t) != targets.end(),
                       "{}: target_modules '{}' is not a linear layer of {} (known: {})", config_path, t,
                       family_name(base.family), fmt::join(lora_target_names(base.family), ", "));
  }
  lora.targets = targets;
  MESHTRAIN_CHECK_AS(ErrorKind::config, !targets.empty(), "{}: key 'target_modules' is empty",
                     config_path);
  try {
    adapter.config.validate();
  } catch (const Error& e) {
    fail_as(ErrorKind::config, "{}: {}", config_path, e.what());
  }
  if (has("base_model_name_or_path") && j["base_model_name_or_path"].is_string()) {
    adapter.base_model = j["base_model_name_or_path"].get<std::string>();
  }

  const SafetensorsReader reader((fs::path(dir) / "adapter_model.safetensors").string());
  std::set<std::string> used;
  MemoryTracker tracker;
  const ModelConfig& config = adapter.config;
  for (const LoraModule& m : lora_modules(config)) {
    for (const ParamSpec& spec : {m.a, m.b}) {
      const std::string name = std::string(kPeftPrefix) + spec.name;
      const StTensorInfo* info = reader.find(name);
      MESHTRAIN_CHECK_AS(ErrorKind::corrupt, info != nullptr, "{}: tensor '{}' is missing",
                         reader.path(), name);
      MESHTRAIN_CHECK_AS(ErrorKind::corrupt, info->shape == spec.shape,
                         "{}: tensor '{}' has shape {}, the model's r = {} adapter {}",
                         reader.path(), name, shape_str(info->shape), m.rank, shape_str(spec.shape));
      Tensor t(spec.shape, DType::f32, MemCategory::workspace, tracker);
      reader.read(name, t);
      std::vector<float>& dst = adapter.tensors[spec.name];
      dst.resize(static_cast<size_t>(spec.numel()));
      auto [heads, head_dim] = rope_rows(config, m.base.name);
      if (heads != 0 && spec.name.ends_with(".lora_B.weight")) {
        rope_rows_from_hf(t.data<float>(), dst.data(), heads, head_dim, m.rank);
      } else {
        std::copy_n(t.data<float>(), spec.numel(), dst.data());
      }
      used.insert(name);
    }
  }
  for (const StTensorInfo& t : reader.tensors()) {
    MESHTRAIN_CHECK_AS(ErrorKind::corrupt, used.count(t.name) == 1,
                       "{}: tensor '{}' is not an adapter of this {} model's target_modules",
                       reader.path(), t.name, family_name(config.family));
  }
  return adapter;
}

TensorSource with_adapter(TensorSource base, const PeftAdapter& adapter) {
  return [base = std::move(base), &adapter](const ParamSpec& spec, float* out) {
    auto it = adapter.tensors.find(spec.name);
    if (it == adapter.tensors.end()) return base(spec, out);
    std::copy(it->second.begin(), it->second.end(), out);
  };
}

}  // namespace meshtrain
