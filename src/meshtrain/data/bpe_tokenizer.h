// GPT-2's byte-level BPE, token for token the same as tiktoken's "gpt2"
// encoding: text is split into pieces by GPT-2's regex (PCRE2, Unicode
// properties, JIT), then each piece's bytes are merged pairwise, always the
// adjacent pair whose concatenation has the lowest rank, until no pair is a
// token. Ranks come from a tiktoken-format file: one line per token,
// "<base64 bytes> <rank>", ranks 0..N-1 each once, every single byte present.
// <|endoftext|> is id N (50256 for GPT-2's 50256 ranks).
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "meshtrain/data/tokenizer.h"

namespace meshtrain {

inline constexpr const char* kDefaultGpt2Ranks = "data/gpt2.tiktoken";
inline constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
inline constexpr std::string_view kEndOfText = "<|endoftext|>";

class BpeTokenizer final : public Tokenizer {
 public:
  // Reads a tiktoken ranks file; throws Error naming the file and line of any defect.
  static std::unique_ptr<BpeTokenizer> load(const std::string& path);
  // The same from the file's text; `source` names it in errors.
  static std::unique_ptr<BpeTokenizer> from_ranks_text(std::string_view text,
                                                       const std::string& source);
  ~BpeTokenizer() override;

  std::string name() const override { return "gpt2"; }
  int64_t vocab_size() const override;
  int32_t eot_id() const override;
  using Tokenizer::encode_ordinary;
  void encode_ordinary(std::string_view text, std::vector<int32_t>& ids) const override;
  std::string decode(std::span<const int32_t> ids) const override;

  // The bytes of one ordinary token (id < eot_id()).
  std::string_view token_bytes(int32_t id) const;

  struct Impl;

 private:
  explicit BpeTokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace meshtrain
