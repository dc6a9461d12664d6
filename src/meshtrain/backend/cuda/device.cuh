// Device-side helpers of the .cu files: element types as tags, launch sizes,
// fixed-order block reductions.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "meshtrain/backend/cuda/kernels.h"
#include "meshtrain/util/error_kind.h"

namespace meshtrain::cuda {

// Element tags: T is the stored type; load widens to f32, store rounds to T.
struct F32 {
  using T = float;
  static __device__ __forceinline__ float load(T v) { return v; }
  static __device__ __forceinline__ T store(float x) { return x; }
};
struct BF16 {
  using T = uint16_t;
  static __device__ __forceinline__ float load(T v) { return math::bf16_to_float(v); }
  static __device__ __forceinline__ T store(float x) { return math::bf16_from_float(x); }
};
struct F16 {
  using T = uint16_t;
  static __device__ __forceinline__ float load(T v) { return math::f16_to_float(v); }
  static __device__ __forceinline__ T store(float x) { return math::f16_from_float(x); }
};

// Calls fn with the tag of `e`.
template <typename Fn>
void with_elem(Elem e, Fn&& fn) {
  switch (e) {
    case Elem::f32: fn(F32{}); return;
    case Elem::bf16: fn(BF16{}); return;
    case Elem::f16: fn(F16{}); return;
  }
}

// A launch that failed (its configuration, or an earlier kernel's fault) as an Error.
inline void check_launch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    throw Error(std::string("cuda: launching ") + what + ": " + cudaGetErrorString(err),
                ErrorKind::resource);
  }
}

inline constexpr int kThreads = 256;

// Blocks for a grid-stride loop over n elements.
inline unsigned blocks_for(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < 1 ? 1 : (b > 65535 * 8 ? 65535 * 8 : b));
}

#define MESHTRAIN_GRID_STRIDE(i, n)                                                  \
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); \
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)

// Sum / max over a block of kThreads threads in a fixed tree; every thread gets
// the result. `scratch` holds kThreads / 32 values and is free again on return.
template <typename V, typename Op>
__device__ __forceinline__ V block_reduce(V v, V* scratch, V identity, Op op) {
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_down_sync(0xffffffffu, v, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = threadIdx.x < kThreads / 32 ? scratch[threadIdx.x] : identity;
  if (warp == 0) {
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_down_sync(0xffffffffu, v, o));
    if (lane == 0) scratch[0] = v;
  }
  __syncthreads();
  v = scratch[0];
  __syncthreads();
  return v;
}

struct Add {
  template <typename V>
  __device__ __forceinline__ V operator()(V a, V b) const { return a + b; }
};
struct Max {
  __device__ __forceinline__ float operator()(float a, float b) const { return a > b ? a : b; }
};

__device__ __forceinline__ float block_sum(float v, float* scratch) {
  return block_reduce(v, scratch, 0.0f, Add{});
}
__device__ __forceinline__ double block_sum(double v, double* scratch) {
  return block_reduce(v, scratch, 0.0, Add{});
}
__device__ __forceinline__ float block_max(float v, float* scratch) {
  return block_reduce(v, scratch, math::negative_infinity(), Max{});
}

}  // namespace meshtrain::cuda
