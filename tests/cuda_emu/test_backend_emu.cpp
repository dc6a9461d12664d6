// The CUDA backend itself, host code and kernels, on the emulated device
// (tests/cuda_emu/emu.h): `meshtrain ops test`'s whole suite against the CPU
// backend. Its GEMMs are the CPU backend's (gemms_emu.cpp), so the matmul
// cases check the backend's calls around them, not cuBLASLt.
#include <gtest/gtest.h>

#include <cstdio>

#define cuda cuda_emu
#include "meshtrain/backend/cuda/cuda_backend.h"
#undef cuda

#include "meshtrain/backend/ops_suite.h"
#include "meshtrain/backend/registry.h"

namespace meshtrain {
namespace {

TEST(CudaEmu, TheBackendPassesTheOpsSuiteAgainstTheCpuBackend) {
  MemoryTracker tracker, reference_tracker;
  cuda_emu::CudaBackend emulated(tracker);
  const auto cpu = make_backend("cpu", 1, reference_tracker);
  const OpsTestResult result = run_ops_test(emulated, cpu.get(), {}, stdout);
  EXPECT_GT(result.passed, 0);
  for (const std::string& failure : result.failures) ADD_FAILURE() << failure;
}

}  // namespace
}  // namespace meshtrain
