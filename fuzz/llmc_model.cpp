// An llm.c GPT-2 model file (ckpt/llmc.h): the header, then the whole import.
#include "fuzz_support.h"
#include "meshtrain/ckpt/llmc.h"
#include "model_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace meshtrain;
  static const std::string path = fuzz::scratch_dir() + "/gpt2_124M.bin";
  fuzz::write_file(path, fuzz::as_text(data, size));
  fuzz::run_reader([&] {
    read_llmc_header(path);
    import_llmc(path, Precision::fp32, fuzz::cpu_context());
  });
  return 0;
}
