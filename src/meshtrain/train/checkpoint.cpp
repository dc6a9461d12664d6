#include "meshtrain/train/checkpoint.h"

#include <fmt/format.h>
#include <xxhash.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>

#include "meshtrain/ckpt/distributed.h"
#include "meshtrain/ckpt/hf.h"
#include "meshtrain/ckpt/weights.h"
#include "meshtrain/util/error.h"

namespace meshtrain {
namespace {

namespace fs = std::filesystem;

constexpr const char* kStateFile = "train_state.json";  // the whole-tensor format

TrainState parse_train_state(const nlohmann::json& json, const std::string& path,
                             TrainConfig* config) {
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
  if (json.contains("update_gates")) state.update_gates = json.at("update_gates");
  if (json.contains("base_digest")) {
    const nlohmann::json& digest = json.at("base_digest");
    MESHTRAIN_CHECK(digest.is_string() && digest.get<std::string>().size() == 16 &&
                        std::ranges::all_of(digest.get<std::string>(),
                                            [](char c) { return std::isxdigit(c) != 0; }),
                    "{}: field 'base_digest' must be 16 hex digits", path);
    state.base_digest = std::stoull(digest.get<std::string>(), nullptr, 16);
  }
  if (config != nullptr) {
    try {
      *config = config_from_json(field(json, "config").dump());
    } catch (const Error& e) {
      fail("{}: {}", path, e.what());
    }
  }
  return state;
}

// "section.key" -> the value as JSON text.
std::map<std::string, std::string> flat_settings(const TrainConfig& config) {
  std::map<std::string, std::string> out;
  const nlohmann::json json = nlohmann::json::parse(config_to_json(config));
  for (const auto& [section, keys] : json.items()) {
    for (const auto& [key, value] : keys.items()) out[section + "." + key] = value.dump();
  }
  return out;
}

// Settings a resume may change without breaking exact continuation (or that
// change it on purpose: the layout reshards; a different layout continues
// within float tolerance). Activation checkpointing is bit-exact, and older
// checkpoints do not name it.
bool may_change_on_resume(const std::string& key) {
  static const char* const kFree[] = {"train.steps",        "train.eval_interval",
                                      "train.eval_batches", "train.log_interval",
                                      "train.threads",      "train.peak_flops",
                                      "train.checkpoint_interval", "train.out_dir",
                                      "train.recompute",    "train.recompute_layers",
                                      "train.trace_steps",  "data.gpt2_ranks"};
  for (const char* k : kFree) {
    if (key == k) return true;
  }
  return key.starts_with("parallel.") || key.starts_with("ckpt.") || key.starts_with("comm.");
}

}  // namespace

std::string step_dir_name(int64_t step) { return fmt::format("step_{}", step); }

nlohmann::json train_state_json(const TrainState& state, const TrainConfig& config) {
  nlohmann::json json{{"format", "meshtrain-train-state"},
                      {"version", 1},
                      {"step", state.step},
                      {"optimizer_step", state.optimizer_step},
                      {"sampler", {{"epoch", state.sampler.epoch}, {"index", state.sampler.index}}},
                      {"seed", state.seed},
                      {"config", nlohmann::json::parse(config_to_json(config))}};
  if (!state.update_gates.is_null()) json["update_gates"] = state.update_gates;
  if (state.base_digest != 0) json["base_digest"] = fmt::format("{:016x}", state.base_digest);
  return json;
}

bool is_training_checkpoint(const std::string& dir) {
  return dist_ckpt::is_sharded_checkpoint(dir) || fs::exists(fs::path(dir) / kStateFile);
}

TrainState read_train_state(const std::string& dir, TrainConfig* config) {
  if (dist_ckpt::is_sharded_checkpoint(dir)) {
    return parse_train_state(dist_ckpt::read_manifest(dir).meta,
                             (fs::path(dir) / "manifest.json").string(), config);
  }
  std::string path = (fs::path(dir) / kStateFile).string();
  std::ifstream in(path);
  MESHTRAIN_CHECK(in.good(), "checkpoint '{}': cannot read manifest.json or {}", dir, kStateFile);
  std::stringstream text;
  text << in.rdbuf();
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(text.str());
  } catch (const nlohmann::json::exception& e) {
    fail("{}: not valid JSON: {}", path, e.what());
  }
  return parse_train_state(json, path, config);
}

