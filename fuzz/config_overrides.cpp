// `--section.key value` overrides (train/config.h) on a valid config: each
// input line is "section.key=value".
#include <sstream>

#include "fuzz_support.h"
#include "meshtrain/train/config.h"

namespace {

constexpr const char* kBase = R"([model]
preset = "llama-tiny"
[train]
steps = 10
batch_size = 4
micro_batch_size = 2
seq_len = 16
out_dir = "runs/fuzz"
[data]
train = "data/train_*.bin"
tokenizer = "bytes"
)";

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace meshtrain;
  ConfigOverrides overrides;
  std::istringstream lines{std::string(fuzz::as_text(data, size))};
  for (std::string line; std::getline(lines, line);) {
    const size_t eq = line.find('=');
    if (eq == std::string::npos) {
      overrides.emplace_back(line, "");
    } else {
      overrides.emplace_back(line.substr(0, eq), line.substr(eq + 1));
    }
  }
  fuzz::run_reader([&] {
    const TrainConfig config = parse_config(kBase, "base.toml", overrides);
    parse_config(config_to_toml(config), "fuzz.toml (written back)");
  });
  return 0;
}
