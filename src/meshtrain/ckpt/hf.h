// Hugging Face checkpoints: <dir>/model.safetensors + <dir>/config.json for
// LlamaForCausalLM or GPT2LMHeadModel, loadable by transformers as they are.
//
// RoPE layout: meshtrain (like Meta's Llama and llama2.c) rotates interleaved
// pairs (x[2i], x[2i+1]) of each head; HF's Llama rotates halves (x[i],
// x[i + hd/2]) ("rotate_half"). Both compute the same function once each
// head's q_proj and k_proj output rows are permuted: HF row c*hd/2 + i holds
// meshtrain row 2i + c (c in {0, 1}), which is permute() in HF's
// convert_llama_weights_to_hf.py. Export applies it, import inverts it.
// GPT-2 needs nothing: the registry already uses HF's Conv1D [in, out] layout.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "meshtrain/ckpt/tokenizer_files.h"
#include "meshtrain/ckpt/weights.h"
#include "meshtrain/model/model.h"

namespace meshtrain {

// config.json text for the model shape; `dtype` is recorded as torch_dtype;
// `special` (when given) as bos_token_id / eos_token_id.
std::string hf_config_json(const ModelConfig& config, DType dtype = DType::f32,
                           const SpecialIds* special = nullptr);
// Parses config.json text; `source` names the file in errors. RoPE settings are
// read in every form transformers writes ("rope_parameters", or "rope_theta" +
// "rope_scaling"); RoPE types default, linear and llama3 are implemented. Rejects,
// naming the key, features meshtrain does not implement (other RoPE types or
// keys, biases in Llama, other activations).
ModelConfig parse_hf_config(std::string_view json_text, std::string_view source);
ModelConfig read_hf_config(const std::string& config_json_path);

// Writes <dir>/model.safetensors (weights converted to `dtype`) and
// <dir>/config.json, each atomically; with the run's `tokenizer`, also its
// files (ckpt/tokenizer_files.h) and its special ids in config.json. A tied
// output layer is not stored (HF's convention). Non-const only because the
// permuted copies use the model's tracker.
void export_hf(Model& model, const std::string& dir, DType dtype = DType::f32,
               const Tokenizer* tokenizer = nullptr);
// The same from any source of whole tensors (a sharded checkpoint), streamed:
// one tensor (and its converted copy) in memory at a time.
void export_hf(const ModelConfig& config, const TensorSource& source, const std::string& dir,
               DType dtype = DType::f32, const Tokenizer* tokenizer = nullptr);

// For an export of weights that came from the Hugging Face directory `src`:
// copies its tokenizer files (tokenizer.json, tokenizer_config.json,
// special_tokens_map.json, generation_config.json, vocab.json, merges.txt,
// tokenizer.model, those present) into `dst` and its bos/eos/pad token ids
// into dst/config.json, so they travel with the weights. Returns the files copied.
std::vector<std::string> copy_hf_tokenizer(const std::string& src, const std::string& dst);

// Loads HF weights (F32/BF16/F16/F64 -> f32 master) from <dir>/model.safetensors,
// or from the files of a sharded checkpoint's <dir>/model.safetensors.index.json
// (its weight_map must name every tensor of those files), into a model of the
// right shape: every parameter must be present with HF's shape; unknown tensors are
// an Error, except buffers HF sometimes saves (attn.bias, attn.masked_bias,
// rotary_emb.inv_freq) and a stored copy of a tied lm_head. GPT-2 names are
// also found without the "transformer." prefix (checkpoints of GPT2Model).
void load_hf_weights(Model& model, const std::string& dir);

// The whole tensors of the HF checkpoint in <dir> for a model of `config`
// (its registry: every parameter present, extras as load_hf_weights allows —
// both checked here, naming the tensor), in meshtrain's layout (q/k rows
// permuted back), read one at a time on demand: loading a model from it holds
// one tensor's f32 copy (category workspace of `tracker`) beyond the model.
TensorSource hf_tensors(const std::string& dir, const ModelConfig& config, MemoryTracker& tracker);

// read_hf_config(<dir>/config.json), a new model, load_hf_weights(dir).
std::unique_ptr<Model> import_hf(const std::string& dir, Precision precision, Backend& backend);

// Which RoPE rows the tensor `name` has, as (heads, head_dim): the q_proj
// and k_proj weights and biases, and the QK-norm weights (one head's, or
// every head's) (heads == 0 for every other tensor); its columns are the
// rest of its elements. A LoRA lora_B of those modules has the same rows
// (ckpt/lora_export.h).
std::pair<int64_t, int64_t> rope_rows(const ModelConfig& config, const std::string& name);
// The q/k row permutation for one [heads * head_dim, cols] weight.
void rope_rows_to_hf(const float* src, float* dst, int64_t heads, int64_t head_dim, int64_t cols);
void rope_rows_from_hf(const float* src, float* dst, int64_t heads, int64_t head_dim,
                       int64_t cols);

}  // namespace meshtrain
