// ChatTemplate (data/chat_template.h): the real templates llama.cpp ships
// rendered byte for byte as transformers renders them (ctest
// chat.templates_conformance unpacks tests/chat/expected_renders.json.xz, which
// tests/chat/chat_template_ref.py wrote), the spans a render reports, the loss
// mask chat_tokens makes of them, and the refusals.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>

#include "meshtrain/data/chat_template.h"
#include "meshtrain/util/error.h"
#include "support/error_of.h"
#include "tokenizer_test_util.h"

namespace meshtrain {
namespace {

using nlohmann::json;

constexpr std::time_t kNow = 1721995200;  // chat_template_ref.py's NOW

const TokenizerConfig kSpecial{"<s>", "</s>", ""};

std::string text_of(const std::string& text, ByteSpan s) {
  return text.substr(s.first, s.second - s.first);
}

using testing::error_of;

TEST(ChatTemplateConformance, RendersTheRealTemplatesAsTransformers) {
  const char* expected = std::getenv("MESHTRAIN_CHAT_EXPECTED");
  if (expected == nullptr) GTEST_SKIP() << "run by ctest -R chat.templates_conformance";
  ASSERT_STREQ(std::getenv("TZ"), "UTC") << "strftime_now formats local time; the renders are UTC";
  const std::string dir = std::string(MESHTRAIN_SOURCE_DIR) + "/third_party/llama-jinja/models/templates/";
  const json convs = json::parse(
      testing::read_file(std::string(MESHTRAIN_SOURCE_DIR) + "/tests/chat/conversations.json"));
  std::map<std::string, ChatTemplate> templates;
  std::map<std::string, int> outcomes;
  for (const json& r : json::parse(testing::read_file(expected))) {
    const std::string name = r["template"];
    if (!templates.contains(name)) {
      templates.emplace(name, ChatTemplate(testing::read_file(dir + name), name, kSpecial));
    }
    const std::string what = fmt::format("{} / {} / add_generation_prompt={}", name,
                                         r["conversation"].get<std::string>(),
                                         r["add_generation_prompt"].get<bool>());
    std::string got, error;
    try {
      got = templates.at(name)
                .render(convs[r["conversation"].get<std::string>()],
                        r["add_generation_prompt"], kNow)
                .text;
    } catch (const Error& e) {
      error = e.what();
    }
    const std::string status = r["status"];
    if (status == "ok") {
      EXPECT_EQ(error, "") << what;
      EXPECT_EQ(got, r["text"].get<std::string>()) << what;
      ++outcomes[error.empty() && got == r["text"] ? "equal" : "different"];
    } else if (status == "raise") {
      // The template's own refusal (roles must alternate, ...): ours too, by name.
      EXPECT_NE(error.find("raise_exception"), std::string::npos) << what << ": " << error;
      ++outcomes["both refuse"];
    } else {
      // jinja2 fails (an undefined variable called, a str + list): llama.cpp's
      // engine is more lenient and may render. Counted, documented, not compared.
      ++outcomes[error.empty() ? "jinja2 fails, rendered" : "both fail"];
    }
  }
  for (const auto& [outcome, n] : outcomes) std::printf("%-24s %d\n", outcome.c_str(), n);
  EXPECT_EQ(templates.size(), 70u);
  EXPECT_EQ(outcomes["different"], 0);
}

const std::string kChatMl =
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim }}"
    "{{ '<|im_end|>' }}{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' }}"
    "{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

const json kConversation = json::parse(R"([
  {"role": "system", "content": "Be brief."},
  {"role": "user", "content": "Grüße?"},
  {"role": "assistant", "content": "  Hallo, Welt!  "},
  {"role": "user", "content": "Again"},
  {"role": "assistant", "content": "Hallo."}])");

TEST(ChatTemplate, ReportsAssistantContentAndGenerationBlocks) {
  const ChatTemplate t(kChatMl, "chatml", kSpecial);
  EXPECT_TRUE(t.has_generation_blocks());
  const RenderedChat r = t.render(read_conversation(kConversation, "test"), true);
  EXPECT_EQ(r.text,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nGrüße?<|im_end|>\n"
            "<|im_start|>assistant\nHallo, Welt!<|im_end|>\n<|im_start|>user\nAgain<|im_end|>\n"
            "<|im_start|>assistant\nHallo.<|im_end|>\n<|im_start|>assistant\n");
  // The content as the template wrote it (trimmed), found through the filter.
  ASSERT_EQ(r.assistant.size(), 2u);
  EXPECT_EQ(text_of(r.text, r.assistant[0]), "Hallo, Welt!");
  EXPECT_EQ(text_of(r.text, r.assistant[1]), "Hallo.");
  ASSERT_EQ(r.generation.size(), 2u);
  EXPECT_EQ(text_of(r.text, r.generation[0]), "Hallo, Welt!<|im_end|>");
  EXPECT_EQ(text_of(r.text, r.generation[1]), "Hallo.<|im_end|>");
}

