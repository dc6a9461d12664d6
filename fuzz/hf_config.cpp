// A Hugging Face config.json (ckpt/hf.h), parsed and written back.
#include "fuzz_support.h"
#include "meshtrain/ckpt/hf.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace meshtrain;
  fuzz::run_reader([&] {
    const ModelConfig config = parse_hf_config(fuzz::as_text(data, size), "config.json");
    // What it accepted must be a model meshtrain can describe.
    parse_hf_config(hf_config_json(config), "config.json (written back)");
  });
  return 0;
}
