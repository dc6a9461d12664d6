// The CUDA backend through the registry: without a device (or without CUDA
// in the build) asking for it is one resource error saying why, and the
// tests that need a GPU report SKIPPED with that reason; with one, the whole
// ops suite runs against the CPU backend and passes.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include "meshtrain/backend/ops_suite.h"
#include "meshtrain/backend/registry.h"
#include "meshtrain/util/error.h"

namespace meshtrain {
namespace {

std::string unavailable() {
  try {
    backend_kind("cuda");
    return "";
  } catch (const Error& e) {
    return e.what();
  }
}

TEST(CudaBackend, WithoutADeviceIsOneResourceError) {
  const std::string why = unavailable();
  if (why.empty()) GTEST_SKIP() << "a CUDA device is present";
  MemoryTracker tracker;
  try {
    make_backend("cuda", 1, tracker);
    FAIL() << "made a CUDA backend without a device";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::resource);
    EXPECT_EQ(std::string(e.what()).rfind("backend 'cuda' is not available: ", 0), 0u) << e.what();
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos);
  }
}

TEST(CudaBackend, PassesTheOpsSuiteAgainstTheCpuBackend) {
  const std::string why = unavailable();
  if (!why.empty()) GTEST_SKIP() << why;
  MemoryTracker tracker, reference_tracker;
  const auto cuda = make_backend("cuda", 1, tracker);
  const auto cpu = make_backend("cpu", 2, reference_tracker);
  const OpsTestResult result = run_ops_test(*cuda, cpu.get(), {}, stdout);
  EXPECT_GT(result.passed, 0);
  for (const std::string& failure : result.failures) ADD_FAILURE() << failure;
}

}  // namespace
}  // namespace meshtrain
