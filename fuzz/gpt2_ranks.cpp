// A tiktoken ranks file (data/bpe_tokenizer.h, data.gpt2_ranks and the copy
// every checkpoint carries), then a round trip through the tokenizer it makes.
#include "fuzz_support.h"
#include "meshtrain/data/bpe_tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace meshtrain;
  fuzz::run_reader([&] {
    auto tokenizer = BpeTokenizer::from_ranks_text(fuzz::as_text(data, size), "gpt2.tiktoken");
    const std::string text = "Hello, world! It's 2024 \xe2\x80\x94 caf\xc3\xa9\n\n  ok";
    const std::vector<int32_t> ids = tokenizer->encode_ordinary(text);
    if (tokenizer->decode(ids) != text) std::abort();  // encode_ordinary's contract
    const int32_t eot = tokenizer->eot_id();
    tokenizer->decode(std::vector<int32_t>{eot});
  });
  return 0;
}
