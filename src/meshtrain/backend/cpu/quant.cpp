#include "meshtrain/backend/cpu/quant.h"

#include <cstring>

#include "meshtrain/backend/cpu/simd.h"
#include "meshtrain/tensor/nf4.h"

namespace meshtrain::cpu {

// Block by block, in parallel: the block's absmax from its second-level code,
// its 64 values in f32 (the same products as nf4::dequantize), stored as `to`.
void dequantize_nf4(const uint8_t* packed, int64_t n, DType to, void* y) {
  const nf4::Layout l = nf4::layout(n);
  const float* levels = nf4::levels().data();
  const float* map = nf4::dynamic_map().data();
  float offset = 0.0f;
  std::memcpy(&offset, packed + l.offset_at, 4);
  const uint8_t* codes = packed + l.codes_at;
  const uint8_t* pairs = packed + l.packed_at;
  simd::dispatch_store(to, y, [&](auto* out) {
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < l.blocks; ++b) {
      float s = 0.0f;
      std::memcpy(&s, packed + l.scales_at + 4 * (b / nf4::kScaleBlock), 4);
      const float absmax = map[codes[b]] * s + offset;
      float values[nf4::kBlock];
      const uint8_t* in = pairs + b * nf4::kBlock / 2;
      for (int64_t i = 0; i < nf4::kBlock / 2; ++i) {
        values[2 * i] = levels[in[i] >> 4] * absmax;
        values[2 * i + 1] = levels[in[i] & 0xF] * absmax;
      }
      simd::store_row(out + b * nf4::kBlock, values, nf4::kBlock);
    }
  });
}

}  // namespace meshtrain::cpu
