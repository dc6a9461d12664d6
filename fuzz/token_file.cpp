// An llm.c token shard (data/token_file.h), opened with and without a vocabulary.
#include "fuzz_support.h"
#include "meshtrain/data/token_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace meshtrain;
  static const std::string path = fuzz::scratch_dir() + "/train_000.bin";
  fuzz::write_file(path, fuzz::as_text(data, size));
  for (int64_t vocab : {int64_t{0}, int64_t{256}, int64_t{50257}}) {
    fuzz::run_reader([&] {
      TokenFile file(path, vocab);
      uint64_t sum = 0;  // every token the reader claims to hold is readable
      for (int64_t i = 0; i < file.size(); ++i) sum += static_cast<uint32_t>(file.token(i));
      if (vocab > 0 && file.size() > 0 && sum > static_cast<uint64_t>(vocab) * file.size()) {
        std::abort();
      }
    });
  }
  return 0;
}
