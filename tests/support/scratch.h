// A scratch directory per test and whole-file read/write helpers, shared by the
// checkpoint, data, parity and training tests.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace meshtrain::testing {

// A fresh directory named after the running test (ctest runs tests in
// parallel), under $MESHTRAIN_TEST_SCRATCH (set by tests/tokenizer.cmake's
// second runs, which may overlap the first) or the build tree's test_scratch.
inline std::string scratch_dir() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const char* root = std::getenv("MESHTRAIN_TEST_SCRATCH");
  auto dir = std::filesystem::path(root != nullptr ? root : MESHTRAIN_BINARY_DIR "/test_scratch") /
             (std::string(info->test_suite_name()) + "." + info->name());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

// Replaces the file's contents with `bytes`.
inline void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
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
