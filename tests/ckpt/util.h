// Helpers for the checkpoint tests: the one-line Error check and a fixture with
// a CPU context and a scratch directory. Shapes and file helpers are in tests/support.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "meshtrain/backend/cpu/cpu_backend.h"
#include "meshtrain/util/error.h"
#include "support/error_of.h"
#include "support/scratch.h"
#include "support/tiny_models.h"

namespace meshtrain::ckpt_test {

using testing::error_of;

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
