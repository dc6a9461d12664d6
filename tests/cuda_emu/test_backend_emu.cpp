// The CUDA backend itself, host code and kernels, on the emulated device
// (tests/cuda_emu/emu.h): `meshtrain ops test`'s whole suite against the CPU
// backend, and attention again through the cuDNN path's host side. Its GEMMs are the CPU backend's (gemms_emu.cpp), so the matmul
// cases check the backend's calls around them, not cuBLASLt.
#include <gtest/gtest.h>

#include <cstdio>

#define cuda cuda_emu
#include "meshtrain/backend/cuda/cuda_backend.h"
#undef cuda

#include "meshtrain/backend/ops_suite.h"
#include "sdpa_emu.h"
#include "meshtrain/backend/registry.h"

namespace meshtrain {
namespace {

// The suite over `op_regex`, attention on cuDNN's stand-in (sdpa_emu.h) or not.
void run_suite(const std::string& op_regex, bool fused) {
  emu::fused_attention = fused;
  MemoryTracker tracker, reference_tracker;
  cuda_emu::CudaBackend emulated(tracker);
  const auto cpu = make_backend("cpu", 1, reference_tracker);
  const OpsTestResult result = run_ops_test(emulated, cpu.get(), {.op_regex = op_regex}, stdout);
  emu::fused_attention = true;
  EXPECT_GT(result.passed, 0);
  for (const std::string& failure : result.failures) ADD_FAILURE() << failure;
}

// Every op; attention on the reference kernels, every case.
TEST(CudaEmu, TheBackendPassesTheOpsSuiteAgainstTheCpuBackend) { run_suite("", false); }

// Attention through the cuDNN path's host side: its 16-bit whole-row cases
// on the stand-in, the rest (f32, packed records) on the reference kernels.
TEST(CudaEmu, TheFusedAttentionPathPassesTheOpsSuite) {
  run_suite("^attention_(forward|backward)$", true);
}

}  // namespace
}  // namespace meshtrain
