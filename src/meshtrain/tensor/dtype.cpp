#include "meshtrain/tensor/dtype.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "meshtrain/util/error.h"

namespace meshtrain {

size_t dtype_size(DType dtype) { return dtype == DType::bf16 || dtype == DType::f16 ? 2 : 4; }

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::f32: return "f32";
    case DType::bf16: return "bf16";
    case DType::f16: return "f16";
    case DType::i32: return "i32";
  }
  return "?";
}

DType parse_dtype(std::string_view name) {
  if (name == "f32" || name == "F32" || name == "fp32") return DType::f32;
  if (name == "bf16" || name == "BF16") return DType::bf16;
  if (name == "f16" || name == "F16" || name == "fp16") return DType::f16;
  fail("unknown dtype '{}' (expected f32, bf16 or f16)", name);
}

namespace {

float load(DType dtype, const void* src, size_t i) {
  switch (dtype) {
    case DType::f32: return static_cast<const float*>(src)[i];
    case DType::bf16: return bf16_to_float(static_cast<const bf16*>(src)[i]);
    case DType::f16: return f16_to_float(static_cast<const f16*>(src)[i]);
    case DType::i32: break;  // convert refuses ids to or from a float type
  }
  return 0.0f;
}

void store(DType dtype, void* dst, size_t i, float value) {
  switch (dtype) {
    case DType::f32: static_cast<float*>(dst)[i] = value; break;
    case DType::bf16: static_cast<bf16*>(dst)[i] = float_to_bf16(value); break;
    case DType::f16: static_cast<f16*>(dst)[i] = float_to_f16(value); break;
    case DType::i32: break;
  }
}

}  // namespace

void convert(DType from, const void* src, DType to, void* dst, size_t n) {
  if (from == to) {
    std::memcpy(dst, src, n * dtype_size(from));
    return;
  }
  MESHTRAIN_CHECK(from != DType::i32 && to != DType::i32,
                  "convert: i32 ids do not convert to or from {}", dtype_name(from == DType::i32 ? to : from));
  const auto count = static_cast<int64_t>(n);
  // The f32 <-> bf16 pairs (the model's hot conversions) as plain loops over
  // the same bit operations as float_to_bf16 / bf16_to_float, which the
  // compiler vectorises; the generic per-element switch does not.
  if (from == DType::f32 && to == DType::bf16) {
    const auto* in = static_cast<const float*>(src);
    auto* out = static_cast<bf16*>(dst);
#pragma omp parallel for simd schedule(static) if (n > (1u << 16))
    for (int64_t i = 0; i < count; ++i) {
      uint32_t u;
      std::memcpy(&u, in + i, sizeof u);
      const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
      const uint32_t quiet = (u >> 16) | 0x40u;
      out[i].bits = static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
    }
    return;
  }
  if (from == DType::bf16 && to == DType::f32) {
    const auto* in = static_cast<const bf16*>(src);
    auto* out = static_cast<float*>(dst);
#pragma omp parallel for simd schedule(static) if (n > (1u << 16))
    for (int64_t i = 0; i < count; ++i) out[i] = bf16_to_float(in[i]);
    return;
  }
#if defined(__F16C__)
  // f32 <-> f16 (fp16 compute copies, f16 GEMM operands) through F16C, 8 at a
  // time: round to nearest even, overflow to inf, the same as float_to_f16.
  if (from == DType::f32 && to == DType::f16) {
    const auto* in = static_cast<const float*>(src);
    auto* out = static_cast<f16*>(dst);
#pragma omp parallel for schedule(static) if (n > (1u << 16))
    for (int64_t i0 = 0; i0 < count; i0 += 1024) {
      const int64_t i1 = std::min<int64_t>(count, i0 + 1024);
      int64_t i = i0;
      for (; i + 8 <= i1; i += 8) {
        const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), h);
      }
      for (; i < i1; ++i) out[i] = float_to_f16(in[i]);
    }
    return;
  }
  if (from == DType::f16 && to == DType::f32) {
    const auto* in = static_cast<const f16*>(src);
    auto* out = static_cast<float*>(dst);
#pragma omp parallel for schedule(static) if (n > (1u << 16))
    for (int64_t i0 = 0; i0 < count; i0 += 1024) {
      const int64_t i1 = std::min<int64_t>(count, i0 + 1024);
      int64_t i = i0;
      for (; i + 8 <= i1; i += 8) {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i));
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(h));
      }
      for (; i < i1; ++i) out[i] = f16_to_float(in[i]);
    }
    return;
  }
#endif
#pragma omp parallel for schedule(static) if (n > (1u << 16))
  for (size_t i = 0; i < n; ++i) store(to, dst, i, load(from, src, i));
}

}  // namespace meshtrain