std::vector<std::string> resume_config_changes(const TrainConfig& saved, const TrainConfig& now) {
  const auto before = flat_settings(saved), after = flat_settings(now);
  std::vector<std::string> changes;
  for (const auto& [key, value] : after) {
    auto it = before.find(key);
    const std::string old = it == before.end() ? "(unset)" : it->second;
    if (old != value && !may_change_on_resume(key)) {
      changes.push_back(fmt::format("{}: {} -> {}", key, old, value));
    }
  }
  return changes;
}

namespace {

// Writes the master values into the model; the moments a checkpoint also
// holds are dropped.
class MasterOnly final : public layout::StateAccess {
 public:
  explicit MasterOnly(Model& model) : model_(model) {}
  void read(layout::StateKind, int64_t, int64_t, float*) override {
    fail("load: the model holds no optimizer state to read");
  }
  void write(layout::StateKind kind, int64_t offset, int64_t count, const float* in) override {
    MESHTRAIN_CHECK(kind == layout::StateKind::master, "load: the model holds no {}",
                    layout::state_kind_name(kind));
    model_.write_values(offset, count, in);
  }

 private:
  Model& model_;
};

}  // namespace

std::vector<std::string> run_tokenizer_files(const DataSettings& data) {
  if (data.tokenizer == "gpt2") {
    return fs::is_regular_file(data.gpt2_ranks) ? std::vector<std::string>{data.gpt2_ranks}
                                                : std::vector<std::string>{};
  }
  std::vector<std::string> paths;
  for (const Tokenizer::File& f : tokenizer_files(data.tokenizer)) paths.push_back(f.path);
  return paths;
}

std::string checkpoint_gpt2_ranks(const std::string& dir, const TrainConfig& run) {
  const fs::path carried = fs::path(dir) / fs::path(run.data.gpt2_ranks).filename();
  return fs::is_regular_file(carried) ? carried.string() : run.data.gpt2_ranks;
}

std::string checkpoint_tokenizer_kind(const std::string& dir, const TrainConfig& run) {
  const std::string& kind = run.data.tokenizer;
  if (kind == "gpt2" || kind == "bytes") return kind;
  // A folder's files are carried under their own names, a lone file under its file name.
  const bool folder = fs::is_directory(kind) || !fs::path(kind).has_extension();
  if (folder && (fs::exists(fs::path(dir) / "tokenizer.json") ||
                 fs::exists(fs::path(dir) / "tokenizer.model"))) {
    return dir;
  }
  const fs::path file = fs::path(dir) / fs::path(kind).filename();
  return !folder && fs::is_regular_file(file) ? file.string() : kind;
}

std::unique_ptr<Tokenizer> checkpoint_tokenizer(const std::string& dir) {
  if (!is_training_checkpoint(dir)) return nullptr;
  TrainConfig run;
  read_train_state(dir, &run);
  std::unique_ptr<Tokenizer> tokenizer =
      make_tokenizer(checkpoint_tokenizer_kind(dir, run), checkpoint_gpt2_ranks(dir, run));
  if (tokenizer->vocab_size() > run.model.vocab_size) return nullptr;
  return tokenizer;
}

namespace {

// A checkpoint path must name a directory. The error_code form: a path the
// system refuses (a name past NAME_MAX, found by fuzz_config_overrides through
// train.init_from) is this error, not a std::filesystem exception.
void check_checkpoint_dir(const std::string& dir) {
  std::error_code ec;
  const bool is_dir = fs::is_directory(dir, ec);
  MESHTRAIN_CHECK(is_dir, "checkpoint '{}': not a directory{}", dir,
                  ec ? fmt::format(" ({})", ec.message()) : "");
}

}  // namespace

