// Native weight files: safetensors holding every registry parameter under its
// registry name (Hugging Face names) and in the registry's layout. That layout
// is Hugging Face's except for Llama's q_proj/k_proj rows, which meshtrain keeps
// in interleaved-pair RoPE order (see hf.h for the export that permutes them).
#pragma once

#include <functional>
#include <map>
#include <string>

#include "meshtrain/ckpt/safetensors.h"
#include "meshtrain/model/model.h"

namespace meshtrain {

// Where an export reads whole f32 tensors from, one at a time (registry
// order, the whole model's specs): a model in memory, or a sharded
// checkpoint tensor by tensor, so memory stays at one tensor.
using TensorSource = std::function<void(const ParamSpec& spec, float* out)>;
// A model's master weights as a TensorSource (the model must outlive it).
TensorSource model_tensors(const Model& model);

// Writes every parameter's master weights (converted to `dtype`), atomically.
void save_model_weights(const Model& model, const std::string& path, DType dtype = DType::f32,
                        const std::map<std::string, std::string>& metadata = {});

// Loads every registry parameter by name (any float dtype -> f32 master) and
// refreshes the compute copies. A missing tensor, a shape mismatch or a tensor
// the model does not have is an Error naming the file and tensor.
void load_model_weights(Model& model, const SafetensorsReader& reader);
void load_model_weights(Model& model, const std::string& path);

}  // namespace meshtrain
