#include "meshtrain/train/checkpoint.h"

#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "meshtrain/ckpt/atomic_file.h"
#include "meshtrain/ckpt/hf.h"
#include "meshtrain/ckpt/safetensors.h"
#include "meshtrain/ckpt/weights.h"
#include "meshtrain/util/error.h"

namespace meshtrain {
namespace {

namespace fs = std::filesystem;

constexpr const char* kStateFile = "train_state.json";
constexpr const char* kModelFile = "model.safetensors";

// The three files and the tensors they hold.
constexpr const char* kTensorFiles[3] = {kModelFile, "exp_avg.safetensors",
                                         "exp_avg_sq.safetensors"};

const Tensor& tensor_of(const CheckpointTensors& tensors, int which) {
  return which == 0 ? tensors.master : which == 1 ? tensors.exp_avg : tensors.exp_avg_sq;
}

}  // namespace

std::string step_dir_name(int64_t step) { return fmt::format("step_{}", step); }

void save_checkpoint(const std::string& dir, const std::vector<Parameter>& params,
                     const CheckpointTensors& tensors, const TrainState& state,
                     const TrainConfig& config) {
  // Everything goes into a temporary directory renamed into place at the end.
  fs::path final_dir(dir);
  fs::path temp_dir = final_dir;
  temp_dir += ".tmp";
  fs::remove_all(temp_dir);
  fs::create_directories(temp_dir);

  for (int which = 0; which < 3; ++which) {
    SafetensorsWriter writer;
    for (const Parameter& p : params) {
      writer.add(p.spec.name, tensor_of(tensors, which).view(p.offset, p.spec.shape));
    }
    if (which == 0) {
      writer.set_metadata("format", "meshtrain");
      writer.set_metadata("step", std::to_string(state.step));
    } else {
      writer.set_metadata("format", "meshtrain-adamw");
      writer.set_metadata("optimizer_step", std::to_string(state.optimizer_step));
    }
    writer.write((temp_dir / kTensorFiles[which]).string());
  }
  nlohmann::json json{
      {"format", "meshtrain-train-state"},
      {"version", 1},
      {"step", state.step},
      {"optimizer_step", state.optimizer_step},
      {"sampler", {{"epoch", state.sampler.epoch}, {"index", state.sampler.index}}},
      {"seed", state.seed},
      {"config", nlohmann::json::parse(config_to_json(config))},
  };
  write_file_atomic((temp_dir / kStateFile).string(), json.dump(2) + "\n");

  fs::remove_all(final_dir);
  fs::rename(temp_dir, final_dir);
}

TrainState read_train_state(const std::string& dir, TrainConfig* config) {
  std::string path = (fs::path(dir) / kStateFile).string();
  std::ifstream in(path);
  MESHTRAIN_CHECK(in.good(), "checkpoint '{}': cannot read {}", dir, kStateFile);
  std::stringstream text;
  text << in.rdbuf();
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(text.str());
  } catch (const nlohmann::json::exception& e) {
    fail("{}: not valid JSON: {}", path, e.what());
  }
  auto field = [&](const nlohmann::json& object, const char* key) -> const nlohmann::json& {
    MESHTRAIN_CHECK(object.is_object() && object.contains(key), "{}: missing field '{}'", path,
                    key);
    return object.at(key);
  };
  auto integer = [&](const nlohmann::json& object, const char* key) -> int64_t {
    const nlohmann::json& v = field(object, key);
    MESHTRAIN_CHECK(v.is_number_integer() && v.get<int64_t>() >= 0,
                    "{}: field '{}' must be a non-negative integer", path, key);
    return v.get<int64_t>();
  };
  MESHTRAIN_CHECK(field(json, "format") == "meshtrain-train-state" && integer(json, "version") == 1,
                  "{}: not a meshtrain train state (version 1)", path);
  TrainState state;
  state.step = integer(json, "step");
  state.optimizer_step = integer(json, "optimizer_step");
  state.sampler.epoch = integer(field(json, "sampler"), "epoch");
  state.sampler.index = integer(field(json, "sampler"), "index");
  const nlohmann::json& seed = field(json, "seed");
  MESHTRAIN_CHECK(seed.is_number_unsigned() || (seed.is_number_integer() && seed.get<int64_t>() >= 0),
                  "{}: field 'seed' must be a non-negative integer", path);
  state.seed = seed.get<uint64_t>();
  if (config != nullptr) {
    try {
      *config = config_from_json(field(json, "config").dump());
    } catch (const Error& e) {
      fail("{}: {}", path, e.what());
    }
  }
  return state;
}

void load_checkpoint_tensors(const std::string& dir, const std::vector<Parameter>& params,
                             CheckpointTensors& tensors) {
  for (int which = 0; which < 3; ++which) {
    SafetensorsReader reader((fs::path(dir) / kTensorFiles[which]).string());
    MESHTRAIN_CHECK(reader.tensors().size() == params.size(),
                    "{}: {} tensors, the model has {} parameters", reader.path(),
                    reader.tensors().size(), params.size());
    for (const Parameter& p : params) {
      reader.read(p.spec.name, tensor_of(tensors, which).view(p.offset, p.spec.shape));
    }
  }
}

std::unique_ptr<Model> load_model_dir(const std::string& dir, Precision precision,
                                      cpu::CpuContext& ctx) {
  fs::path root(dir);
  MESHTRAIN_CHECK(fs::is_directory(root), "checkpoint '{}': not a directory", dir);
  if (fs::exists(root / kStateFile)) {
    TrainConfig config;
    read_train_state(dir, &config);
    auto model = std::make_unique<Model>(config.model, precision, ctx);
    load_model_weights(*model, (root / kModelFile).string());
    return model;
  }
  MESHTRAIN_CHECK(fs::exists(root / "config.json"),
                  "checkpoint '{}': neither a training step ({}) nor a Hugging Face directory "
                  "(config.json)",
                  dir, kStateFile);
  return import_hf(dir, precision, ctx);
}

}  // namespace meshtrain
