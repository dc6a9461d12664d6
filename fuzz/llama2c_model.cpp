// A llama2.c v0 model file (ckpt/llama2c.h): the header, then the whole import.
#include "fuzz_support.h"
#include "meshtrain/ckpt/llama2c.h"
#include "model_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace meshtrain;
  static const std::string path = fuzz::scratch_dir() + "/model.bin";
  fuzz::write_file(path, fuzz::as_text(data, size));
  fuzz::run_reader([&] { import_llama2c(path, Precision::fp32, fuzz::cpu_context()); });
  return 0;
}
