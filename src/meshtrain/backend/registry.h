// The backends this build knows, by the name train.device and `ops test
// --backend` take: how to make one, and what the memory plan asks a kind of
// backend before any exists (its thread count, its kernels' workspace).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "meshtrain/backend/backend.h"

namespace meshtrain {

struct BackendKind {
  const char* name;
  // Why this build cannot make one ("" when it can): not compiled in, no
  // device. Only an available kind's functions below are set.
  std::string (*unavailable)() = nullptr;
  std::unique_ptr<Backend> (*make)(int threads, MemoryTracker& tracker) = nullptr;
  // The host threads a backend asked for `requested` (<= 0: every core) runs with.
  int (*threads)(int requested) = nullptr;
  // The workspace one matmul takes with `threads` threads.
  ops::MatmulWorkspace (*matmul_workspace)(const ops::MatmulDims& dims, DType ab, DType c_dtype,
                                           int threads, float alpha, bool accumulate,
                                           bool bias) = nullptr;
  // The workspace one grouped_matmul takes with `threads` threads.
  size_t (*grouped_matmul_workspace)(const ops::GroupedMatmulDims& dims, DType ab, DType c_dtype,
                                     int threads, float alpha, bool accumulate) = nullptr;
  // attention_forward's (backward = false) or attention_backward's workspace.
  size_t (*attention_workspace_bytes)(const ops::AttentionDims& dims, DType compute,
                                      bool recompute_probs, bool backward, int threads) = nullptr;
  // A fused attention kernel (the CUDA backend's cuDNN path; nullptr: none):
  // when it takes attention_forward's `dims` (whole rows) in `compute`, what
  // forward keeps beside q, k and v instead of the probabilities, and each
  // direction's buffers for one call, which replace attention_workspace_bytes.
  std::optional<ops::FusedAttentionBytes> (*fused_attention)(const ops::AttentionDims& dims,
                                                             DType compute) = nullptr;
  // context_attention_forward's or _backward's (context parallelism).
  size_t (*context_attention_workspace_bytes)(const ops::ContextDims& dims, DType compute,
                                              bool recompute_probs, bool backward,
                                              int threads) = nullptr;
  // ring_attention_forward_block's or _backward_block's.
  size_t (*ring_attention_workspace_bytes)(const ops::ContextDims& dims, DType compute,
                                           bool backward, int threads) = nullptr;
  // fused_classifier's over `rows` rows of a [vocab, dim] output layer
  // (trains_w: d(W) is computed).
  ops::ClassifierWorkspace (*classifier_workspace)(int64_t rows, int64_t dim, int64_t vocab,
                                                   DType compute, bool trains_w,
                                                   int threads) = nullptr;
  // The start-up matmul peak probe's.
  ops::PeakProbeWorkspace (*peak_probe_workspace)(DType ab, int threads) = nullptr;
  // Whether attention's and the classifier's buffers are allocated for each
  // call and freed (the CUDA backend, whose caching allocator makes that
  // cheap), so they never coexist; false: kept slots, grown and never shrunk
  // (the CPU backend's Scratch), which add up.
  bool per_call_buffers = false;
};

// The backend of the host-side commands (sample, eval, import, export).
inline constexpr const char* kHostBackend = "cpu";

// Every backend name, built or not ("cpu", "cuda").
std::vector<std::string> backend_names();
// "" when this build and machine can make a backend called `name`, else why not.
std::string backend_unavailable(const std::string& name);
// The kind called `name`: a config error naming train.device for an unknown
// one, a resource error saying why for one this build or machine cannot make.
const BackendKind& backend_kind(const std::string& name);
// A backend of kind `name` with `threads` host threads (errors as backend_kind's).
std::unique_ptr<Backend> make_backend(const std::string& name, int threads, MemoryTracker& tracker);

}  // namespace meshtrain
