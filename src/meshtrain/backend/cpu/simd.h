// Internal to the CPU backend: vector exp and dtype load/store helpers shared
// by the elementwise kernels. AVX-512 where the compiler targets it, scalar
// otherwise; both round bf16 exactly like float_to_bf16 and f16 exactly like
// float_to_f16 (round to nearest even, overflow to inf).
#pragma once

#include <cmath>
#include <algorithm>
#include <cstdint>

#include "meshtrain/tensor/dtype.h"
#include "meshtrain/util/error.h"

#if defined(__AVX512F__)
// GCC 12's AVX-512 intrinsics self-initialise "undefined" vectors, which
// -Wmaybe-uninitialized reports inside the header once inlined, where its
// system-header status no longer hides it; the pragma covers only its lines.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#define MESHTRAIN_AVX512 1
#endif

namespace meshtrain::cpu::simd {

#if defined(MESHTRAIN_AVX512)
inline constexpr int64_t kLanes = 16;

// exp(x) for float lanes: Cephes polynomial on r = x - n ln2, scaled by 2^n
// (about 1 ulp; underflows to 0 and overflows to inf like expf).
inline __m512 exp_ps(__m512 x) {
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  const __m512 ln2_hi = _mm512_set1_ps(0.693359375f);
  const __m512 ln2_lo = _mm512_set1_ps(-2.12194440e-4f);
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.7f)), _mm512_set1_ps(-104.0f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, ln2_hi, x);
  r = _mm512_fnmadd_ps(n, ln2_lo, r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  __m512 r2 = _mm512_mul_ps(r, r);
  p = _mm512_fmadd_ps(p, r2, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

inline __m512 load_ps(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_ps(const bf16* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load_ps(const f16* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load_ps_masked(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }

inline void store_ps(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
// Round to nearest even, quiet NaN: bit-identical to float_to_bf16.
inline __m256i to_bf16(__m512 v) {
  __m512i u = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(r);
}
inline void store_ps(bf16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(v));
}
inline void store_ps(f16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#endif

inline float exp_scalar(float x) { return std::exp(x); }

inline float load1(const float* p) { return *p; }
inline float load1(const bf16* p) { return bf16_to_float(*p); }
inline float load1(const f16* p) { return f16_to_float(*p); }
inline void store1(float* p, float v) { *p = v; }
inline void store1(bf16* p, float v) { *p = float_to_bf16(v); }
inline void store1(f16* p, float v) { *p = float_to_f16(v); }

// dst[i] = src[i] for n elements, converting S -> D (f32 <-> bf16 / f16 or a copy).
template <typename D, typename S>
inline void convert_row(D* dst, const S* src, int64_t n) {
  int64_t i = 0;
#if defined(MESHTRAIN_AVX512)
  for (; i + kLanes <= n; i += kLanes) store_ps(dst + i, load_ps(src + i));
#endif
  for (; i < n; ++i) store1(dst + i, load1(src + i));
}

// dst[i] = src[i] * scale (f32 product, then rounded to T); dst may alias src.
template <typename T>
inline void scale_row(T* dst, const float* src, float scale, int64_t n) {
  int64_t i = 0;
#if defined(MESHTRAIN_AVX512)
  const __m512 s = _mm512_set1_ps(scale);
  for (; i + kLanes <= n; i += kLanes) store_ps(dst + i, _mm512_mul_ps(load_ps(src + i), s));
#endif
  for (; i < n; ++i) store1(dst + i, src[i] * scale);
}

// f32 -> T and T -> f32.
template <typename T>
inline void store_row(T* dst, const float* src, int64_t n) { convert_row(dst, src, n); }
template <typename T>
inline void load_row(float* dst, const T* src, int64_t n) { convert_row(dst, src, n); }

// In place x[i] = exp(x[i] - shift); returns the sum of the results.
inline float exp_shift_sum(float* x, int64_t n, float shift) {
  int64_t i = 0;
  float sum = 0.0f;
#if defined(MESHTRAIN_AVX512)
  __m512 acc = _mm512_setzero_ps();
  const __m512 s = _mm512_set1_ps(shift);
  for (; i + kLanes <= n; i += kLanes) {
    __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i), s));
    _mm512_storeu_ps(x + i, e);
    acc = _mm512_add_ps(acc, e);
  }
  if (i < n) {
    __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1u);
    __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + i), s));
    _mm512_mask_storeu_ps(x + i, m, e);
    acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(m, e));
    i = n;
  }
  sum = _mm512_reduce_add_ps(acc);
