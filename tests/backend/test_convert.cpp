// convert()'s vectorised f32 <-> bf16 loops must agree bit for bit with the
// scalar float_to_bf16 / bf16_to_float (rounding ties, NaN, inf, denormals),
// threaded (large n) or not.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

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

}  // namespace
}  // namespace meshtrain::testing
