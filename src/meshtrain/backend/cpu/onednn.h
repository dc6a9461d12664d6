// Internal to the CPU backend: CpuContext's oneDNN state (engine, stream,
// matmul primitive cache) and reusable tracked workspace buffers.
#pragma once

#include <oneapi/dnnl/dnnl.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <vector>

#include "meshtrain/backend/cpu/context.h"
#include "meshtrain/backend/cpu/matmul.h"
#include "meshtrain/tensor/tensor.h"

namespace meshtrain::cpu {

// Everything that selects a distinct matmul primitive.
struct MatmulKey {
  int64_t batch, m, n, k;
  int64_t lda, ldb, ldc;  // resolved (never 0)
  uint32_t alpha_bits;
  uint8_t ab, c, flags;  // flags: trans_a | trans_b<<1 | broadcast_b<<2 | accumulate<<3 | bias<<4
  bool operator==(const MatmulKey&) const = default;
};

struct MatmulKeyHash {
  size_t operator()(const MatmulKey& key) const {
    uint64_t h = 1469598103934665603ull;
    auto mix = [&h](uint64_t v) { h = (h ^ v) * 1099511628211ull; };
    mix(static_cast<uint64_t>(key.batch));
    mix(static_cast<uint64_t>(key.m));
    mix(static_cast<uint64_t>(key.n));
    mix(static_cast<uint64_t>(key.k));
    mix(static_cast<uint64_t>(key.lda) | static_cast<uint64_t>(key.ldb) << 21 |
        static_cast<uint64_t>(key.ldc) << 42);
    mix(key.alpha_bits);
    mix(static_cast<uint64_t>(key.ab) | static_cast<uint64_t>(key.c) << 8 |
        static_cast<uint64_t>(key.flags) << 16);
    return static_cast<size_t>(h);
  }
};

// A ready primitive plus memory objects whose data handles are swapped per call.
struct MatmulEntry {
  dnnl::matmul prim;
  dnnl::memory src, wei, dst, bias;
  int bias_arg = DNNL_ARG_BIAS;  // or a post-op argument when alpha != 1
  size_t scratchpad_bytes = 0;
};

// Named workspace buffers that persist across calls (grown, never shrunk), so
// hot kernels do not allocate and zero-fill large temporaries every step.
enum class Scratch : uint8_t {
  onednn,  // oneDNN's scratchpad
  attention,  // per-thread workspace of attention_forward/backward
  logits,
  dlogits,
  dw_t,  // the fused classifier's d(W)^T
  f16_staging,  // f32 copies of an f16 GEMM's operands and result (matmul.cpp)
  grouped,  // grouped_matmul's per-thread scratchpads
  count
};

struct CpuContext::Impl {
  explicit Impl(MemoryTracker& tracker);

  dnnl::engine engine;
  dnnl::stream stream;
  std::unordered_map<MatmulKey, MatmulEntry, MatmulKeyHash> matmuls;
  dnnl::memory scratchpad;
  std::vector<dnnl::stream> thread_streams;  // one per OpenMP thread, for ThreadMatmul

  // At least `bytes` of 64-byte aligned workspace for `slot` (contents unspecified).
  void* scratch(Scratch slot, size_t bytes);

 private:
  MemoryTracker& tracker_;
  std::array<Tensor, static_cast<size_t>(Scratch::count)> scratch_;
};

// An f16 GEMM (oneDNN 2.6 has no f16 matmul on CPUs without AVX512-FP16) runs
// as the f32 GEMM of its operands widened exactly to f32, the result rounded
// to f16 when C is f16: what an f16 tensor-core GEMM with f32 accumulation
// computes. F16Staging is the f32 space that takes.
struct F16Staging {
  bool active = false;
  int64_t a_span = 0, b_span = 0;  // elements of A and B as stored (with leading dimensions)
  int64_t c_elems = 0;             // dense f32 result to round into an f16 C (0: C is f32)
  MatmulDims f32_dims;             // the GEMM run on the staging (C dense when c_elems > 0)
  size_t bytes() const;
  // Widens A and B, runs gemm(a32, b32, c32 or c), rounds c32 into C.
  // `threaded`: convert with the OpenMP team (false inside a parallel region).
  template <typename Gemm>
  void run(const MatmulDims& dims, DType ab, const void* a, const void* b, DType c_dtype, void* c,
           void* space, bool threaded, Gemm gemm) const;
};
F16Staging f16_staging(const MatmulDims& dims, DType ab, DType c_dtype);
// A ThreadMatmul's per-thread scratchpad: the f16 staging, then oneDNN's
// scratchpad (onednn_bytes) rounded to 64 bytes.
size_t thread_pad_bytes(const F16Staging& staging, size_t onednn_bytes);
// ThreadMatmul(dims, ab, c_dtype, alpha, accumulate).scratchpad_bytes() with
// `threads` OpenMP threads, without a context (the same primitive descriptor).
size_t thread_matmul_scratchpad_bytes(const MatmulDims& dims, DType ab, DType c_dtype, int threads,
                                      float alpha = 1.0f, bool accumulate = false);

// The cached primitive for these arguments (created on first use; not thread-safe).
MatmulEntry& find_matmul(CpuContext& ctx, const MatmulDims& dims, DType ab, DType c_dtype,
                         float alpha, bool accumulate, bool bias);

// A GEMM that many OpenMP threads run at once on their own operands (e.g. one
// attention head group each); oneDNN then runs each call single-threaded.
// Construct outside the parallel region; run() from inside it.
class ThreadMatmul {
 public:
  ThreadMatmul(CpuContext& ctx, const MatmulDims& dims, DType ab, DType c_dtype, float alpha = 1.0f,
               bool accumulate = false);
  // Bytes of scratchpad each thread must pass to run() (64-byte aligned).
  size_t scratchpad_bytes() const { return thread_pad_bytes(staging_, pad_bytes_); }
  void run(int thread, const void* a, const void* b, void* c, void* pad);

 private:
  void run_primitive(int thread, const void* a, const void* b, void* c, void* pad);
  struct PerThread {
    dnnl::memory src, wei, dst, pad;
    std::unordered_map<int, dnnl::memory> args;
  };
  dnnl::matmul prim_;
  std::vector<PerThread> threads_;
  std::vector<dnnl::stream>* streams_;
  size_t pad_bytes_ = 0;  // oneDNN's (after the f16 staging in run()'s pad)
  MatmulDims dims_;
  DType ab_ = DType::f32, c_ = DType::f32;
  F16Staging staging_;
};

}  // namespace meshtrain::cpu
