// Helpers for the checkpoint tests: the one-line Error check and a fixture with
// a CPU context and a scratch directory. Shapes and file helpers are in tests/support.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "meshtrain/backend/cpu/cpu_backend.h"
#include "meshtrain/util/error.h"
#include "support/scratch.h"
#include "support/tiny_models.h"

namespace meshtrain::ckpt_test {

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

// A one-thread CPU context and a fresh scratch directory for each test.
class CkptTest : public ::testing::Test {
 protected:
  MemoryTracker tracker;
  cpu::CpuBackend ctx{1, tracker};
  std::string dir = testing::scratch_dir();
};

}  // namespace meshtrain::ckpt_test
