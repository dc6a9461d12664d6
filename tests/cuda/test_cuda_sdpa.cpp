// cuDNN's fused-attention graphs for the models' shapes, validated for Hopper
// (sm_90) and Ampere (sm_80) by the cuDNN frontend without a GPU: GPT-2 124M,
// Llama-3-8B (GQA 32/8, head 128) at 2K and 8K, Mistral's sliding window,
// f16 as well as bf16; and a head width cuDNN refuses, refused with its reason.
// SKIPPED where the build has no cuDNN frontend (no CUDA toolkit, or
// scripts/get_cudnn_frontend.sh not run).
#include <gtest/gtest.h>

#if defined(MESHTRAIN_HAVE_CUDNN_FRONTEND)
#include "meshtrain/backend/cuda/sdpa/sdpa.h"
#endif

namespace meshtrain {
namespace {

TEST(CudaSdpa, ModelShapesValidateWithoutAGpu) {
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
#else
  GTEST_SKIP() << "this build has no cuDNN frontend (no CUDA toolkit, or "
                  "scripts/get_cudnn_frontend.sh not run)";
#endif
}

}  // namespace
}  // namespace meshtrain
