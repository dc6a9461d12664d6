#include "meshtrain/util/rng.h"

#include <cmath>

namespace meshtrain {

uint64_t stream_key(uint64_t seed, std::string_view purpose) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : purpose) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return mix64(h ^ mix64(seed));
}

float normal_at(uint64_t key, uint64_t index) {
  uint64_t bits = mix64(key ^ mix64(index));
  // u1 in (0, 1], u2 in [0, 1)
  double u1 = (static_cast<double>(bits >> 32) + 1.0) * (1.0 / 4294967296.0);
  double u2 = static_cast<double>(bits & 0xffffffffull) * (1.0 / 4294967296.0);
  return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
}

}  // namespace meshtrain
