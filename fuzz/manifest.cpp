// A sharded checkpoint's manifest.json (ckpt/distributed.h), then the train
// state in its meta (train/checkpoint.h). An input that is a JSON object gets
// its checksum field recomputed first, so the fuzzer reaches the fields behind
// it; other inputs are written as they are.
#include <nlohmann/json.hpp>
#include <xxhash.h>

#include "fuzz_support.h"
#include "meshtrain/ckpt/distributed.h"
#include "meshtrain/train/checkpoint.h"
#include "meshtrain/train/config.h"

namespace {

// The manifest's own checksum as ckpt/dist_manifest.cpp computes it.
std::string with_checksum(std::string_view text) {
  using json = nlohmann::json;
  constexpr const char* kField = "manifest_xxh3";
  json value = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!value.is_object()) return std::string(text);
  value.erase(kField);
  const std::string body = value.dump(-1, ' ', false, json::error_handler_t::replace);
  value[kField] = fmt::format("{:016x}", XXH3_64bits(body.data(), body.size()));
  return value.dump(-1, ' ', false, json::error_handler_t::replace);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace meshtrain;
  static const std::string dir = fuzz::scratch_dir("step_1");
  fuzz::write_file(dir + "/manifest.json", with_checksum(fuzz::as_text(data, size)));
  fuzz::run_reader([&] { dist_ckpt::read_manifest(dir); });
  fuzz::run_reader([&] {
    TrainConfig config;
    read_train_state(dir, &config);
  });
  return 0;
}
