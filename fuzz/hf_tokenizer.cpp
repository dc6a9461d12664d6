// A Hugging Face tokenizer.json (data/hf_tokenizer.h), loaded, then used on a
// short text: what it accepts must encode and decode without crashing.
#include "fuzz_support.h"
#include "meshtrain/data/hf_tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace meshtrain;
  fuzz::run_reader([&] {
    const auto tok = HfTokenizer::from_json(fuzz::as_text(data, size), "tokenizer.json");
    std::vector<int32_t> ids;
    tok->encode("Hello, world! 123 \xE4\xB8\x96\xE7\x95\x8C  \n<s>", ids, true);
    tok->decode(ids);
  });
  return 0;
}
