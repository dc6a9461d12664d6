// `meshtrain tokenize --tokenizer PATH`: UTF-8 text on stdin to its ids on one
// line (space-separated; the tokenizer's own BOS / EOS only with
// --add-special), or with --decode ids on stdin back to text. Tokens written
// out in the text ("<|im_start|>") are their ids, as Hugging Face's encode
// does (docs/tokenizers.md).
#pragma once

#include <CLI/CLI.hpp>

#include <string>

namespace meshtrain {

struct TokenizeArgs {
  std::string tokenizer;
  std::string gpt2_ranks;
  bool add_special = false;
  bool decode = false;
};

CLI::App* add_tokenize_command(CLI::App& app, TokenizeArgs& args);
int run_tokenize(const TokenizeArgs& args);

}  // namespace meshtrain
