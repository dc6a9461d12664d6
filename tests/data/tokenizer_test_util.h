// Shared by the tokenizer and prepare tests: where the GPT-2 ranks are (and,
// through support/scratch.h, a scratch directory and file helpers).
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <string>

#include "support/scratch.h"

namespace meshtrain::testing {

// $MESHTRAIN_GPT2_RANKS, else data/gpt2.tiktoken in the source tree.
inline std::string gpt2_ranks_path() {
  if (const char* env = std::getenv("MESHTRAIN_GPT2_RANKS"); env != nullptr && *env != '\0') {
    return env;
  }
  return std::string(MESHTRAIN_SOURCE_DIR) + "/data/gpt2.tiktoken";
}

// Skips the test when the ranks are absent, unless ctest's fixture fetched
// them and set MESHTRAIN_REQUIRE_GPT2_RANKS (then their absence is a failure).
#define MESHTRAIN_NEED_GPT2_RANKS()                                                          \
  do {                                                                                       \
    if (!std::filesystem::exists(::meshtrain::testing::gpt2_ranks_path())) {                 \
      if (std::getenv("MESHTRAIN_REQUIRE_GPT2_RANKS") != nullptr) {                          \
        FAIL() << "no GPT-2 ranks at " << ::meshtrain::testing::gpt2_ranks_path();           \
      }                                                                                      \
      GTEST_SKIP() << "no GPT-2 ranks at " << ::meshtrain::testing::gpt2_ranks_path()        \
                   << " (scripts/get_gpt2_ranks.sh fetches them)";                          \
    }                                                                                        \
  } while (0)

}  // namespace meshtrain::testing
