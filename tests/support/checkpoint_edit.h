// Rewrites a sharded checkpoint's train state for tests that need a state no
// run writes (the data position moved, as a rollback moves it).
#pragma once

#include <fmt/format.h>
#include <xxhash.h>

#include <cstdint>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "meshtrain/ckpt/distributed.h"

namespace meshtrain::testing {

// Sets the loader position in `step_dir`'s manifest (epoch, sample index)
// and reseals the manifest's checksum (ckpt/dist_manifest.cpp: XXH3-64 of the
// manifest without its "manifest_xxh3" field, as dumped).
inline void set_checkpoint_data_position(const std::string& step_dir, int64_t epoch,
                                         int64_t index) {
  const std::string path = step_dir + "/" + dist_ckpt::kManifestFile;
  nlohmann::json m;
  std::ifstream(path) >> m;
  m["meta"]["sampler"]["epoch"] = epoch;
  m["meta"]["sampler"]["index"] = index;
  m.erase("manifest_xxh3");
  const std::string text = m.dump();
  m["manifest_xxh3"] = fmt::format("{:016x}", XXH3_64bits(text.data(), text.size()));
  std::ofstream(path) << m.dump();
}

}  // namespace meshtrain::testing
