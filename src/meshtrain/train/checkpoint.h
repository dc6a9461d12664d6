// Training checkpoints: one directory per step, <out_dir>/step_<N>/, in the
// sharded format of ckpt/distributed.h (each rank's slices + manifest.json,
// committed atomically, `latest` pointing at the newest) written by
// train/checkpointer.h. The manifest's `meta` object is the train state
// below: step, optimizer step, sampler position, seed, the update gates'
// state and the resolved config. Directories of the earlier whole-tensor format
// (model.safetensors, exp_avg.safetensors, exp_avg_sq.safetensors,
// train_state.json holding the same object) are still read.
// No config.json is written, so a step directory is never mistaken for a
// Hugging Face one (`meshtrain ckpt export --format hf` makes that).
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "meshtrain/data/sampler.h"
#include "meshtrain/ckpt/weights.h"
#include "meshtrain/data/tokenizer.h"
#include "meshtrain/model/model.h"
#include "meshtrain/train/config.h"

namespace meshtrain {

struct TrainState {
  int64_t step = 0;            // optimizer steps completed
  int64_t optimizer_step = 0;  // AdamW's bias-correction counter
  SamplerPosition sampler;
  uint64_t seed = 0;
  // The update gates' state (UpdateGates::state: loss scale, counters); null
  // in checkpoints from before the gates.
  nlohmann::json update_gates;
  // A QLoRA run with train.init_from: weights_digest of that directory when
  // the run began (its NF4 base is rebuilt from it on resume and export);
  // 0 otherwise and in older checkpoints.
  uint64_t base_digest = 0;
};

std::string step_dir_name(int64_t step);  // "step_100"

// The train state and resolved config as the JSON object a checkpoint holds.
nlohmann::json train_state_json(const TrainState& state, const TrainConfig& config);
// Reads a checkpoint's train state (the manifest's meta, or the whole-tensor
// format's train_state.json) and its saved config. Errors name the file and field.
TrainState read_train_state(const std::string& dir, TrainConfig* config = nullptr);
// True when `dir` is a training checkpoint of either format.
bool is_training_checkpoint(const std::string& dir);

// The settings that differ between a checkpoint's config and the one a
// resume runs with and that break exact continuation ("train.seed: 1 -> 2"),
// one line each. Settings a resume may change (steps, intervals, threads,
// out_dir, the parallel layout, [ckpt]) are not listed.
std::vector<std::string> resume_config_changes(const TrainConfig& saved, const TrainConfig& now);

// The files a run's tokenizer needs (data.gpt2_ranks for "gpt2", when it
// exists; a tokenizer.json or tokenizer.model with its tokenizer_config.json
// and chat_template.jinja), which every checkpoint carries
// (dist_ckpt::SaveOptions::carried_files).
std::vector<std::string> run_tokenizer_files(const DataSettings& data);
// The GPT-2 ranks file of the run that wrote checkpoint `dir`: the copy the
// checkpoint carries, else the path the run recorded (absolute; checkpoints from
// before the copy), so a checkpoint moved to another folder or machine still
// has its tokenizer.
std::string checkpoint_gpt2_ranks(const std::string& dir, const TrainConfig& run);

// make_tokenizer's kind for the run that wrote checkpoint `dir`: the
// tokenizer files the checkpoint carries, else the run's data.tokenizer.
std::string checkpoint_tokenizer_kind(const std::string& dir, const TrainConfig& run);

// The training run's tokenizer (checkpoint_tokenizer_kind, checkpoint_gpt2_ranks) for a
// training checkpoint whose model holds its ids; null for other directories or
// a run whose vocabulary is smaller than the tokenizer's. Error when the ranks
// file cannot be read.
std::unique_ptr<Tokenizer> checkpoint_tokenizer(const std::string& dir);

// The model of a directory load_model_dir reads: a training checkpoint's
// [model] or a Hugging Face config.json.
ModelConfig model_config_of_dir(const std::string& dir);

// train.init_from (parse_config calls it): config.model becomes the model of
// `from`; Error naming the key when one the config file set
// (config.model_keys) disagrees with it.
void apply_init_from_model(TrainConfig& config, const std::string& from);

// The tensors of a directory train.init_from may name, each read whole on
// request (names and global shapes of `config`'s registry; Error naming a
// missing tensor or another shape): a Hugging Face directory or a sharded
// training checkpoint one tensor at a time; an earlier whole-tensor
// checkpoint through a model loaded first (held by the source).
struct DirTensors {
  ModelConfig config;  // the directory's model
  TensorSource source;
};
DirTensors dir_tensors(const std::string& dir, MemoryTracker& tracker, Backend& backend);

// A digest of the weights in `dir`: XXH3-64 of a sharded checkpoint's
// manifest (which lists every file's XXH3-64), or of every *.safetensors file
// of a Hugging Face directory or whole-tensor checkpoint, in name order.
uint64_t weights_digest(const std::string& dir);
// Error (config) naming train.init_from `dir` when its digest `now` is not
// the one `what` recorded (0: nothing recorded, nothing checked).
void check_base_digest(const std::string& dir, uint64_t now, uint64_t recorded,
                       const std::string& what);

// A model from a directory: a training step directory (either format) or a
// Hugging Face one (config.json + model.safetensors).
// QLoRA: fills `model`'s NF4 weights (ParamSpec::nf4; not in the shard map,
// not state), each read whole from `source` (global shape), quantised whole
// and cut to this rank's slice (Model::copy_nf4_from_global).
void load_nf4_weights(Model& model, const TensorSource& source);
std::unique_ptr<Model> load_model_dir(const std::string& dir, Precision precision,
                                      Backend& backend);

}  // namespace meshtrain