ModelConfig model_config_of_dir(const std::string& dir) {
  check_checkpoint_dir(dir);
  if (is_training_checkpoint(dir)) {
    TrainConfig config;
    read_train_state(dir, &config);
    return config.model;
  }
  MESHTRAIN_CHECK(fs::exists(fs::path(dir) / "config.json"),
                  "checkpoint '{}': neither a training step (manifest.json) nor a Hugging Face "
                  "directory (config.json)",
                  dir);
  return read_hf_config((fs::path(dir) / "config.json").string());
}

void apply_init_from_model(TrainConfig& config, const std::string& from) {
  TrainConfig theirs = config;
  theirs.model = model_config_of_dir(from);
  theirs.model_preset.clear();
  // The directory gives the base only; the run's own [lora] (read after this) adds adapters.
  MESHTRAIN_CHECK(!theirs.model.lora.enabled(),
                  "config: train.init_from '{}' is a LoRA run's checkpoint (its lora.rank = {}): "
                  "init_from reads a base model; merge its adapters first (meshtrain ckpt export "
                  "--merge-lora) or continue that run with --resume",
                  from, theirs.model.lora.rank);
  const nlohmann::json mine_json = nlohmann::json::parse(config_to_json(config))["model"];
  const nlohmann::json their_json = nlohmann::json::parse(config_to_json(theirs))["model"];
  const bool preset = std::find(config.model_keys.begin(), config.model_keys.end(), "preset") !=
                      config.model_keys.end();
  for (const auto& [key, value] : mine_json.items()) {
    const bool set = preset || std::find(config.model_keys.begin(), config.model_keys.end(), key) !=
                                   config.model_keys.end();
    if (!set || !their_json.contains(key) || their_json[key] == value) continue;
    fail("config: model.{} = {} disagrees with train.init_from '{}' ({}); the model comes from "
         "that directory: remove the key or make it agree",
         key, value.dump(), from, their_json[key].dump());
  }
  config.model = theirs.model;
  config.model_preset.clear();
}

namespace {

// A QLoRA checkpoint holds no NF4 base (ParamSpec::nf4): it is rebuilt as the
// run started it, from the seed and then train.init_from's weights, one
// tensor at a time.
void rebuild_nf4_base(Model& model, const TrainSettings& run, uint64_t digest, Backend& backend,
                      const std::string& dir) {
  model.init_weights(run.seed);
  if (run.init_from.empty()) return;
  if (digest != 0) {
    check_base_digest(run.init_from, weights_digest(run.init_from), digest,
                      fmt::format("checkpoint '{}'", dir));
  }
  load_nf4_weights(model, dir_tensors(run.init_from, backend.tracker(), backend).source);
}

}  // namespace

DirTensors dir_tensors(const std::string& dir, MemoryTracker& tracker, Backend& backend) {
  DirTensors out;
  TensorSource read;
  if (dist_ckpt::is_sharded_checkpoint(dir)) {
    TrainConfig config;
    read_train_state(dir, &config);
    out.config = config.model;
    read = [dir, manifest = dist_ckpt::read_manifest(dir)](const ParamSpec& spec, float* values) {
      dist_ckpt::read_global_tensor(manifest, dir, spec.name, layout::StateKind::master, values);
    };
  } else if (is_training_checkpoint(dir)) {
    std::shared_ptr<const Model> whole = load_model_dir(dir, Precision::fp32, backend);
    out.config = whole->config();
    read = [whole, source = model_tensors(*whole)](const ParamSpec& spec, float* values) {
      source(spec, values);
    };
  } else {
    out.config = read_hf_config((fs::path(dir) / "config.json").string());
    read = hf_tensors(dir, out.config, tracker);
  }
  std::map<std::string, ParamSpec> specs;
  for (ParamSpec& spec : build_param_specs(out.config)) specs.emplace(spec.name, std::move(spec));
  out.source = [dir, specs = std::move(specs), read](const ParamSpec& want, float* values) {
    const auto it = specs.find(want.name);
    MESHTRAIN_CHECK(it != specs.end() && it->second.shape == want.split.global_shape,
                    "init_from '{}': tensor '{}' {}, the model's is {}", dir, want.name,
                    it == specs.end() ? "is missing" : "is " + shape_str(it->second.shape),
                    shape_str(want.split.global_shape));
    read(it->second, values);
  };
  return out;
}

