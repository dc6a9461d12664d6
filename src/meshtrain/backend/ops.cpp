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

}  // namespace meshtrain::ops
