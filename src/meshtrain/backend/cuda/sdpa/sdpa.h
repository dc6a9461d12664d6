// cuDNN's fused attention (SDPA) graphs through the cuDNN frontend (header-
// only, scripts/get_cudnn_frontend.sh), in their own translation unit: causal
// grouped-query attention with an optional sliding window, forward with the
// softmax statistics and a deterministic backward, in the layouts the backend
// keeps (q [B, H, T, D], k and v [B, KV, T, D], the output and its gradient
// [B, T, H, D]). Built only where the frontend's headers were fetched
// (MESHTRAIN_HAVE_CUDNN_FRONTEND); elsewhere absent.cpp declines every shape,
// and the reference kernels (kernels.h) run attention.
//
// Validation needs no GPU: with the target's SM version set the frontend
// checks the graph without asking a device, which is what CI can run here.
// Building the plans and running them needs one (scripts/gpu_check.sh).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "meshtrain/backend/ops.h"
#include "meshtrain/tensor/dtype.h"

struct CUstream_st;  // cudaStream_t

namespace meshtrain::cuda {

struct SdpaShape {
  int64_t batch = 0, heads = 0, kv_heads = 0, seq = 0, head_dim = 0;
  int64_t window = 0;  // 0: the whole causal prefix
  DType dtype = DType::bf16;
  auto operator<=>(const SdpaShape&) const = default;
};

// The shape of attention_forward's `dims` in `compute`.
inline SdpaShape sdpa_shape(const ops::AttentionDims& d, DType compute) {
  return {d.batch, d.n_heads, d.n_kv_heads, d.seq, d.head_dim, d.window, compute};
}

// Why the cuDNN path does not take attention_forward's `dims` in `compute`
// ("" when it does, as far as is known before the graphs are built for a
// device): whole rows (packed records' positions are not a shape cuDNN's
// graphs take here), 16-bit inputs, head_dim a multiple of 8 up to 256
// (sdpa_shape_declines), and cuDNN 9 loadable. Context parallelism's
// kernels never take it.
std::string sdpa_declines(const ops::AttentionDims& dims, DType compute);

inline std::string sdpa_shape_declines(const ops::AttentionDims& d, DType compute) {
  if (d.positions != nullptr) return "packed records take the reference kernels";
  if (compute != DType::bf16 && compute != DType::f16) {
    return "cuDNN's fused attention takes 16-bit inputs, not " + std::string(dtype_name(compute));
  }
  if (d.head_dim % 8 != 0 || d.head_dim > 256) {
    return "cuDNN's fused attention takes head_dim a multiple of 8 up to 256, not " +
           std::to_string(d.head_dim);
  }
  return "";
}

// What the memory plan counts for cuDNN's own backward workspace, which is the
// engine's a device picks: a flash-attention backward's dQ accumulator and
// row sums, f32 [B, H, T, D + 1] (an estimate until a GPU measures it).
inline size_t sdpa_backward_workspace_estimate(const SdpaShape& s) {
  return static_cast<size_t>(s.batch * s.heads * s.seq * (s.head_dim + 1)) * sizeof(float);
}

// "" when the frontend accepts both graphs of `shape` for compute capability
// `sm_version` (90: Hopper, 80: Ampere), else its reason (one line).
std::string validate_sdpa(const SdpaShape& shape, int sm_version);

// The device pointers of one forward: q, k, v in, o and stats (f32 [B, H, T],
// the log-sum-exp of each query's scaled scores) out.
struct SdpaForward {
  const void *q = nullptr, *k = nullptr, *v = nullptr;
  void* o = nullptr;
  float* stats = nullptr;
};

// ... of one backward: the forward's q, k, v, o and stats, and d_o (the
// dtype's) in; dq [B, H, T, D], dk and dv [B, KV, T, D] (the dtype's) out.
struct SdpaBackward {
  const void *q = nullptr, *k = nullptr, *v = nullptr, *o = nullptr, *d_o = nullptr;
  const float* stats = nullptr;
  void *dq = nullptr, *dk = nullptr, *dv = nullptr;
};

// The graphs of one device and stream: a cuDNN handle (made with the first
// shape), and each shape's two graphs built (heuristics' first choice) on
// first use and kept.
class SdpaRunner {
 public:
  explicit SdpaRunner(CUstream_st* stream);
  ~SdpaRunner();
  SdpaRunner(const SdpaRunner&) = delete;
  SdpaRunner& operator=(const SdpaRunner&) = delete;

  // "" once both graphs of `shape` are built for this device, else why not
  // (declined, refused by cuDNN, or failed to build; remembered).
  std::string prepare(const SdpaShape& shape);
  // The workspace bytes of a prepared shape's forward / backward.
  size_t forward_workspace(const SdpaShape& shape) const;
  size_t backward_workspace(const SdpaShape& shape) const;
  // Issue a prepared shape's graph on the stream; errors throw (kind resource).
  void forward(const SdpaShape& shape, const SdpaForward& io, void* workspace) const;
  void backward(const SdpaShape& shape, const SdpaBackward& io, void* workspace) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace meshtrain::cuda
