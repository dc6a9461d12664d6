// Helpers for the checkpoint tests: scratch files and a tiny model.
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <string>

#include "meshtrain/model/model.h"
#include "meshtrain/util/error.h"

namespace meshtrain::ckpt_test {

// A scratch directory unique to the running test (ctest runs tests in parallel).
inline std::string scratch_dir() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  auto dir = std::filesystem::path(MESHTRAIN_BINARY_DIR) / "test_scratch" /
             (std::string(info->test_suite_name()) + "." + info->name());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

inline void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

inline std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// The Error message `fn` throws; fails the test when it throws nothing or something else.
inline std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not a meshtrain::Error: " << e.what();
    return {};
  }
  ADD_FAILURE() << "no Error thrown";
  return {};
}

// One line that names the file and contains `part`.
#define EXPECT_ERROR(expr, file, part)                                    \
  do {                                                                    \
    const std::string msg_ = ::meshtrain::ckpt_test::error_of([&] { expr; }); \
    EXPECT_NE(msg_.find(file), std::string::npos) << msg_;                \
    EXPECT_NE(msg_.find(part), std::string::npos) << msg_;                \
    EXPECT_EQ(msg_.find('\n'), std::string::npos) << msg_;                \
  } while (0)

inline ModelConfig small_llama(bool tied) {
  ModelConfig c;
  c.family = Family::llama;
  c.dim = 16;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.hidden_dim = 24;
  c.vocab_size = 19;
  c.max_seq_len = 8;
  c.tie_embeddings = tied;
  c.init_std = 0.3f;
  return c;
}

inline ModelConfig small_gpt2() {
  ModelConfig c;
  c.family = Family::gpt2;
  c.dim = 16;
  c.n_layers = 2;
  c.n_heads = 2;
  c.n_kv_heads = 2;
  c.hidden_dim = 64;
  c.vocab_size = 19;
  c.max_seq_len = 8;
  c.init_std = 0.3f;
  return c;
}

}  // namespace meshtrain::ckpt_test
