#include "meshtrain/backend/ops.h"

#include <cmath>

#include "meshtrain/util/error.h"

namespace meshtrain::ops {

std::vector<float> rope_inv_freq(int64_t head_dim, float theta) {
  MESHTRAIN_CHECK(head_dim > 0 && head_dim % 2 == 0, "rope: head_dim {} must be even", head_dim);
  std::vector<float> inv_freq(static_cast<size_t>(head_dim / 2));
  for (size_t i = 0; i < inv_freq.size(); ++i) {
    inv_freq[i] = 1.0f / std::pow(theta, static_cast<float>(2 * i) / static_cast<float>(head_dim));
  }
  return inv_freq;
}

void rope_table_values(int64_t head_dim, int64_t max_seq, std::span<const float> inv_freq,
                       float* cos, float* sin) {
  MESHTRAIN_CHECK(head_dim > 0 && head_dim % 2 == 0, "rope: head_dim {} must be even", head_dim);
  MESHTRAIN_CHECK(max_seq > 0, "rope: max_seq {} must be positive", max_seq);
  const int64_t half = head_dim / 2;
  MESHTRAIN_CHECK(static_cast<int64_t>(inv_freq.size()) == half,
                  "rope: {} frequencies for head_dim {}", inv_freq.size(), head_dim);
  for (int64_t i = 0; i < half; ++i) {
    const float freq = inv_freq[static_cast<size_t>(i)];
    for (int64_t p = 0; p < max_seq; ++p) {
      const float angle = static_cast<float>(p) * freq;
      cos[p * half + i] = std::cos(angle);
      sin[p * half + i] = std::sin(angle);
    }
  }
}

}  // namespace meshtrain::ops
