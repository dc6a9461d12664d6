// Access to the PyTorch reference fixtures (tests/reference/generate_fixtures.py).
#pragma once

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "meshtrain/backend/cpu/cpu_backend.h"
#include "meshtrain/ckpt/hf.h"
#include "meshtrain/ckpt/safetensors.h"
#include "meshtrain/ckpt/weights.h"
#include "meshtrain/model/model.h"
#include "support/scratch.h"

namespace meshtrain::parity {

// $MESHTRAIN_FIXTURES (ctest sets it to the fixtures it regenerated), else
// the build's fixtures/ when present, else the committed tests/reference/fixtures.
inline std::string fixture_path(const std::string& name) {
  namespace fs = std::filesystem;
  if (const char* env = std::getenv("MESHTRAIN_FIXTURES"); env != nullptr && *env != '\0') {
    return (fs::path(env) / name).string();
  }
  fs::path built = fs::path(MESHTRAIN_BINARY_DIR) / "fixtures" / name;
  if (fs::exists(built)) return built.string();
  return (fs::path(MESHTRAIN_SOURCE_DIR) / "tests/reference/fixtures" / name).string();
}

inline std::string stories_path() {
  return (std::filesystem::path(MESHTRAIN_SOURCE_DIR) / "tests/models/stories260K.bin").string();
}

using testing::scratch_dir;

// ||a - b|| / ||b|| in double: the error measure for every tensor comparison here.
inline double rel_error(const float* a, const float* b, int64_t n) {
  double diff = 0, ref = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double d = static_cast<double>(a[i]) - static_cast<double>(b[i]);
    diff += d * d;
    ref += static_cast<double>(b[i]) * static_cast<double>(b[i]);
  }
  return ref == 0 ? std::sqrt(diff) : std::sqrt(diff / ref);
}

inline std::vector<int32_t> to_i32(const std::vector<int64_t>& v) {
  return std::vector<int32_t>(v.begin(), v.end());
}

// The [moe] settings a MoE case's weights file holds as JSON (metadata "moe",
// generate_fixtures.py MOE_CASES), field for field.
inline MoeConfig moe_from_json(const std::string& text) {
  const nlohmann::json j = nlohmann::json::parse(text);
  MoeConfig m;
  m.experts = j.at("experts");
  m.top_k = j.at("top_k");
  m.hidden_dim = j.at("hidden_dim");
  m.score = parse_router_score(j.at("score").get<std::string>());
  m.renormalize = j.at("renormalize");
  m.scaling = j.at("scaling");
  m.n_groups = j.at("n_groups");
  m.topk_groups = j.at("topk_groups");
  m.shared_hidden = j.at("shared_hidden");
  m.shared_gate = j.at("shared_gate");
  m.first_dense = j.at("first_dense");
  m.every = j.at("every");
  m.aux_loss = j.at("aux_loss");
  m.z_loss = j.at("z_loss");
  m.capacity_factor = j.at("capacity_factor");
  return m;
}

inline std::vector<std::string> split_commas(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) out.push_back(item);
  return out;
}

// The case's config with the [lora] settings of a fixture's metadata (rank,
// alpha, targets: <case>.lora.safetensors, generate_fixtures.py lora_case).
inline ModelConfig lora_config(const std::string& name, const SafetensorsReader& lora) {
  const std::string path = fixture_path(name + ".weights.safetensors");
  ModelConfig config = parse_hf_config(SafetensorsReader(path).metadata("config"), path);
  config.lora.rank = std::stoll(lora.metadata("rank"));
  config.lora.alpha = std::stof(lora.metadata("alpha"));
  config.lora.targets = split_commas(lora.metadata("targets"));
  return config;
}

// Base weights from the case's weights file, adapters from its lora file.
inline void load_base_and_adapters(Model& model, const std::string& name,
                                   const SafetensorsReader& lora) {
  SafetensorsReader base(fixture_path(name + ".weights.safetensors"));
  for (Parameter& p : model.params()) {
    (p.spec.lora_adapter ? lora : base).read(p.spec.name, p.master);
  }
  model.sync_compute_weights();
}

// The case's model (config from the weights file's metadata: config.json, and
// the [moe] settings and attention options where it has them) with its initial weights.
struct FixtureModel {
  MemoryTracker tracker;
  cpu::CpuBackend ctx{0, tracker};
  std::unique_ptr<Model> model;

  FixtureModel(const std::string& case_name, Precision precision) {
    const std::string path = fixture_path(case_name + ".weights.safetensors");
    SafetensorsReader weights(path);
    ModelConfig config = parse_hf_config(weights.metadata("config"), path);
    if (weights.metadata().contains("moe")) config.moe = moe_from_json(weights.metadata("moe"));
    if (weights.metadata().contains("attention")) {
      const auto j = nlohmann::json::parse(weights.metadata("attention"));
      config.qkv_bias = j.at("qkv_bias");
      config.qk_norm = parse_qk_norm(j.at("qk_norm").get<std::string>());
      config.head_width = j.at("head_dim");
    }
    config.validate();
    model = std::make_unique<Model>(config, precision, ctx);
    load_model_weights(*model, weights);
  }

  std::vector<float> logits(const std::vector<int32_t>& tokens, int64_t batch, int64_t seq) {
    std::vector<float> out(static_cast<size_t>(batch * seq * model->config().vocab_size));
    model->forward_logits(tokens.data(), batch, seq, out.data());
    return out;
  }
};

}  // namespace meshtrain::parity
