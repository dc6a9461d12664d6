#include "meshtrain/backend/cpu/quant.h"

#include <cstring>

#include "meshtrain/backend/cpu/simd.h"
#include "meshtrain/tensor/nf4.h"

namespace meshtrain::cpu {
namespace {

// One block's 64 values: NF4[q] * absmax in f32 (the products nf4::dequantize
// forms), stored as T.
template <typename T>
void dequantize_block(const uint8_t* pairs, float absmax, const float* levels, T* out) {
#if defined(MESHTRAIN_AVX512)
  // The 16 levels are one register: each nibble selects a lane. 16 bytes give
  // 16 high and 16 low nibbles, interleaved back into element order.
  const __m512 table = _mm512_loadu_ps(levels);
  const __m512 scale = _mm512_set1_ps(absmax);
  const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i second =
      _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  for (int64_t half = 0; half < 2; ++half) {
    const __m512i bytes = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(pairs + 16 * half)));
    const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
    const __m512 lo = _mm512_permutexvar_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(0xF)), table);
    simd::store_ps(out + 32 * half, _mm512_mul_ps(_mm512_permutex2var_ps(hi, first, lo), scale));
    simd::store_ps(out + 32 * half + 16,
                   _mm512_mul_ps(_mm512_permutex2var_ps(hi, second, lo), scale));
  }
#else
  float values[nf4::kBlock];
  for (int64_t i = 0; i < nf4::kBlock / 2; ++i) {
    values[2 * i] = levels[pairs[i] >> 4] * absmax;
    values[2 * i + 1] = levels[pairs[i] & 0xF] * absmax;
  }
  simd::store_row(out, values, nf4::kBlock);
#endif
}

}  // namespace

// Block by block, in parallel: the block's absmax (from its second-level
// code, or stored in a slice), then its 64 values.
void dequantize_nf4(const uint8_t* packed, int64_t n, DType to, void* y, nf4::Form form) {
  const nf4::Layout l = nf4::layout(n, form);
  const std::span<const uint8_t> bytes(packed, static_cast<size_t>(l.bytes));
  const float* levels = nf4::levels().data();
  const uint8_t* pairs = packed + l.packed_at;
  simd::dispatch_store(to, y, [&](auto* out) {
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < l.blocks; ++b) {
      dequantize_block(pairs + b * nf4::kBlock / 2, nf4::block_absmax(bytes, l, b), levels,
                       out + b * nf4::kBlock);
    }
  });
}

}  // namespace meshtrain::cpu
