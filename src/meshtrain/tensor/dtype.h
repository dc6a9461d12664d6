// Element types: f32 for math and master weights, bf16 or f16 for compute
// copies and activations in mixed precision (f16 also as a storage format);
// i32 for token ids, targets and positions in device memory (never converted
// to or from a float type).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

namespace meshtrain {

enum class DType : uint8_t { f32, bf16, f16, i32 };

size_t dtype_size(DType dtype);
std::string_view dtype_name(DType dtype);
// Parses "f32" / "bf16" / "f16" (also safetensors' "F32", "BF16", "F16"); throws Error
// otherwise (i32 is not a parameter dtype).
DType parse_dtype(std::string_view name);

// bfloat16 storage: the upper 16 bits of an IEEE float.
struct bf16 {
  uint16_t bits;
};

inline float bf16_to_float(bf16 value) {
  uint32_t u = static_cast<uint32_t>(value.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Round to nearest even, NaN kept quiet (same as PyTorch's c10::BFloat16).
inline bf16 float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{static_cast<uint16_t>((u >> 16) | 0x40u)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16{static_cast<uint16_t>(u >> 16)};
}

// IEEE half precision storage, converted through the compiler's half type:
// _Float16 (g++ 12 on any x86-64; clang 14 only with AVX512-FP16), else
// clang's storage-only __fp16, which rounds the same way (nearest even).
struct f16 {
  uint16_t bits;
};
#if defined(__FLT16_MAX__)
using native_half = _Float16;
#else
using native_half = __fp16;
#endif

inline float f16_to_float(f16 value) {
  native_half h;
  std::memcpy(&h, &value.bits, sizeof h);
  return static_cast<float>(h);
}

inline f16 float_to_f16(float f) {
  auto h = static_cast<native_half>(f);
  f16 out;
  std::memcpy(&out.bits, &h, sizeof h);
  return out;
}

// Converts n elements between any two dtypes (threaded).
void convert(DType from, const void* src, DType to, void* dst, size_t n);

}  // namespace meshtrain
