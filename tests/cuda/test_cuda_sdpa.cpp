// cuDNN's fused-attention graphs for the models' shapes, validated for Hopper
// (sm_90) and Ampere (sm_80) by the cuDNN frontend without a GPU: GPT-2 124M,
// Llama-3-8B (GQA 32/8, head 128) at 2K and 8K, Mistral's sliding window,
// f16 as well as bf16, each with its deterministic backward; a head width
// cuDNN refuses, refused with its reason; which attention the backend sends
// to cuDNN and which to its reference kernels, and what the memory plan
// counts for the cuDNN path. SKIPPED where the build has no cuDNN frontend
// (no CUDA toolkit, or scripts/get_cudnn_frontend.sh not run). Running the
// graphs needs a GPU: scripts/gpu_check.sh's ops suite.
#include <gtest/gtest.h>

#if defined(MESHTRAIN_HAVE_CUDNN_FRONTEND)
#include "meshtrain/backend/cuda/runtime.h"
#include "meshtrain/backend/cuda/sdpa/sdpa.h"
#include "meshtrain/backend/kinds.h"
#include "meshtrain/backend/registry.h"
#endif

namespace meshtrain {
namespace {

#if defined(MESHTRAIN_HAVE_CUDNN_FRONTEND)
#define SKIP_WITHOUT_FRONTEND()
#else
#define SKIP_WITHOUT_FRONTEND()                                              \
  GTEST_SKIP() << "this build has no cuDNN frontend (no CUDA toolkit, or " \
                  "scripts/get_cudnn_frontend.sh not run)"
#endif

TEST(CudaSdpa, ModelShapesValidateWithoutAGpu) {
  SKIP_WITHOUT_FRONTEND();
#if defined(MESHTRAIN_HAVE_CUDNN_FRONTEND)
  using cuda::SdpaShape;
  const SdpaShape shapes[] = {
      {8, 12, 12, 1024, 64, 0, DType::bf16},    // GPT-2 124M
      {2, 32, 8, 2048, 128, 0, DType::bf16},    // Llama-3-8B
      {1, 32, 8, 8192, 128, 0, DType::bf16},    // Llama-3-8B at 8K
      {1, 32, 8, 8192, 128, 4096, DType::bf16}, // Mistral-7B's window
      {4, 16, 16, 512, 64, 0, DType::f16},
  };
  for (int sm : {90, 80}) {
    for (const SdpaShape& s : shapes) {
      EXPECT_EQ(cuda::validate_sdpa(s, sm), "")
          << "sm " << sm << " B " << s.batch << " H " << s.heads << " KV " << s.kv_heads << " T "
          << s.seq << " D " << s.head_dim << " window " << s.window;
    }
  }
  const std::string why = cuda::validate_sdpa({1, 4, 4, 64, 512, 0, DType::bf16}, 90);
  EXPECT_NE(why.find("256"), std::string::npos) << why;
#endif
}

// What the backend keeps on its reference kernels, each with its reason.
TEST(CudaSdpa, DeclinesWhatItsGraphsDoNotTake) {
  SKIP_WITHOUT_FRONTEND();
#if defined(MESHTRAIN_HAVE_CUDNN_FRONTEND)
  const ops::AttentionDims gpt2{8, 1024, 12, 12, 64};
  EXPECT_EQ(cuda::sdpa_declines(gpt2, DType::bf16), "");
  EXPECT_EQ(cuda::sdpa_declines(gpt2, DType::f16), "");
  EXPECT_NE(cuda::sdpa_declines(gpt2, DType::f32).find("16-bit"), std::string::npos);
  ops::AttentionDims packed = gpt2;
  const int32_t positions[1] = {0};
  packed.positions = positions;
  EXPECT_NE(cuda::sdpa_declines(packed, DType::bf16).find("packed"), std::string::npos);
  for (int64_t head_dim : {12, 264}) {
    ops::AttentionDims odd = gpt2;
    odd.head_dim = head_dim;
    EXPECT_NE(cuda::sdpa_declines(odd, DType::bf16).find("head_dim"), std::string::npos)
        << head_dim;
  }
#endif
}

// Without a device the runner cannot make its cuDNN handle: every shape is
// refused with that reason, which sends attention to the reference kernels.
TEST(CudaSdpa, WithoutADeviceTheRunnerRefusesWithTheReason) {
  SKIP_WITHOUT_FRONTEND();
#if defined(MESHTRAIN_HAVE_CUDNN_FRONTEND)
  if (cuda::device_unavailable().empty()) GTEST_SKIP() << "a CUDA device is present";
  cuda::SdpaRunner runner(nullptr);
  const std::string why = runner.prepare({8, 12, 12, 1024, 64, 0, DType::bf16});
  EXPECT_NE(why, "");
  EXPECT_NE(why.find("cudnn"), std::string::npos) << why;
#endif
}

// The memory plan's count for the cuDNN path (BackendKind::fused_attention):
// the output and f32 statistics kept instead of the probabilities; none for
// what the reference kernels run.
TEST(CudaSdpa, ThePlanCountsTheFusedPathsState) {
  SKIP_WITHOUT_FRONTEND();
#if defined(MESHTRAIN_HAVE_CUDNN_FRONTEND)
  const BackendKind kind = cuda_backend_kind();
  ASSERT_NE(kind.fused_attention, nullptr);
  const ops::AttentionDims d{8, 1024, 12, 4, 64};
  const auto fused = kind.fused_attention(d, DType::bf16);
  ASSERT_TRUE(fused.has_value());
  const size_t q = 8 * 1024 * 12 * 64, kv = 8 * 1024 * 4 * 64, rows = 8 * 12 * 1024;
  EXPECT_EQ(fused->saved, 2 * q + 4 * rows);
  EXPECT_EQ(fused->forward_workspace, 0u);
  EXPECT_GE(fused->backward_workspace, 2 * q + 6 * (q + 2 * kv));
  EXPECT_LT(fused->saved, size_t{2} * 8 * 12 * 1024 * 1024);  // the probabilities it replaces
  EXPECT_FALSE(kind.fused_attention(d, DType::f32).has_value());
#endif
}

}  // namespace
}  // namespace meshtrain
