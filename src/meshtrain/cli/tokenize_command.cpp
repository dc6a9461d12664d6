#include "meshtrain/cli/tokenize_command.h"

#include <fmt/format.h>

#include <charconv>
#include <cstdio>
#include <iostream>
#include <iterator>
#include <sstream>

#include "meshtrain/cli/args.h"
#include "meshtrain/data/bpe_tokenizer.h"
#include "meshtrain/data/chat_template.h"
#include "meshtrain/data/tokenizer.h"
#include "meshtrain/util/error.h"

namespace meshtrain {

CLI::App* add_tokenize_command(CLI::App& app, TokenizeArgs& args) {
  CLI::App* cmd = app.add_subcommand(
      "tokenize", "Text on stdin to token ids (or --decode ids to text) with any tokenizer");
  cmd->add_option("--tokenizer", args.tokenizer,
                  "gpt2, bytes, a tokenizer.json, a tokenizer.model, or a model folder")
      ->required();
  cmd->add_option("--gpt2-ranks", args.gpt2_ranks, "tiktoken ranks file (--tokenizer gpt2)");
  cmd->add_flag("--add-special", args.add_special,
                "Add the tokenizer's own tokens (its post-processor's BOS / EOS)");
  CLI::Option* decode =
      cmd->add_flag("--decode", args.decode, "Read space-separated ids, print their text");
  CLI::Option* chat = cmd->add_flag(
      "--chat", args.chat,
      "Read a conversation (JSON: [{role, content}, ...] or {\"messages\": [...]}), print the "
      "ids of its text as the folder's chat template renders it");
  chat->excludes(decode);
  cmd->add_flag("--render", args.render, "With --chat: print the rendered text, not ids")->needs(chat);
  cmd->add_flag("--mask", args.mask,
                "With --chat: a second line of 0/1, 1 on the tokens the loss is taken on")
      ->needs(chat);
  cmd->add_flag("--add-generation-prompt", args.add_generation_prompt,
                "With --chat: append the template's prompt for the next assistant turn")
      ->needs(chat);
  return cmd;
}

int run_tokenize(const TokenizeArgs& args) {
  const std::unique_ptr<Tokenizer> tokenizer =
      make_tokenizer(args.tokenizer, args.gpt2_ranks.empty() ? kDefaultGpt2Ranks : args.gpt2_ranks);
  std::ostringstream in;
  in << std::cin.rdbuf();
  const std::string text = in.str();
  if (args.decode) {
    std::vector<int32_t> ids;
    std::istringstream words(text);
    for (std::string word; words >> word;) {
      int32_t id = 0;
      const auto [end, ec] = std::from_chars(word.data(), word.data() + word.size(), id);
      if (ec != std::errc() || end != word.data() + word.size()) {
        throw UsageError(fmt::format("tokenize --decode: '{}' is not a token id", word));
      }
      ids.push_back(id);
    }
    const std::string out = tokenizer->decode(ids);
    std::fwrite(out.data(), 1, out.size(), stdout);
    return 0;
  }
  if (args.chat) {
    nlohmann::json conversation;
    try {
      conversation = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception& e) {
      fail("tokenize --chat: stdin is not JSON: {}", e.what());
    }
    const ChatTemplate tmpl = ChatTemplate::of(*tokenizer);
    const RenderedChat chat =
        tmpl.render(read_conversation(conversation, "stdin"), args.add_generation_prompt);
    if (args.render) {
      std::fwrite(chat.text.data(), 1, chat.text.size(), stdout);
      return 0;
    }
    const ChatTokens tokens = chat_tokens(*tokenizer, chat);
    fmt::print("{}\n", fmt::join(tokens.ids, " "));
    if (args.mask) fmt::print("{}\n", fmt::join(tokens.mask, " "));
    return 0;
  }
  std::vector<int32_t> ids;
  tokenizer->encode(text, ids, args.add_special);
  fmt::print("{}\n", fmt::join(ids, " "));
  return 0;
}

}  // namespace meshtrain
