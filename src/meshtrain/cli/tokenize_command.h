// `meshtrain tokenize --tokenizer PATH`: UTF-8 text on stdin to its ids on one
// line (space-separated; the tokenizer's own BOS / EOS only with
// --add-special), or with --decode ids on stdin back to text. Tokens written
// out in the text ("<|im_start|>") are their ids, as Hugging Face's encode
// does (docs/tokenizers.md). With --chat, stdin is a conversation (JSON: a
// list of {role, content} messages, or {"messages": [...]}) rendered by the
// folder's chat template: its ids, or --render its text; --mask adds a line
// of 0/1 marking the tokens the loss is taken on (chat_template.h);
// --add-generation-prompt appends the prompt of the next assistant turn.
#pragma once

#include <CLI/CLI.hpp>

#include <string>

namespace meshtrain {

struct TokenizeArgs {
  std::string tokenizer;
  std::string gpt2_ranks;
  bool add_special = false;
  bool decode = false;
  bool chat = false, render = false, mask = false, add_generation_prompt = false;
};

CLI::App* add_tokenize_command(CLI::App& app, TokenizeArgs& args);
int run_tokenize(const TokenizeArgs& args);

}  // namespace meshtrain
