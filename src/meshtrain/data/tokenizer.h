// Tokenizers: text bytes <-> token ids. Kinds: "gpt2" (byte-level BPE with
// GPT-2's merge ranks and pre-tokenisation, see bpe_tokenizer.h), "bytes"
// (vocabulary 256, id = byte value), a Hugging Face tokenizer.json
// (hf_tokenizer.h) and a SentencePiece model (spm_tokenizer.h). All are
// immutable after construction, so one instance may encode on many threads at
// once.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace meshtrain {

// What a model folder's tokenizer_config.json (or chat_template.jinja) adds to
// its tokenizer: the names of its beginning / end-of-sequence tokens
// (bos_token / eos_token, a string or {"content": ...}) and its chat template.
struct TokenizerConfig {
  std::optional<std::string> bos_token, eos_token;
  std::string chat_template;  // empty: none
};

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

  // Hugging Face's encode: tokens written out in `text` ("<|im_start|>")
  // become their ids; add_special: the tokenizer's own tokens around the result
  // (its post-processor's BOS / EOS). Tokenizers without written-out tokens
  // encode ordinarily.
  virtual void encode(std::string_view text, std::vector<int32_t>& ids, bool add_special) const {
    (void)add_special;
    encode_ordinary(text, ids);
  }

  // The bytes of `ids` (special tokens as their text). Throws Error on an id
  // outside the vocabulary.
  virtual std::string decode(std::span<const int32_t> ids) const = 0;

  // The id of one token written out ("<|endoftext|>"); nullopt when it is not a token.
  virtual std::optional<int32_t> token_id(std::string_view token) const {
    (void)token;
    return std::nullopt;
  }

  // Whether `id` is a control token (Hugging Face's special added tokens,
  // SentencePiece's control pieces): a chat's end-of-turn mark.
  virtual bool is_special(int32_t id) const { return id == eot_id(); }

  // The bytes `id` stands for in the middle of a text: its decoding after
  // another token, free of the rules decoders apply to a text's first token
  // (Metaspace's dropped leading space). token_offsets reads it.
  virtual std::string token_text(int32_t id) const;

  // The ids around each document of a token stream (prepare, pre-training):
  // GPT-2 and bytes put their end-of-text before each document.
  struct DocumentFrame {
    std::vector<int32_t> before, after;
  };
  virtual DocumentFrame document_frame() const { return {{eot_id()}, {}}; }

  // The files this tokenizer was read from, with the names a model folder
  // gives them (tokenizer.json, tokenizer_config.json, chat_template.jinja,
  // tokenizer.model), for checkpoints and exports to carry; empty for the
  // built-in kinds.
  struct File {
    std::string path, name;
  };
  virtual std::vector<File> files() const { return {}; }

  // The folder's tokenizer_config.json / chat_template.jinja; empty for the
  // built-in kinds.
  virtual const TokenizerConfig& config() const;
};

// The byte range [first, second) of `text` that each of `ids` (the encoding of
// `text`, written-out special tokens included) stands for: the tokens' texts
// laid along `text` in order, a token being allowed to take one space the
// tokenizer added (SentencePiece's dummy prefix) or one its decoder dropped.
// Error naming the token and byte offset where they part, which happens where
// a normalizer changed the text (NFKC of a ligature, say).
std::vector<std::pair<size_t, size_t>> token_offsets(const Tokenizer& tokenizer,
                                                     std::string_view text,
                                                     std::span<const int32_t> ids);

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

// "gpt2" (loads `gpt2_ranks`, a gpt2.tiktoken file), "bytes", a
// tokenizer.json, a tokenizer.model, or a folder with either (tokenizer.json
// first; its tokenizer_config.json and chat_template.jinja with it). Throws
// Error on an unknown kind or a bad file.
std::unique_ptr<Tokenizer> make_tokenizer(std::string_view kind, const std::string& gpt2_ranks);
// Tokenizer::files() of what make_tokenizer(kind) would read, without reading
// it; empty for "gpt2" and "bytes" (and for a path that does not exist).
std::vector<Tokenizer::File> tokenizer_files(std::string_view kind);

}  // namespace meshtrain