// {% generation %} tags change nothing of the text, whitespace control included.
TEST(ChatTemplate, GenerationTagsKeepTrimAndLstripBlocks) {
  const std::string with =
      "{% for m in messages %}\n  {%- if m.role == 'assistant' %}\n"
      "    {% generation -%}\n  [{{ m.content }}]\n    {%- endgeneration %}\n"
      "  {% else %}<{{ m.content }}>\n  {% endif %}\n{% endfor %}";
  std::string without = with;
  for (const char* tag : {"{% generation -%}", "{%- endgeneration %}"}) {
    const size_t at = without.find(tag);
    const bool trims_right = std::string(tag).find("-%}") != std::string::npos;
    without.replace(at, std::string(tag).size(), trims_right ? "{% if true -%}" : "{%- endif %}");
  }
  const json msgs = read_conversation(kConversation, "test");
  const RenderedChat a = ChatTemplate(with, "with", kSpecial).render(msgs, false);
  const RenderedChat b = ChatTemplate(without, "without", kSpecial).render(msgs, false);
  EXPECT_EQ(a.text, b.text);
  ASSERT_EQ(a.generation.size(), 2u);
  EXPECT_EQ(text_of(a.text, a.generation[1]), "[Hallo.]");
}

TEST(ChatTemplate, MaskCoversAssistantContentAndItsClosingToken) {
  // Bytes: every byte a token, id 0 the only special one; a template whose
  // assistant turns close with a NUL byte.
  const ByteTokenizer bytes;
  const std::string tmpl = std::string(
      "{% for m in messages %}{{ m.role }}: {{ m.content }}"
      "{% if m.role == 'assistant' %}\0{% endif %}\n{% endfor %}", 107);
  const ChatTemplate t(tmpl, "plain", kSpecial);
  EXPECT_FALSE(t.has_generation_blocks());
  const RenderedChat r = t.render(read_conversation(kConversation, "test"), false);
  const ChatTokens tokens = chat_tokens(bytes, r);
  ASSERT_EQ(tokens.ids.size(), r.text.size());
  std::string masked;
  for (size_t i = 0; i < tokens.ids.size(); ++i) {
    if (tokens.mask[i]) masked += tokens.ids[i] == 0 ? '|' : r.text[i];
  }
  EXPECT_EQ(masked, "  Hallo, Welt!  |Hallo.|");
}

TEST(ChatTemplate, RefusalsNameTheirCause) {
  const ChatTemplate t(
      "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok",
      "strict", kSpecial);
  EXPECT_EQ(error_of([&] { t.render(read_conversation(kConversation, "conv"), false); }),
            "chat template 'strict': raise_exception: first must be user");
  const std::string parse = error_of([] { ChatTemplate("{% for x in %}", "broken", kSpecial); });
  EXPECT_TRUE(parse.starts_with("chat template 'broken': does not parse")) << parse;
  EXPECT_EQ(parse.find('\n'), std::string::npos) << parse;
  EXPECT_EQ(error_of([] {
              read_conversation(json::parse(R"([{"role": "narrator", "content": "x"}])"), "c.jsonl:3");
            }),
            "c.jsonl:3: message 0 has the unknown role \"narrator\" (known: system, developer, "
            "user, assistant, tool, ipython)");
  EXPECT_NE(error_of([] { read_conversation(json::parse(R"({"turns": []})"), "c"); }), "");
  EXPECT_NE(error_of([] { read_conversation(json::parse(R"([{"role": "user"}])"), "c"); }), "");
  // A conversation holding the marks of generation blocks cannot be told apart.
  const json marked = json::parse("[{\"role\": \"user\", \"content\": \"\xEE\x80\x80\"}]");
  EXPECT_NE(error_of([&] { t.render(marked, false); }).find("U+E000"), std::string::npos);
}

}  // namespace
}  // namespace meshtrain
