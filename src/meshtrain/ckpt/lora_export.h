// LoRA adapters on the way out of meshtrain: the merged base model and PEFT's
// adapter-only layout.
//
// A LoRA checkpoint holds, next to the frozen base weights under their usual
// names, per adapted linear `<module>` (its Hugging Face module name,
// "model.layers.0.self_attn.q_proj", "transformer.h.0.attn.c_attn"):
//   <module>.lora_A.weight  [rank, in_features]
//   <module>.lora_B.weight  [out_features, rank]
// (PEFT's shapes whatever the base's orientation: GPT-2's Conv1D base is stored
// [in, out]). lora_B's rows are in the base's stored row order, so Llama's
// q_proj/k_proj lora_B rows are in meshtrain's interleaved-RoPE order and are
// permuted to HF's like the base (hf.h). The layer computes
//   y = x W^T + scale · (x A^T) B^T,   scale = alpha / rank,
// so the merged weight is W + scale · B A (Conv1D: W + scale · (B A)^T).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "meshtrain/ckpt/weights.h"
#include "meshtrain/model/config.h"
#include "meshtrain/tensor/dtype.h"

namespace meshtrain {

// One adapted base linear of a model (config.lora, model/config.h), from the
// registry: the base weight and its two adapters.
struct LoraModule {
  std::string module;  // "model.layers.0.self_attn.q_proj"
  ParamSpec base;      // its weight ("<module>.weight")
  ParamSpec a, b;      // "<module>.lora_A.weight" [rank, in], "<module>.lora_B.weight" [out, rank]
  int64_t in_features = 0, out_features = 0, rank = 0;
  bool conv1d = false;  // GPT-2: the base is stored [in, out]
};

// The adapted linears of `config` in registry order (none when config.lora is off).
std::vector<LoraModule> lora_modules(const ModelConfig& config);
// `config` without adapters (lora off): the model a merged export writes.
ModelConfig without_lora(const ModelConfig& config);

// True for "<module>.lora_A.weight" / "<module>.lora_B.weight".
bool is_lora_tensor(const std::string& name);

// w += scale · B A (conv1d: w += scale · (B A)^T), with a: [rank, in], b: [out,
// rank], w: [out, in] (conv1d: [in, out]). Each element is computed in double
// (the r products and the add) and rounded once to f32.
void merge_lora_delta(const float* a, const float* b, int64_t rank, int64_t in_features,
                      int64_t out_features, float scale, bool conv1d, float* w);

// The tensors of without_lora(config) with the adapters merged in: for an
// adapted module W + scale · B A, every other tensor as `source` (a LoRA
// checkpoint: base and adapters) gives it. Asked for an adapter, an Error: an
// export of without_lora(config) never asks, so hf, llmc and llama2c exports
// write a plain model.
TensorSource merge_lora(const ModelConfig& config, TensorSource source);

// PEFT's adapter-only layout in `dir`: adapter_config.json (peft_type LORA, r,
// lora_alpha, lora_dropout, target_modules, fan_in_fan_out = true for GPT-2's
// Conv1D, bias none, task_type CAUSAL_LM, base_model_name_or_path = `base_model`
// or null) and adapter_model.safetensors with PEFT's names
// "base_model.model.<module>.lora_A.weight" / ".lora_B.weight" (Llama's q/k
// lora_B rows permuted to HF's order), converted to `dtype`. Each file atomic.
void export_peft(const ModelConfig& config, const TensorSource& source, const std::string& dir,
                 const std::string& base_model = "", DType dtype = DType::f32);

// An adapter PEFT wrote (or export_peft) for the base model `base`: `config`
// is `base` with the adapter's LoRA settings, `tensors` every module's adapters
// under meshtrain's names and row order ("<module>.lora_A.weight"), f32. Errors name the file and key: a peft_type other than LORA, features
// meshtrain does not implement (bias, DoRA, rsLoRA, per-module ranks or alphas,
// layers_to_transform), a missing or misshaped adapter, a tensor for no module.
struct PeftAdapter {
  ModelConfig config;
  std::string base_model;  // base_model_name_or_path ("" when null)
  std::map<std::string, std::vector<float>> tensors;
};
PeftAdapter read_peft_adapter(const std::string& dir, const ModelConfig& base);

// `base` (the base model's tensors) with the adapter's added: a source for
// merge_lora(adapter.config, ...) over an HF directory + a PEFT adapter.
TensorSource with_adapter(TensorSource base, const PeftAdapter& adapter);

}  // namespace meshtrain
