// Tokenizer files that travel with exported weights, so the ids mean the same
// in the tools that read the export.
//
// Hugging Face (tokenizers' tokenizer.json, read by AutoTokenizer): a
// tokenizer read from files (Tokenizer::files(): a model folder's
// tokenizer.json or tokenizer.model, tokenizer_config.json,
// chat_template.jinja) is those files as they are. Otherwise a BPE
// model behind the ByteLevel pre-tokenizer (GPT-2's regex) and decoder. GPT-2:
// its 50256 ranks as the vocabulary (bytes written in ByteLevel's printable
// alphabet) and their merges, <|endoftext|> 50256 as an added special token and
// as bos/eos. tiktoken ranks carry no merge list: the merge that makes token r
// is the pair BPE stops at on r's bytes with only ranks below r allowed (as HF's
// tiktoken conversion does). Bytes: 256 one-byte tokens (id = byte), no merges,
// NUL (id 0, the document separator) as bos/eos.
//
// llama2.c tokenizer.bin: int32 max_token_length, then for every id of the
// model's vocabulary: f32 score, int32 length, the token's bytes. Scores are
// -rank for BPE tokens (llama2.c merges the highest score first, i.e. the
// lowest rank) and 0 otherwise; ids past the tokenizer (a padded vocabulary)
// are empty tokens.
//
// llm.c gpt2_tokenizer.bin (what its samplers decode with): 256 uint32 header
// words ([0] magic 20240328, [1] version 2, [2] the tokenizer's vocabulary,
// [3] the eot id), then per id a uint8 length (>= 1) and the token's bytes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "meshtrain/data/tokenizer.h"

namespace meshtrain {

// The id that starts (bos) and ends (eos) a document: the tokenizer's eot,
// and its post-processor's first token for bos when it has one.
struct SpecialIds {
  int32_t bos = 0, eos = 0;
};
SpecialIds special_ids(const Tokenizer& tokenizer);

std::string hf_tokenizer_json(const Tokenizer& tokenizer);
std::string hf_tokenizer_config_json(const Tokenizer& tokenizer, int64_t model_max_length);
std::string hf_generation_config_json(const Tokenizer& tokenizer);
// Writes the three files above into `dir`, each atomically.
void write_hf_tokenizer(const Tokenizer& tokenizer, int64_t model_max_length,
                        const std::string& dir);

struct Llama2cToken {
  float score = 0;
  std::string bytes;
};
// `vocab_size` >= the tokenizer's ids (the model's vocabulary).
void write_llama2c_tokenizer(const Tokenizer& tokenizer, int64_t vocab_size,
                             const std::string& path);
// Reads `vocab_size` tokens back; Error naming the file on a short or
// inconsistent file (a token longer than max_token_length, bytes left over).
std::vector<Llama2cToken> read_llama2c_tokenizer(const std::string& path, int64_t vocab_size);

inline constexpr uint32_t kLlmcTokenizerMagic = 20240328;
void write_llmc_tokenizer(const Tokenizer& tokenizer, const std::string& path);
// The tokens of a gpt2_tokenizer.bin (versions 1 and 2); `eot` gets the eot id.
// Error naming the file on a bad header or a short file.
std::vector<std::string> read_llmc_tokenizer(const std::string& path, int32_t* eot = nullptr);

}  // namespace meshtrain
