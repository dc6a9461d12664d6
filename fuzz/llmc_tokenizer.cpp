// An llm.c gpt2_tokenizer.bin (ckpt/tokenizer_files.h).
#include "fuzz_support.h"
#include "meshtrain/ckpt/tokenizer_files.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace meshtrain;
  static const std::string path = fuzz::scratch_dir() + "/gpt2_tokenizer.bin";
  fuzz::write_file(path, fuzz::as_text(data, size));
  fuzz::run_reader([&] {
    int32_t eot = -1;
    read_llmc_tokenizer(path, &eot);
  });
  return 0;
}
