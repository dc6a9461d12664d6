// llm.c GPT-2 checkpoints (gpt2_124M.bin, gpt2_124M_bf16.bin): 256 little-endian
// int32 header words, [0] magic 20240326, [1] version (3: f32 weights, 5: bf16),
// [2] max_seq_len, [3] vocab_size V, [4] n_layers L, [5] n_heads, [6] channels C,
// [7] padded vocab Vp >= V, the rest zero; then every parameter, each kind for
// all layers in turn: wte [Vp, C] (rows V.. are padding, zero when written by
// llm.c's train_gpt2.py), wpe [maxT, C], ln1w, ln1b [L, C], qkvw [L, 3C, C], qkvb
// [L, 3C], attprojw [L, C, C], attprojb, ln2w, ln2b [L, C], fcw [L, 4C, C], fcb
// [L, 4C], fcprojw [L, C, 4C], fcprojb [L, C], lnfw, lnfb [C]. Matrices are
// [out, in] (llm.c's matmul_forward), the transpose of HF's Conv1D [in, out] that
// meshtrain's registry uses. The format fixes GPT-2's shape: tied output, MLP
// width 4C, LayerNorm eps 1e-5, tanh GELU.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "meshtrain/ckpt/weights.h"
#include "meshtrain/data/tokenizer.h"
#include "meshtrain/model/model.h"

namespace meshtrain {

inline constexpr int32_t kLlmcMagic = 20240326;
inline constexpr int32_t kLlmcVersionF32 = 3, kLlmcVersionBf16 = 5;

struct LlmcHeader {
  int32_t version = kLlmcVersionF32;
  int64_t padded_vocab = 0;
  ModelConfig config;
};

// Reads and checks the header and that the file size is exactly what it implies.
LlmcHeader read_llmc_header(const std::string& path);
// A GPT-2 model of the file's shape with its weights (bf16 files widen to f32).
std::unique_ptr<Model> import_llmc(const std::string& path, Precision precision, Backend& backend);
// Writes a GPT-2 model atomically: version 3 (f32) or 5 (bf16) by `dtype`, the
// vocabulary padded to a multiple of 128 with zero rows; with the run's
// `tokenizer`, also gpt2_tokenizer.bin (llm.c's format, ckpt/tokenizer_files.h)
// beside it, the file llm.c's samplers read. Error for a Llama or a shape the
// format cannot hold.
void export_llmc(const Model& model, const std::string& path, DType dtype = DType::f32,
                 const Tokenizer* tokenizer = nullptr);
// The same from any source of whole tensors (a sharded checkpoint), streamed.
void export_llmc(const ModelConfig& config, const TensorSource& source, const std::string& path,
                 DType dtype = DType::f32, const Tokenizer* tokenizer = nullptr);
// <directory of path>/gpt2_tokenizer.bin.
std::string llmc_tokenizer_path(const std::string& model_path);

// llm.c's padded vocabulary: V rounded up to a multiple of 128.
int64_t llmc_padded_vocab(int64_t vocab);

}  // namespace meshtrain
