// Training checkpoints: one directory per step,
//   <out_dir>/step_<N>/model.safetensors       f32 master weights (ckpt/weights.h: HF names,
//                                              meshtrain's q/k row order)
//                      exp_avg.safetensors     AdamW first moments, same tensor names
//                      exp_avg_sq.safetensors  AdamW second moments, same tensor names
//                      train_state.json        step, optimizer step, sampler position,
//                                              seed and the resolved config
// written under a temporary name and renamed into place, so a step directory
// either is complete or does not exist. No config.json is written, so a step
// directory is never mistaken for a Hugging Face one (`meshtrain ckpt export
// --format hf` makes that).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "meshtrain/data/sampler.h"
#include "meshtrain/model/model.h"
#include "meshtrain/optim/adamw.h"
#include "meshtrain/train/config.h"

namespace meshtrain {

struct TrainState {
  int64_t step = 0;            // optimizer steps completed
  int64_t optimizer_step = 0;  // AdamW's bias-correction counter
  SamplerPosition sampler;
  uint64_t seed = 0;
};

std::string step_dir_name(int64_t step);  // "step_100"

// A checkpoint's tensors, whole, in the flat model layout: parameter i at
// params[i].offset, num_params f32 elements each. The flat model's buffers and
// AdamW's moments are this layout; ZeRO gathers its shards into it.
struct CheckpointTensors {
  Tensor master, exp_avg, exp_avg_sq;
};

// Writes the checkpoint to `dir` (replacing an existing one) atomically.
void save_checkpoint(const std::string& dir, const std::vector<Parameter>& params,
                     const CheckpointTensors& tensors, const TrainState& state,
                     const TrainConfig& config);

// Reads train_state.json: the state and the saved config. Errors name the file and field.
TrainState read_train_state(const std::string& dir, TrainConfig* config = nullptr);

// Reads weights and optimizer state into `tensors` (allocated by the caller,
// num_params f32 each). A missing, extra or misshapen tensor is an Error
// naming the file and tensor.
void load_checkpoint_tensors(const std::string& dir, const std::vector<Parameter>& params,
                             CheckpointTensors& tensors);

// A model from a directory: a training step directory (train_state.json) or a
// Hugging Face one (config.json + model.safetensors).
std::unique_ptr<Model> load_model_dir(const std::string& dir, Precision precision,
                                      cpu::CpuContext& ctx);

}  // namespace meshtrain
