// convert()'s vectorised f32 <-> bf16 loops must agree bit for bit with the
// scalar float_to_bf16 / bf16_to_float (rounding ties, NaN, inf, denormals),
// threaded (large n) or not; likewise f32 <-> f16.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "meshtrain/backend/cpu/simd.h"
#include "meshtrain/tensor/dtype.h"
#include "reference.h"

namespace meshtrain::testing {
namespace {

std::vector<float> special_values() {
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> v = {0.0f, -0.0f, 1.0f, -1.0f, inf, -inf, std::nanf(""), -std::nanf(""),
                          1.0f + std::ldexp(1.0f, -8), 1.0f + 3 * std::ldexp(1.0f, -8),
                          std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::max(),
                          -std::numeric_limits<float>::max(), 3.3895314e38f};
  // A signalling NaN pattern too (the quiet bit must be set in the result).
  uint32_t snan = 0x7f800001u;
  float f;
  std::memcpy(&f, &snan, sizeof f);
  v.push_back(f);
  return v;
}

TEST(Convert, F32ToBf16MatchesScalarRounding) {
  for (size_t n : {size_t{15}, size_t{17}, size_t{100003}}) {  // tails; threaded (> 65536)
    std::vector<float> src = random_floats(n, 7, -1e4f, 1e4f);
    std::vector<float> special = special_values();
    std::copy(special.begin(), special.end(), src.begin());
    std::vector<bf16> out(n);
    convert(DType::f32, src.data(), DType::bf16, out.data(), n);
    for (size_t i = 0; i < n; ++i)
      ASSERT_EQ(out[i].bits, float_to_bf16(src[i]).bits) << "i=" << i << " x=" << src[i];
  }
}

TEST(Convert, Bf16ToF32IsExact) {
  const size_t n = 100003;
  std::vector<bf16> src(n);
  for (size_t i = 0; i < n; ++i) src[i].bits = static_cast<uint16_t>(i * 40503u);
  std::vector<float> out(n);
  convert(DType::bf16, src.data(), DType::f32, out.data(), n);
  for (size_t i = 0; i < n; ++i) {
    const float want = bf16_to_float(src[i]);
    ASSERT_EQ(std::memcmp(&out[i], &want, sizeof want), 0) << "i=" << i;
  }
}

bool same_f16(f16 a, f16 b) {
  const bool nan_a = (a.bits & 0x7fffu) > 0x7c00u, nan_b = (b.bits & 0x7fffu) > 0x7c00u;
  return nan_a || nan_b ? nan_a == nan_b : a.bits == b.bits;
}

// f16 (fp16 compute copies): convert()'s F16C loop and the kernels' AVX-512
// store round like float_to_f16 (nearest even, overflow past 65504 to inf,
// f16 denormals); NaN stays NaN.
TEST(Convert, F32ToF16MatchesScalarRounding) {
  for (size_t n : {size_t{23}, size_t{25}, size_t{100003}}) {  // tails; threaded (> 65536)
    std::vector<float> src = random_floats(n, 9, -7e4f, 7e4f);
    std::vector<float> special = special_values();
    for (float x : {65504.0f, 65519.0f, 65520.0f, 1e-7f, -3e-5f, 1.0f + std::ldexp(1.0f, -11)})
      special.push_back(x);
    ASSERT_LE(special.size(), n);
    std::copy(special.begin(), special.end(), src.begin());
    std::vector<f16> out(n), kernel(n);
    convert(DType::f32, src.data(), DType::f16, out.data(), n);
    cpu::simd::convert_row(kernel.data(), src.data(), static_cast<int64_t>(n));
    for (size_t i = 0; i < n; ++i) {
      ASSERT_TRUE(same_f16(out[i], float_to_f16(src[i]))) << "i=" << i << " x=" << src[i];
      ASSERT_TRUE(same_f16(kernel[i], float_to_f16(src[i]))) << "kernel i=" << i << " x=" << src[i];
    }
  }
  EXPECT_EQ(f16_to_float(float_to_f16(65519.0f)), 65504.0f);
  EXPECT_TRUE(std::isinf(f16_to_float(float_to_f16(65520.0f))));
}

TEST(Convert, F16ToF32IsExact) {
  const size_t n = 100003;
  std::vector<f16> src(n);
  for (size_t i = 0; i < n; ++i) src[i].bits = static_cast<uint16_t>(i * 40503u);
  std::vector<float> out(n), kernel(n);
  convert(DType::f16, src.data(), DType::f32, out.data(), n);
  cpu::simd::convert_row(kernel.data(), src.data(), static_cast<int64_t>(n));
  for (size_t i = 0; i < n; ++i) {
    const float want = f16_to_float(src[i]);
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(out[i]) && std::isnan(kernel[i])) << "i=" << i;
      continue;
    }
    ASSERT_EQ(std::memcmp(&out[i], &want, sizeof want), 0) << "i=" << i;
    ASSERT_EQ(std::memcmp(&kernel[i], &want, sizeof want), 0) << "kernel i=" << i;
  }
}

}  // namespace
}  // namespace meshtrain::testing
