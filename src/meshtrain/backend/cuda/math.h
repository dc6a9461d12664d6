// The arithmetic of the CUDA kernels, one element or one row at a time, in
// functions that compile for the device and for the host: the kernels call
// them, and tests/cuda/test_cuda_math.cpp runs the same functions on the CPU
// against the CPU backend and float64 (no GPU needed). Each mirrors the CPU
// kernel's operation order (backend/cpu/), so the two backends differ by the
// device's exp / tanh and by summation order only.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "meshtrain/backend/host_device.h"

namespace meshtrain::cuda::math {

MESHTRAIN_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

MESHTRAIN_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

MESHTRAIN_HD float negative_infinity() { return bits_float(0xff800000u); }

// ---- 16-bit storage. bf16: round to nearest even, NaN kept quiet (as
// tensor/dtype.h's float_to_bf16 and PyTorch's c10::BFloat16).
MESHTRAIN_HD uint16_t bf16_from_float(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

MESHTRAIN_HD float bf16_to_float(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }

// IEEE half: round to nearest even with subnormals; overflow to infinity;
// NaN to a quiet NaN of the same sign.
MESHTRAIN_HD uint16_t f16_from_float(float f) {
  const uint32_t u = float_bits(f);
  const auto sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t mag = u & 0x7fffffffu;
  if (mag > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);
  if (mag >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // 65520 and up: inf
  if (mag >= 0x38800000u) {  // a normal half (>= 2^-14): rebias, drop 13 bits to nearest even
    uint32_t r = mag - 0x38000000u;
    r += 0xfffu + ((r >> 13) & 1u);
    return static_cast<uint16_t>(sign | (r >> 13));
  }
  if (mag < 0x33000000u) return sign;  // below 2^-25: zero (2^-25 itself ties to even, 0)
  // A subnormal half: m units of 2^-24, m = significand >> (126 - exponent), rounded.
  const uint32_t exponent = mag >> 23;
  const uint32_t significand = (mag & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126u - exponent;
  const uint32_t half_unit = 1u << (shift - 1);
  const uint32_t rest = significand & ((1u << shift) - 1u);
  uint32_t m = significand >> shift;
  if (rest > half_unit || (rest == half_unit && (m & 1u) != 0)) ++m;
  return static_cast<uint16_t>(sign | m);
}

MESHTRAIN_HD float f16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa units of 2^-24 (exact in f32)
    const float value = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign != 0 ? -value : value;
  }
  if (exponent == 31) return bits_float(sign | 0x7f800000u | (mantissa << 13));
  return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

// ---- activations (backend/cpu/activation.cpp)
MESHTRAIN_HD float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// GELU, tanh form: x * sigmoid(2u), u = c0 (x + c1 x^3).
inline constexpr float kGeluC0 = 0.7978845608028654f;  // sqrt(2 / pi)
inline constexpr float kGeluC1 = 0.044715f;

MESHTRAIN_HD float gelu(float x) {
  return sigmoid(2.0f * kGeluC0 * (x + kGeluC1 * x * x * x)) * x;
}

// d/dx [x sig(2u)] = sig + x sig (1 - sig) 2 du/dx, times dy.
MESHTRAIN_HD float gelu_backward(float x, float dy) {
  const float s = sigmoid(2.0f * kGeluC0 * (x + kGeluC1 * x * x * x));
  const float du = 2.0f * kGeluC0 * (1.0f + 3.0f * kGeluC1 * x * x);
  return dy * (s + x * s * (1.0f - s) * du);
}

// SwiGLU: silu(g) * u, and its two input gradients from d.
MESHTRAIN_HD float swiglu(float g, float u) { return g * sigmoid(g) * u; }

MESHTRAIN_HD void swiglu_backward(float g, float u, float d, float& dg, float& du) {
  const float s = sigmoid(g);
  dg = d * u * s * (1.0f + g * (1.0f - s));
  du = d * g * s;
}

// ---- RoPE: the pair (x0, x1) rotated by the angle whose cos / sin are c, s
// (inverse: by minus the angle, the gradient's rotation).
MESHTRAIN_HD void rope_rotate(float& x0, float& x1, float c, float s, bool inverse) {
  const float sn = inverse ? -s : s;
  const float a = x0, b = x1;
  x0 = a * c - b * sn;
  x1 = a * sn + b * c;
}

// ---- context parallelism (util/context_split.h's ContextSplit::global):
// the sequence index of local token i of `rank` in a group of `size` ranks,
// each holding two chunks of seq / (2 size) tokens, its own and its mirror's.
MESHTRAIN_HD int64_t context_global(int64_t seq, int64_t rank, int64_t size, int64_t i) {
  const int64_t c = seq / (2 * size), k = i / c;
  return (k == 0 ? rank : 2 * size - 1 - rank) * c + i % c;
}

// Ring attention's online softmax (backend/cpu/attention.cpp): a query's
// running max `m` before a block whose visible scores peak at `best` (not
// -inf) becomes `max`, and what was summed so far is scaled by `alpha`.
struct RingRescale {
  float max = 0, alpha = 0;
};
MESHTRAIN_HD RingRescale ring_rescale(float m, float best) {
  const float to = m > best ? m : best;
  return {to, expf(m - to)};
}

// ---- a row-parallel layer's output y (column j) joining the residual
// stream r: r + (y + bias[j]), or r + y without a bias (the CPU backend's
// residual_add_row).
MESHTRAIN_HD float residual_sum(float r, float y, const float* bias, int64_t j) {
  return bias != nullptr ? r + (y + bias[j]) : r + y;
}

// ---- norms: 1 / sqrt(mean of squares + eps) from the row's sum of squares
// (RMSNorm) or sum of squared deviations (LayerNorm).
MESHTRAIN_HD float inverse_rms(float sum_squares, int64_t n, float eps) {
  return 1.0f / sqrtf(sum_squares / static_cast<float>(n) + eps);
}

// ---- AdamW (backend/cpu/adamw.cpp, PyTorch 1.13's single-tensor order): the
// per-step scalars, computed once on the host in double, and one element's update.
struct AdamWStep {
  float step_size = 0, bc2_sqrt = 1, decay = 1;
  float b1 = 0, b2 = 0, one_b1 = 0, one_b2 = 0, eps = 0, scale = 1;
};

inline AdamWStep adamw_step(float lr, float beta1, float beta2, float eps, float weight_decay,
                            int64_t step, float grad_scale) {
  const double bc1 = 1.0 - std::pow(static_cast<double>(beta1), static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(static_cast<double>(beta2), static_cast<double>(step));
  AdamWStep a;
  a.step_size = static_cast<float>(static_cast<double>(lr) / bc1);
  a.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  a.decay = static_cast<float>(1.0 - static_cast<double>(lr) * weight_decay);
  a.b1 = beta1;
  a.b2 = beta2;
  a.one_b1 = static_cast<float>(1.0 - static_cast<double>(beta1));
  a.one_b2 = static_cast<float>(1.0 - static_cast<double>(beta2));
  a.eps = eps;
  a.scale = grad_scale;
  return a;
}

MESHTRAIN_HD void adamw_update(const AdamWStep& a, float& param, float grad, float& m, float& v) {
  const float g = grad * a.scale;
  const float p = param * a.decay;
  const float mi = m * a.b1 + g * a.one_b1;
  const float vi = v * a.b2 + a.one_b2 * g * g;
  m = mi;
  v = vi;
  param = p - a.step_size * (mi / (sqrtf(vi) / a.bc2_sqrt + a.eps));
}

// ---- softmax over a row seen in pieces (attention, the classifier): the
// running maximum and the sum of exp(x - max) over what was added.
struct SoftmaxSum {
  float max = negative_infinity();
  float sum = 0.0f;
  MESHTRAIN_HD void add(float x) {
    if (x == negative_infinity()) return;  // a masked entry: exp(-inf) = 0
    if (x > max) {
      sum = sum * expf(max - x) + 1.0f;
      max = x;
    } else {
      sum += expf(x - max);
    }
  }
  MESHTRAIN_HD void merge(const SoftmaxSum& o) {
    if (o.sum == 0.0f) return;
    if (sum == 0.0f) {
      *this = o;
      return;
    }
    if (o.max > max) {
      sum = sum * expf(max - o.max) + o.sum;
      max = o.max;
    } else {
      sum += o.sum * expf(o.max - max);
    }
  }
  MESHTRAIN_HD float log_sum_exp() const { return max + logf(sum); }
};

}  // namespace meshtrain::cuda::math
