// The CUDA backend's registry entry: available where the runtime sees a
// device; the workspaces the memory plan asks a kind for, as the backend
// takes them (cuda_backend.cpp).

#include <algorithm>

#include "meshtrain/backend/cuda/cuda_backend.h"
#include "meshtrain/backend/cuda/matmul.h"
#include "meshtrain/backend/cuda/runtime.h"
#include "meshtrain/backend/cuda/sdpa/sdpa.h"
#include "meshtrain/backend/kinds.h"

namespace meshtrain {

namespace {

// CudaBackend::reference_backward's f32 buffers for Q queries against T keys:
// dS (and P when recomputed) [B, H, Q, T], dQ [B, H, Q, D], dK and dV [B, KV, T, D].
size_t reference_backward_bytes(int64_t batch, int64_t heads, int64_t kv_heads, int64_t queries,
                                int64_t keys, int64_t head_dim, bool recompute_probs) {
  const auto f = static_cast<size_t>(sizeof(float));
  const auto scores = static_cast<size_t>(batch * heads * queries * keys) * f;
  const auto grads =
      static_cast<size_t>(batch * (heads * queries + 2 * kv_heads * keys) * head_dim) * f;
  return (recompute_probs ? 2 : 1) * scores + grads;
}

size_t attention_workspace(const ops::AttentionDims& d, DType, bool recompute_probs,
                           bool backward, int) {
  if (!backward) return 0;
  return reference_backward_bytes(d.batch, d.n_heads, d.n_kv_heads, d.seq, d.seq, d.head_dim,
                                  recompute_probs);
}

// The cuDNN path (CudaBackend::attention_forward, fused_backward): forward
// keeps the output and the f32 statistics; backward holds dO and dQ, dK, dV
// in the compute dtype, their f32 copies, and cuDNN's own workspace (the
// estimate sdpa.h gives; the forward's counted as none).
std::optional<ops::FusedAttentionBytes> fused_attention(const ops::AttentionDims& d,
                                                        DType compute) {
  if (!cuda::sdpa_declines(d, compute).empty()) return std::nullopt;
  const auto e = dtype_size(compute), f = sizeof(float);
  const auto q = static_cast<size_t>(d.batch * d.seq * d.n_heads * d.head_dim);
  const auto kv = static_cast<size_t>(d.batch * d.seq * d.n_kv_heads * d.head_dim);
  const auto rows = static_cast<size_t>(d.batch * d.n_heads * d.seq);
  return ops::FusedAttentionBytes{
      .saved = e * q + f * rows,
      .forward_workspace = 0,
      .backward_workspace =
          e * q + (e + f) * (q + 2 * kv) + cuda::sdpa_backward_workspace_estimate(
                                               cuda::sdpa_shape(d, compute)),
  };
}

size_t context_workspace(const ops::ContextDims& d, DType, bool recompute_probs, bool backward,
                         int) {
  if (!backward) return 0;
  return reference_backward_bytes(d.batch, d.n_heads, d.n_kv_heads, d.local_seq, d.seq(),
                                  d.head_dim, recompute_probs);
}

// The ring's backward: P and dS [B, H, tile, L] f32 (kernels.h's ring_backward_tile).
size_t ring_workspace(const ops::ContextDims& d, DType, bool backward, int) {
  if (!backward) return 0;
  const int64_t tile = std::min(d.local_seq, cuda::kRingTile);
  return 2 * static_cast<size_t>(d.batch * d.n_heads * tile * d.local_seq) * sizeof(float);
}

}  // namespace

BackendKind cuda_backend_kind() {
  return {
      .name = "cuda",
      .unavailable = cuda::device_unavailable,
      .make = [](int, MemoryTracker& tracker) -> std::unique_ptr<Backend> {
        return std::make_unique<cuda::CudaBackend>(tracker);
      },
      .threads = [](int) { return 1; },
      .matmul_workspace = [](const ops::MatmulDims&, DType, DType, int, float, bool, bool) {
        return ops::MatmulWorkspace{cuda::kGemmWorkspace, 0};
      },
      .grouped_matmul_workspace = [](const ops::GroupedMatmulDims&, DType, DType, int, float,
                                     bool) { return size_t{0}; },
      .attention_workspace_bytes = attention_workspace,
      .fused_attention = fused_attention,
      .context_attention_workspace_bytes = context_workspace,
      .ring_attention_workspace_bytes = ring_workspace,
      .classifier_workspace = [](int64_t rows, int64_t, int64_t vocab, DType compute, bool,
                                 int) {
        const auto chunk = static_cast<size_t>(std::min(rows, cuda::kClassifierRows));
        return ops::ClassifierWorkspace{
            {cuda::kGemmWorkspace, 0},
            chunk * static_cast<size_t>(vocab) * (sizeof(float) + dtype_size(compute)) +
                chunk * sizeof(double)};
      },
      .peak_probe_workspace = [](DType ab, int) {
        const size_t n = ab == DType::f32 ? 4096 : 8192;
        return ops::PeakProbeWorkspace{n * n * (2 * dtype_size(ab) + sizeof(float)),
                                       {cuda::kGemmWorkspace, 0}};
      },
      .per_call_buffers = true,
  };
}

}  // namespace meshtrain
