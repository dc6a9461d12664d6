// A llama2.c tokenizer.bin (ckpt/tokenizer_files.h). The first 4 bytes are the
// vocabulary its model declares (any positive int32, as a model file may say).
#include <algorithm>
#include <cstring>

#include "fuzz_support.h"
#include "meshtrain/ckpt/tokenizer_files.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace meshtrain;
  if (size < 4) return 0;
  uint32_t vocab = 0;
  std::memcpy(&vocab, data, 4);
  vocab = std::max<uint32_t>(vocab & 0x7fffffffu, 1);
  static const std::string path = fuzz::scratch_dir() + "/tokenizer.bin";
  fuzz::write_file(path, fuzz::as_text(data + 4, size - 4));
  fuzz::run_reader([&] { read_llama2c_tokenizer(path, vocab); });
  return 0;
}
