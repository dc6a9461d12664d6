// llama2.c "legacy" (version 0) checkpoints: 7 little-endian int32 (dim,
// hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, max_seq_len), then
// f32 tensors: token embedding, then each kind for all layers in turn
// (rms_att, wq, wk, wv, wo, rms_ffn, w1, w2, w3), rms_final, then two unused
// RoPE tables freq_cis_real/imag [max_seq_len, head_dim/2] (present in every
// v0 file, e.g. stories260K.bin), then the classifier only when vocab_size is
// negative (untied). Weights are nn.Linear [out, in]. llama2.c rotates
// interleaved pairs like meshtrain, so wq/wk rows map directly; w1 = gate,
// w3 = up, w2 = down. The format fixes RMSNorm eps 1e-5 and RoPE theta 10000.
#pragma once

#include <memory>
#include <string>

#include "meshtrain/ckpt/weights.h"
#include "meshtrain/data/tokenizer.h"
#include "meshtrain/model/model.h"

namespace meshtrain {

// Header -> config; checks the header and that the file size is exactly what it implies.
ModelConfig read_llama2c_config(const std::string& path);
// Loads the weights into a model of the file's shape (read_llama2c_config's).
void load_llama2c_weights(Model& model, const std::string& path);
std::unique_ptr<Model> import_llama2c(const std::string& path, Precision precision,
                                      Backend& backend);
// Writes a Llama model (norm eps 1e-5, theta 10000, no RoPE scaling, else
// Error) atomically; with the run's `tokenizer`, also tokenizer.bin (llama2.c's
// format, ckpt/tokenizer_files.h) beside it, which llama2.c's run reads by default.
void export_llama2c(const Model& model, const std::string& path,
                    const Tokenizer* tokenizer = nullptr);
// The same from any source of whole tensors (a sharded checkpoint), streamed.
void export_llama2c(const ModelConfig& config, const TensorSource& source,
                    const std::string& path, const Tokenizer* tokenizer = nullptr);
// <directory of path>/tokenizer.bin.
std::string llama2c_tokenizer_path(const std::string& model_path);

}  // namespace meshtrain
