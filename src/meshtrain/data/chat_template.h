// A model's chat template (tokenizer_config.json's chat_template or
// chat_template.jinja) rendered as transformers' apply_chat_template renders it
// with Python's jinja2 (trim_blocks, lstrip_blocks, loop controls,
// raise_exception, strftime_now, tojson, namespaces, macros), through
// llama.cpp's C++ Jinja engine (third_party/llama-jinja, fetched by
// scripts/get_llama_jinja.sh; its conformance: docs/tokenizers.md#chat-templates).
//
// A render also says which bytes of the text are the content of assistant
// messages and which lie inside the template's {% generation %} blocks, and
// chat_tokens turns that into ids and a loss mask: the whole text tokenized
// once (merges across the spans' edges stay as the model saw them), 1 on the
// tokens of generation blocks where the template has them, else on the tokens
// of assistant content and the control token that closes each (<|im_end|>,
// <|eot_id|>, </s>). Immutable after construction: renders on many threads.
#pragma once

#include <array>
#include <cstdint>
#include <ctime>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "meshtrain/data/tokenizer.h"

namespace meshtrain {

// The roles a conversation's messages may have.
inline constexpr std::array<std::string_view, 6> kChatRoles = {"system", "developer", "user",
                                                               "assistant", "tool", "ipython"};

// A conversation as JSON: a list of {role, content} messages, or an object
// with such a list under "messages". Returns the list; Error naming `source`
// and the message (an unknown role, a missing or non-string content, ...).
nlohmann::json read_conversation(const nlohmann::json& conversation, const std::string& source);

using ByteSpan = std::pair<size_t, size_t>;  // [first, second) of a text

struct RenderedChat {
  std::string text;
  std::vector<ByteSpan> assistant;   // each assistant message's content, as the template wrote it
  std::vector<ByteSpan> generation;  // each {% generation %} block
};

class ChatTemplate {
 public:
  // `source`: the Jinja text; `name` names it in errors; `config` gives the
  // bos_token / eos_token variables transformers passes. Error (naming
  // `name`, line and column) when the template does not parse.
  ChatTemplate(std::string source, std::string name, const TokenizerConfig& config);
  // The tokenizer's own template; Error when its folder has none.
  static ChatTemplate of(const Tokenizer& tokenizer);
  ~ChatTemplate();
  ChatTemplate(ChatTemplate&&) noexcept;

  // Renders `messages` (read_conversation's list). A template that calls
  // raise_exception, or fails, is an Error naming the template and its message.
  // `now`: the time strftime_now formats (local time, as Python's
  // datetime.now()); the clock when absent.
  RenderedChat render(const nlohmann::json& messages, bool add_generation_prompt,
                      std::optional<std::time_t> now = std::nullopt) const;

  // Whether the template marks what the model generates with {% generation %}.
  bool has_generation_blocks() const { return generation_blocks_; }

 private:
  struct Program;
  std::string name_;
  nlohmann::json variables_;  // bos_token, eos_token
  bool generation_blocks_ = false;
  std::unique_ptr<Program> program_;
};

struct ChatTokens {
  std::vector<int32_t> ids;
  std::vector<uint8_t> mask;  // 1: the loss is taken on this token
};

// The rendered text tokenized once (written-out special tokens as their ids, no
// BOS / EOS added: templates write their own) and its loss mask.
ChatTokens chat_tokens(const Tokenizer& tokenizer, const RenderedChat& chat);

}  // namespace meshtrain
