// Tokenizers: text bytes <-> token ids. Two kinds: "gpt2" (byte-level BPE with
// GPT-2's merge ranks and pre-tokenisation, see bpe_tokenizer.h) and "bytes"
// (vocabulary 256, id = byte value). Both are immutable after construction, so
// one instance may encode on many threads at once.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace meshtrain {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  virtual std::string name() const = 0;
  // Number of ids, special tokens included; every id is below it.
  virtual int64_t vocab_size() const = 0;
  // The id that starts each document in a token stream (GPT-2: <|endoftext|>).
  virtual int32_t eot_id() const = 0;

  // Appends the ids of `text` to `ids`. Text that looks like a special token is
  // encoded as ordinary text. Any bytes are accepted (invalid UTF-8 included),
  // and decode(encode_ordinary(x)) == x.
  virtual void encode_ordinary(std::string_view text, std::vector<int32_t>& ids) const = 0;
  std::vector<int32_t> encode_ordinary(std::string_view text) const {
    std::vector<int32_t> ids;
    encode_ordinary(text, ids);
    return ids;
  }

  // The bytes of `ids` (special tokens as their text). Throws Error on an id
  // outside the vocabulary.
  virtual std::string decode(std::span<const int32_t> ids) const = 0;
};

// Byte offset of the first byte of `text` that does not start or continue a
// well-formed UTF-8 character (overlong forms, surrogates and code points past
// U+10FFFF included), or of the first NUL byte, which text files do not hold;
// std::string_view::npos when the whole text is valid.
size_t first_non_text_byte(std::string_view text);

// Vocabulary 256, id = byte value. Its document separator is the NUL byte
// (id 0), which plain text does not contain.
class ByteTokenizer final : public Tokenizer {
 public:
  std::string name() const override { return "bytes"; }
  int64_t vocab_size() const override { return 256; }
  int32_t eot_id() const override { return 0; }
  using Tokenizer::encode_ordinary;
  void encode_ordinary(std::string_view text, std::vector<int32_t>& ids) const override;
  std::string decode(std::span<const int32_t> ids) const override;
};

// "gpt2" (loads `gpt2_ranks`, a gpt2.tiktoken file) or "bytes". Throws Error
// on an unknown kind or a bad ranks file.
std::unique_ptr<Tokenizer> make_tokenizer(std::string_view kind, const std::string& gpt2_ranks);

}  // namespace meshtrain
