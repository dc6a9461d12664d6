#include "meshtrain/data/chat_template.h"

#include <jinja/lexer.h>
#include <jinja/parser.h>
#include <jinja/runtime.h>
#include <jinja/value.h>
#include <json.h>

#include <algorithm>

#include "meshtrain/data/regex.h"
#include "meshtrain/util/error.h"

namespace meshtrain {

using nlohmann::json;

namespace {

// {% generation %} and {% endgeneration %} (transformers' extension, which
// llama.cpp's engine parses and ignores) become blocks that write these marks:
// an `if` tag in the same place keeps trim_blocks, lstrip_blocks and the tags'
// own "-" exactly as they were. Private-use characters a conversation may not hold.
constexpr std::string_view kOpen = "\xEE\x80\x80", kClose = "\xEE\x80\x81";  // U+E000, U+E001

std::string mark_generation_blocks(const std::string& source, bool* found) {
  const Regex tag(R"(\{%([-+]?)\s*(end)?generation\s*([-+]?)%\})", "chat template generation tag");
  Regex::Scratch scratch(tag);
  std::string out;
  size_t pos = 0;
  *found = false;
  tag.for_each_match(source, scratch, [&](size_t b, size_t e) {
    const std::string_view t = std::string_view(source).substr(b, e - b);
    const bool end = t.find("endgeneration") != std::string_view::npos;
    const std::string left(t[2] == '-' || t[2] == '+' ? 1 : 0, t[2]);
    const std::string right(t[t.size() - 3] == '-' || t[t.size() - 3] == '+' ? 1 : 0,
                            t[t.size() - 3]);
    out += source.substr(pos, b - pos);
    out += "{%" + left + " if true %}" + std::string(end ? kClose : kOpen) + "{% endif " + right + "%}";
    pos = e;
    *found = true;
  });
  return out + source.substr(pos);
}

// The engine's message, on one line, with a raise_exception's text named as such.
std::string engine_message(std::string_view what) {
  constexpr std::string_view raised = "Jinja Exception: ";
  if (const size_t at = what.find(raised); at != std::string_view::npos) {
    return fmt::format("raise_exception: {}", what.substr(at + raised.size()));
  }
  std::string line(what);
  std::ranges::replace(line, '\n', ' ');
  line.erase(0, line.find_first_not_of(' '));
  return line;
}

}  // namespace

struct ChatTemplate::Program {
  jinja::program program;
};

json read_conversation(const json& conversation, const std::string& source) {
  const json* list = &conversation;
  if (conversation.is_object()) {
    MESHTRAIN_CHECK(conversation.contains("messages"), "{}: a conversation object needs "
                    "\"messages\"", source);
    list = &conversation["messages"];
  }
  MESHTRAIN_CHECK(list->is_array() && !list->empty(), "{}: a conversation is a non-empty list of "
                  "{{role, content}} messages, or {{\"messages\": [...]}}", source);
  for (size_t i = 0; i < list->size(); ++i) {
    const json& m = (*list)[i];
    MESHTRAIN_CHECK(m.is_object() && m.contains("role") && m["role"].is_string(),
                    "{}: message {} has no \"role\" string", source, i);
    const std::string role = m["role"].get<std::string>();
    MESHTRAIN_CHECK(std::ranges::find(kChatRoles, role) != kChatRoles.end(),
                    "{}: message {} has the unknown role \"{}\" (known: system, developer, user, "
                    "assistant, tool, ipython)", source, i, role);
    MESHTRAIN_CHECK(m.contains("content") && (m["content"].is_string() || m["content"].is_array() ||
                                              m["content"].is_null()),
                    "{}: message {} ({}) needs \"content\": a string or a list of parts", source, i,
                    role);
  }
  return *list;
}

ChatTemplate::ChatTemplate(std::string source, std::string name, const TokenizerConfig& config)
    : name_(std::move(name)), variables_(json::object()), program_(std::make_unique<Program>()) {
  if (config.bos_token) variables_["bos_token"] = *config.bos_token;
  if (config.eos_token) variables_["eos_token"] = *config.eos_token;
  const std::string marked = mark_generation_blocks(source, &generation_blocks_);
  try {
    jinja::lexer lexer;
    program_->program = jinja::parse_from_tokens(lexer.tokenize(marked));
  } catch (const std::exception& e) {
    fail("chat template '{}': does not parse: {}", name_, engine_message(e.what()));
  }
}

ChatTemplate::~ChatTemplate() = default;
ChatTemplate::ChatTemplate(ChatTemplate&&) noexcept = default;

ChatTemplate ChatTemplate::of(const Tokenizer& tokenizer) {
  const TokenizerConfig& config = tokenizer.config();
  MESHTRAIN_CHECK(!config.chat_template.empty(), "tokenizer '{}': no chat template (its folder "
                  "has no tokenizer_config.json \"chat_template\" or chat_template.jinja)",
                  tokenizer.name());
  return ChatTemplate(config.chat_template, tokenizer.name(), config);
}

RenderedChat ChatTemplate::render(const json& messages, bool add_generation_prompt,
                                  std::optional<std::time_t> now) const {
  json vars = variables_;
  vars["messages"] = messages;
  vars["add_generation_prompt"] = add_generation_prompt;
  const std::string dumped = vars.dump();
  MESHTRAIN_CHECK(dumped.find(kOpen) == std::string::npos && dumped.find(kClose) == std::string::npos,
                  "chat template '{}': the conversation holds U+E000 or U+E001, which mark "
                  "generation blocks", name_);
  jinja::value_string parts;
  try {
    jinja::context ctx;  // no source: errors name a byte offset, on one line
    if (now) ctx.current_time = *now;
    jinja::global_from_json(ctx, common_json::parse(dumped), false);
    // The engine marks text that comes from an input string through every
    // filter and concatenation: mark the assistant messages' content.
    jinja::value msgs = ctx.get_val("messages");
    for (size_t i = 0; i < messages.size(); ++i) {
      if (messages[i]["role"] != "assistant" || !messages[i]["content"].is_string()) continue;
      jinja::value& content = msgs->at(static_cast<int64_t>(i))->at(std::string("content"));
      content->val_str.mark_input();
    }
    jinja::runtime runtime(ctx);
    parts = jinja::runtime::gather_string_parts(runtime.execute(program_->program));
  } catch (const std::exception& e) {
    fail("chat template '{}': {}", name_, engine_message(e.what()));
  }
  RenderedChat out;
  std::vector<size_t> opens;
  for (const jinja::string_part& p : parts->val_str.parts) {
    // Cut the generation marks out, keeping where they were.
    for (size_t i = 0; i < p.val.size();) {
      const std::string_view rest = std::string_view(p.val).substr(i);
      if (rest.starts_with(kOpen) || rest.starts_with(kClose)) {
        if (rest.starts_with(kOpen)) {
          opens.push_back(out.text.size());
        } else {
          MESHTRAIN_CHECK(!opens.empty(), "chat template '{}': endgeneration without generation",
                          name_);
          out.generation.emplace_back(opens.back(), out.text.size());
          opens.pop_back();
        }
        i += kOpen.size();
        continue;
      }
      const size_t next = std::min(p.val.find(kOpen, i), p.val.find(kClose, i));
      const size_t end = std::min(next, p.val.size());
      if (p.is_input) {
        if (!out.assistant.empty() && out.assistant.back().second == out.text.size()) {
          out.assistant.back().second += end - i;
        } else {
          out.assistant.emplace_back(out.text.size(), out.text.size() + end - i);
        }
      }
      out.text.append(p.val, i, end - i);
      i = end;
    }
  }
  MESHTRAIN_CHECK(opens.empty(), "chat template '{}': a generation block is not closed", name_);
  std::erase_if(out.generation, [](const ByteSpan& s) { return s.first == s.second; });
  std::erase_if(out.assistant, [](const ByteSpan& s) { return s.first == s.second; });
  return out;
}

ChatTokens chat_tokens(const Tokenizer& tokenizer, const RenderedChat& chat) {
  ChatTokens out;
  tokenizer.encode(chat.text, out.ids, false);
  const std::vector<ByteSpan> at = token_offsets(tokenizer, chat.text, out.ids);
  out.mask.assign(out.ids.size(), 0);
  const bool blocks = !chat.generation.empty();
  const std::vector<ByteSpan>& spans = blocks ? chat.generation : chat.assistant;
  size_t k = 0;  // spans and tokens both run left to right
  for (const ByteSpan& s : spans) {
    while (k < at.size() && at[k].second <= s.first) ++k;
    size_t last = k;  // one past the span's last token
    for (; last < at.size() && at[last].first < s.second; ++last) out.mask[last] = 1;
    // The control token that closes an assistant turn, after nothing but spaces.
    for (size_t j = last; !blocks && j < at.size(); ++j) {
      if (tokenizer.is_special(out.ids[j])) {
        out.mask[j] = 1;
        break;
      }
      const std::string_view between =
          std::string_view(chat.text).substr(at[j].first, at[j].second - at[j].first);
      if (between.find_first_not_of(" \t\r\n") != std::string_view::npos) break;
    }
  }
  return out;
}

}  // namespace meshtrain
