// The CUDA backend's registry entry: available where the runtime sees a
// device; the workspaces the memory plan asks a kind for, as the backend
// takes them (cuda_backend.cpp).

#include <algorithm>

#include "meshtrain/backend/cuda/cuda_backend.h"
#include "meshtrain/backend/cuda/matmul.h"
#include "meshtrain/backend/cuda/runtime.h"
#include "meshtrain/backend/kinds.h"

namespace meshtrain {

namespace {

size_t attention_workspace(const ops::AttentionDims& d, DType, bool recompute_probs,
                           bool backward, int) {
  if (!backward) return 0;
  const auto f = static_cast<size_t>(sizeof(float));
  const auto scores = static_cast<size_t>(d.batch * d.n_heads * d.seq * d.seq) * f;
  const auto grads =
      static_cast<size_t>(d.batch * (d.n_heads + 2 * d.n_kv_heads) * d.seq * d.head_dim) * f;
  return (recompute_probs ? 2 : 1) * scores + grads;
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
      .context_attention_workspace_bytes = [](const ops::ContextDims&, DType, bool, bool,
                                              int) { return size_t{0}; },
      .ring_attention_workspace_bytes = [](const ops::ContextDims&, DType, bool, int) {
        return size_t{0};
      },
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
  };
}

}  // namespace meshtrain
