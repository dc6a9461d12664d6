// Hugging Face tokenizers' tokenizer.json, read and run in C++ with the
// results of the `tokenizers` library (docs/tokenizers.md). What it runs, in
// tokenizers' order:
//
//   1. added tokens (special or not) found in the raw text, longest match
//      first, with their lstrip / rstrip / single_word rules; those marked
//      `normalized` are looked for again in each normalized stretch;
//   2. the normalizer on each stretch between them: NFC, NFD, NFKC, NFKD,
//      Prepend, Replace (a string or a regex), Strip, Sequence;
//   3. the pre-tokenizers: ByteLevel (with or without GPT-2's regex;
//      add_prefix_space), Split (a string or a regex; Removed, Isolated,
//      MergedWithPrevious, MergedWithNext, Contiguous; invert), Digits,
//      Metaspace (prepend_scheme always / first / never; split), Sequence;
//   4. the BPE model: merges as "a b" strings or [a, b] pairs, the lowest
//      merge rank first (then the leftmost), ignore_merges, byte_fallback to
//      <0xXX> tokens, unk_token and fuse_unk; a byte-level vocabulary works on
//      the text's bytes;
//   5. the post-processor when asked (TemplateProcessing's single template,
//      ByteLevel, Sequence): BOS / EOS around the ids;
//   6. decoding through the decoders: ByteLevel, Metaspace, Replace,
//      ByteFallback, Fuse, Strip, Sequence; to bytes, so decode(encode(x)) == x
//      wherever the normalizer leaves x as it is.
//
// Anything else (another model type, a normalizer, pre-tokenizer, processor or
// decoder not listed, BPE dropout, a continuing_subword_prefix) is refused
// with one line naming the file and the field. Immutable after load: encodes
// on many threads at once.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "meshtrain/data/tokenizer.h"

namespace meshtrain {

TokenizerConfig read_tokenizer_config(const std::string& path);

class HfTokenizer final : public Tokenizer {
 public:
  // A tokenizer.json; `config` from its folder's tokenizer_config.json and
  // chat_template.jinja; `files`: what files() reports (make_tokenizer reads a
  // folder).
  static std::unique_ptr<HfTokenizer> load(const std::string& path, TokenizerConfig config = {},
                                           std::vector<File> files = {});
  // From the file's text; `source` names it in errors.
  static std::unique_ptr<HfTokenizer> from_json(std::string_view json, const std::string& source,
                                                TokenizerConfig config = {});
  ~HfTokenizer() override;

  std::string name() const override;
  int64_t vocab_size() const override;
  // The end-of-sequence token (tokenizer_config.json's eos_token, or the
  // post-processor's last special token, or its first).
  int32_t eot_id() const override;
  using Tokenizer::encode_ordinary;
  // Added tokens that are special are text here (tokenizers'
  // split_special_tokens); no post-processor.
  void encode_ordinary(std::string_view text, std::vector<int32_t>& ids) const override;
  void encode(std::string_view text, std::vector<int32_t>& ids, bool add_special) const override;
  std::string decode(std::span<const int32_t> ids) const override;
  std::optional<int32_t> token_id(std::string_view token) const override;
  bool is_special(int32_t id) const override;  // an added token marked special
  std::string token_text(int32_t id) const override;
  DocumentFrame document_frame() const override;
  std::vector<File> files() const override;
  const TokenizerConfig& config() const override;

  struct Impl;

 private:
  explicit HfTokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace meshtrain
