// A TOML run config (train/config.h): parsed, validated, and its resolved form
// written back and parsed again (what a checkpoint saves).
#include "fuzz_support.h"
#include "meshtrain/train/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace meshtrain;
  fuzz::run_reader([&] {
    const TrainConfig config = parse_config(std::string(fuzz::as_text(data, size)), "fuzz.toml");
    parse_config(config_to_toml(config), "fuzz.toml (written back)");
    config_from_json(config_to_json(config));
  });
  return 0;
}