#endif
  for (; i < n; ++i) {
    x[i] = exp_scalar(x[i] - shift);
    sum += x[i];
  }
  return sum;
}

// In place x[i] = exp(x[i]).
inline void exp_inplace(float* x, int64_t n) {
  int64_t i = 0;
#if defined(MESHTRAIN_AVX512)
  for (; i + kLanes <= n; i += kLanes) _mm512_storeu_ps(x + i, exp_ps(_mm512_loadu_ps(x + i)));
  if (i < n) {
    __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1u);
    _mm512_mask_storeu_ps(x + i, m, exp_ps(_mm512_maskz_loadu_ps(m, x + i)));
    i = n;
  }
#endif
  for (; i < n; ++i) x[i] = exp_scalar(x[i]);
}

// The largest of x[0, n), NaNs skipped; -inf when n is 0. By hand: clang 14
// does not vectorize a float max reduction, even under omp simd.
inline float max_of(const float* x, int64_t n) {
#if defined(MESHTRAIN_AVX512)
  // max_ps returns its second operand when either is NaN: v never holds one.
  __m512 v = _mm512_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) v = _mm512_max_ps(_mm512_loadu_ps(x + i), v);
  if (i < n) {
    const auto m = static_cast<__mmask16>((1u << (n - i)) - 1u);
    v = _mm512_max_ps(_mm512_mask_loadu_ps(v, m, x + i), v);
  }
  return _mm512_reduce_max_ps(v);
#else
  float m = -INFINITY;
  for (int64_t i = 0; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
#endif
}

}  // namespace meshtrain::cpu::simd

#include <vector>

namespace meshtrain::cpu::simd {

// Rows per block of the deterministic row reductions below: the summation
// order depends only on the row count, never on the thread count.
inline constexpr int64_t kRowBlock = 32;

// For r in [0, rows): row_fn(r, acc) adds row r's contribution to acc[width]
// (and may do other per-row work). The totals are handed to out_fn(j, total)
// once each. Blocks of kRowBlock rows are summed in row order, then blocks in
// block order.
template <typename RowFn, typename OutFn>
void reduce_rows(int64_t rows, int64_t width, RowFn row_fn, OutFn out_fn) {
  const int64_t blocks = (rows + kRowBlock - 1) / kRowBlock;
  std::vector<float> partial(static_cast<size_t>(blocks * width), 0.0f);
#pragma omp parallel for schedule(static)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    float* acc = partial.data() + blk * width;
    const int64_t end = std::min(rows, (blk + 1) * kRowBlock);
    for (int64_t r = blk * kRowBlock; r < end; ++r) row_fn(r, acc);
  }
  constexpr int64_t kCols = 256;
#pragma omp parallel for schedule(static)
  for (int64_t j0 = 0; j0 < width; j0 += kCols) {
    const int64_t j1 = std::min(width, j0 + kCols);
    float total[kCols];
    for (int64_t j = j0; j < j1; ++j) total[j - j0] = 0.0f;
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const float* p = partial.data() + blk * width;
#pragma omp simd
      for (int64_t j = j0; j < j1; ++j) total[j - j0] += p[j];
    }
    for (int64_t j = j0; j < j1; ++j) out_fn(j, total[j - j0]);
  }
}

// Calls fn(typed pointer) with `out` cast to float*, bf16* or f16* by dtype
// (i32: Error).
template <typename Fn>
void dispatch_store(DType dtype, void* out, Fn fn) {
  switch (dtype) {
    case DType::bf16: fn(static_cast<bf16*>(out)); return;
    case DType::f16: fn(static_cast<f16*>(out)); return;
    case DType::f32: fn(static_cast<float*>(out)); return;
    case DType::i32: break;
  }
  fail("cpu kernel: output dtype {} is not a float type", dtype_name(dtype));
}

}  // namespace meshtrain::cpu::simd
