// cuDNN's fused attention (SDPA) graphs through the cuDNN frontend (header-
// only, scripts/get_cudnn_frontend.sh), in their own translation unit: causal
// grouped-query attention with an optional sliding window, forward with the
// softmax statistics and backward, in the layouts the backend keeps (q
// [B, H, T, D], k and v [B, KV, T, D], the output [B, T, H, D]). Built only
// where the frontend's headers were fetched (MESHTRAIN_HAVE_CUDNN_FRONTEND).
// Validation needs no GPU: with the target's SM version set the frontend
// checks the graph without asking a device, which is what CI can run here.
// Not yet wired into attention_forward / attention_backward (docs/gpu.md).
#pragma once

#include <cstdint>
#include <string>

#include "meshtrain/tensor/dtype.h"

namespace meshtrain::cuda {

struct SdpaShape {
  int64_t batch = 0, heads = 0, kv_heads = 0, seq = 0, head_dim = 0;
  int64_t window = 0;  // 0: the whole causal prefix
  DType dtype = DType::bf16;
};

// "" when the frontend accepts both graphs of `shape` for compute capability
// `sm_version` (90: Hopper, 80: Ampere), else its reason (one line).
std::string validate_sdpa(const SdpaShape& shape, int sm_version);

}  // namespace meshtrain::cuda
