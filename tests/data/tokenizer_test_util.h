// Shared by the tokenizer and prepare tests: where the GPT-2 ranks are, a
// scratch directory, and small file helpers.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

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

// A fresh directory named after the running test, under $MESHTRAIN_TEST_SCRATCH
// (set by tests/tokenizer.cmake's second runs, which may overlap the first) or
// the build tree's test_scratch.
inline std::string scratch_dir() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const char* root = std::getenv("MESHTRAIN_TEST_SCRATCH");
  auto dir = std::filesystem::path(root != nullptr ? root : MESHTRAIN_BINARY_DIR "/test_scratch") /
             (std::string(info->test_suite_name()) + "." + info->name());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

inline void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out << bytes;
  ASSERT_TRUE(out.good()) << path;
}

inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace meshtrain::testing
