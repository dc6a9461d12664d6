// Counter-based random numbers: a value depends only on (key, index), never on
// call order, thread or rank. This is what makes initialisation independent of
// the parallel layout (see docs/ARCHITECTURE.md, invariant 1).
#pragma once

#include <cstdint>
#include <string_view>

namespace meshtrain {

// SplitMix64 finaliser: a strong 64-bit mix.
inline uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// FNV-1a of a string, then mixed with the seed: the key of a named stream.
uint64_t stream_key(uint64_t seed, std::string_view purpose);

// Uniform in [0, 1) with 24 random bits, element `index` of stream `key`.
inline float uniform_at(uint64_t key, uint64_t index) {
  return static_cast<float>(mix64(key ^ mix64(index)) >> 40) * (1.0f / 16777216.0f);
}

// Standard normal, element `index` of stream `key` (Box-Muller on two 32-bit halves).
float normal_at(uint64_t key, uint64_t index);

}  // namespace meshtrain
