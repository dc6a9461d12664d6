// Internal to the CPU backend: CpuContext's oneDNN state (engine, stream,
// matmul primitive cache) and reusable tracked workspace buffers.
#pragma once

#include <oneapi/dnnl/dnnl.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <unordered_map>

#include "meshtrain/backend/cpu/context.h"
#include "meshtrain/tensor/tensor.h"

namespace meshtrain::cpu {

// Everything that selects a distinct matmul primitive.
struct MatmulKey {
  int64_t batch, m, n, k;
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
  attn_a,
  attn_b,
  attn_c,
  attn_d,
  attn_e,
  logits,
  dlogits,
  count
};

struct CpuContext::Impl {
  explicit Impl(MemoryTracker& tracker);

  dnnl::engine engine;
  dnnl::stream stream;
  std::unordered_map<MatmulKey, MatmulEntry, MatmulKeyHash> matmuls;
  dnnl::memory scratchpad;

  // At least `bytes` of 64-byte aligned workspace for `slot` (contents unspecified).
  void* scratch(Scratch slot, size_t bytes);

 private:
  MemoryTracker& tracker_;
  std::array<Tensor, static_cast<size_t>(Scratch::count)> scratch_;
};

}  // namespace meshtrain::cpu
