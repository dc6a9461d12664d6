// SentencePiece models (tokenizer.model: Llama 2, Mistral, Gemma) through
// Debian's libsentencepiece, with the model's own normalization, byte
// fallback and unknown-piece rules. Its BOS (when the model has one) starts
// each sequence and each document, as Hugging Face's Llama tokenizers add it.
// encode() reads control pieces written out in the text ("</s>", "[INST]") as
// those pieces, as Hugging Face's slow Llama tokenizer does, and encodes the
// text between them as SentencePiece does (each stretch with its dummy prefix).
#pragma once

#include <array>
#include <memory>
#include <string>

#include "meshtrain/data/hf_tokenizer.h"
#include "meshtrain/data/tokenizer.h"

namespace sentencepiece {
class SentencePieceProcessor;
}

namespace meshtrain {

class SpmTokenizer final : public Tokenizer {
 public:
  // `config` adds a tokenizer_config.json's chat template and token names;
  // `files`: what files() reports. Error naming the file when it is not a
  // SentencePiece model.
  static std::unique_ptr<SpmTokenizer> load(const std::string& path, TokenizerConfig config = {},
                                            std::vector<File> files = {});
  ~SpmTokenizer() override;

  std::string name() const override { return path_; }
  int64_t vocab_size() const override;
  int32_t eot_id() const override;  // the model's </s>
  using Tokenizer::encode_ordinary;
  void encode_ordinary(std::string_view text, std::vector<int32_t>& ids) const override;
  void encode(std::string_view text, std::vector<int32_t>& ids, bool add_special) const override;
  std::string decode(std::span<const int32_t> ids) const override;
  std::optional<int32_t> token_id(std::string_view token) const override;
  bool is_special(int32_t id) const override;  // a control piece (<s>, </s>, [INST])
  std::string token_text(int32_t id) const override;
  DocumentFrame document_frame() const override;
  std::vector<File> files() const override { return files_; }
  const TokenizerConfig& config() const override { return config_; }

 private:
  SpmTokenizer(std::string path, TokenizerConfig config);
  std::string path_;
  TokenizerConfig config_;
  std::vector<File> files_;
  std::unique_ptr<sentencepiece::SentencePieceProcessor> sp_;
  std::vector<std::pair<std::string, int32_t>> controls_;  // written-out control pieces, longest first
  std::array<bool, 256> control_start_{};  // bytes a control piece begins with
};

}  // namespace meshtrain
