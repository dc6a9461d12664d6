#include "meshtrain/tensor/dtype.h"

#include <vector>

#include "meshtrain/util/error.h"

namespace meshtrain {

size_t dtype_size(DType dtype) { return dtype == DType::f32 ? 4 : 2; }

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::f32: return "f32";
    case DType::bf16: return "bf16";
    case DType::f16: return "f16";
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
  }
  return 0.0f;
}

void store(DType dtype, void* dst, size_t i, float value) {
  switch (dtype) {
    case DType::f32: static_cast<float*>(dst)[i] = value; break;
    case DType::bf16: static_cast<bf16*>(dst)[i] = float_to_bf16(value); break;
    case DType::f16: static_cast<f16*>(dst)[i] = float_to_f16(value); break;
  }
}

}  // namespace

void convert(DType from, const void* src, DType to, void* dst, size_t n) {
  if (from == to) {
    std::memcpy(dst, src, n * dtype_size(from));
    return;
  }
#pragma omp parallel for schedule(static) if (n > (1u << 16))
  for (size_t i = 0; i < n; ++i) store(to, dst, i, load(from, src, i));
}

}  // namespace meshtrain
