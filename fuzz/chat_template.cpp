// A chat template (data/chat_template.h: llama.cpp's Jinja engine), parsed,
// then rendered on a short conversation with and without the generation
// prompt and tokenized into a loss mask: what it accepts must render without
// crashing; what it refuses, it refuses with an Error.
#include "fuzz_support.h"
#include "meshtrain/data/chat_template.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace meshtrain;
  fuzz::run_reader([&] {
    const ChatTemplate tmpl(std::string(fuzz::as_text(data, size)), "fuzz", {"<s>", "</s>", ""});
    const nlohmann::json messages = nlohmann::json::parse(R"([
      {"role": "system", "content": "Be brief."},
      {"role": "user", "content": "Gr\u00fc\u00dfe, \u4e16\u754c!"},
      {"role": "assistant", "content": "  Hallo  "},
      {"role": "user", "content": "{{ 1 }}"}])");
    const ByteTokenizer bytes;
    for (bool prompt : {false, true}) chat_tokens(bytes, tmpl.render(messages, prompt, 0));
  });
  return 0;
}