uint64_t weights_digest(const std::string& dir) {
  std::vector<fs::path> files;
  if (dist_ckpt::is_sharded_checkpoint(dir)) {
    files.push_back(fs::path(dir) / "manifest.json");
  } else {
    for (const fs::directory_entry& e : fs::directory_iterator(dir)) {
      if (e.path().extension() == ".safetensors") files.push_back(e.path());
    }
    std::sort(files.begin(), files.end());
  }
  XXH3_state_t* state = XXH3_createState();
  MESHTRAIN_CHECK(state != nullptr, "init_from '{}': cannot start a checksum", dir);
  const std::unique_ptr<XXH3_state_t, XXH_errorcode (*)(XXH3_state_t*)> owned(state,
                                                                              XXH3_freeState);
  XXH3_64bits_reset(state);
  std::vector<char> buffer(size_t{4} << 20);
  for (const fs::path& file : files) {
    const std::string name = file.filename().string();
    XXH3_64bits_update(state, name.data(), name.size());
    std::ifstream in(file, std::ios::binary);
    MESHTRAIN_CHECK_AS(ErrorKind::io, in.good(), "init_from: cannot read '{}'", file.string());
    while (in) {
      in.read(buffer.data(), static_cast<std::streamsize>(buffer.size()));
      XXH3_64bits_update(state, buffer.data(), static_cast<size_t>(in.gcount()));
    }
    MESHTRAIN_CHECK_AS(ErrorKind::io, in.eof(), "init_from: reading '{}' failed", file.string());
  }
  return XXH3_64bits_digest(state);
}

void check_base_digest(const std::string& dir, uint64_t now, uint64_t recorded,
                       const std::string& what) {
  MESHTRAIN_CHECK(recorded == 0 || now == recorded,
                  "train.init_from '{}' has changed since the run began (weights digest {:016x}, "
                  "{} recorded {:016x}): a QLoRA run rebuilds its NF4 base from it; point "
                  "train.init_from at the weights the run started from",
                  dir, now, what, recorded);
}

void load_nf4_weights(Model& model, const TensorSource& source) {
  std::vector<float> global;
  for (Parameter& p : model.params()) {
    if (!p.spec.nf4) continue;
    const ParamSpec whole = whole_spec(p.spec);
    global.resize(static_cast<size_t>(whole.numel()));
    source(whole, global.data());
    model.copy_nf4_from_global(p, global.data());
  }
}

std::unique_ptr<Model> load_model_dir(const std::string& dir, Precision precision,
                                      Backend& backend) {
  fs::path root(dir);
  check_checkpoint_dir(dir);
  if (is_training_checkpoint(dir)) {
    TrainConfig config;
    const TrainState state = read_train_state(dir, &config);
    auto model = std::make_unique<Model>(config.model, precision, backend);
    if (model->holds_nf4()) rebuild_nf4_base(*model, config.train, state.base_digest, backend, dir);
    if (dist_ckpt::is_sharded_checkpoint(dir)) {
      MasterOnly master(*model);
      dist_ckpt::load_checkpoint(dir, layout::master_weights_only(model->shard_map()), master,
                                 static_cast<int64_t>(config.ckpt.buffer_mb * 1024 * 1024));
      model->sync_compute_weights();
    } else {
      load_model_weights(*model, (root / "model.safetensors").string());
    }
    return model;
  }
  MESHTRAIN_CHECK(fs::exists(root / "config.json"),
                  "checkpoint '{}': neither a training step (manifest.json) nor a Hugging Face "
                  "directory (config.json)",
                  dir);
  return import_hf(dir, precision, backend);
}

}  // namespace meshtrain
