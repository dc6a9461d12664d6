#include "meshtrain/backend/cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "meshtrain/backend/cpu/matmul.h"
#include "meshtrain/backend/cpu/onednn.h"
#include "meshtrain/backend/cpu/simd.h"
#include "meshtrain/util/error.h"

namespace meshtrain::cpu {

namespace {

// out = x rotated by the angles of one position; pairs (x[2i], x[2i+1]).
// inverse applies the transpose rotation. out may alias x.
inline void rotate(const float* cos, const float* sin, const float* x, float* out, int64_t half,
                   bool inverse) {
  const float sign = inverse ? -1.0f : 1.0f;
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float x0 = x[2 * i], x1 = x[2 * i + 1];
    const float c = cos[i], s = sign * sin[i];
    out[2 * i] = x0 * c - x1 * s;
    out[2 * i + 1] = x0 * s + x1 * c;
  }
}

void check_dims(const AttentionDims& d, const RopeTable* rope, int64_t positions) {
  MESHTRAIN_CHECK(d.batch > 0 && d.seq > 0 && d.n_heads > 0 && d.n_kv_heads > 0 && d.head_dim > 0,
                  "attention: bad dims batch={} seq={} heads={} kv_heads={} head_dim={}", d.batch,
                  d.seq, d.n_heads, d.n_kv_heads, d.head_dim);
  MESHTRAIN_CHECK(d.n_heads % d.n_kv_heads == 0, "attention: n_heads {} not a multiple of n_kv_heads {}",
                  d.n_heads, d.n_kv_heads);
  if (rope != nullptr) {
    MESHTRAIN_CHECK(rope->head_dim == d.head_dim, "attention: rope table head_dim {} != head_dim {}",
                    rope->head_dim, d.head_dim);
    MESHTRAIN_CHECK(positions <= rope->max_seq, "attention: position {} beyond the rope table ({})",
                    positions - 1, rope->max_seq);
  }
}

void ensure(Tensor& t, const Shape& shape, DType dtype, MemoryTracker& tracker) {
  if (t.defined() && t.shape() == shape && t.dtype() == dtype) return;
  t = Tensor();
  t = Tensor(shape, dtype, MemCategory::activations, tracker);
}

// Copies one head of D floats from src to dst (T = float or bf16), rotating
// it first when cos != nullptr.
template <typename T>
inline void put_head(const float* src, T* dst, const float* cos, const float* sin, int64_t D,
                     bool inverse, float* tmp) {
  if (cos != nullptr) {
    rotate(cos, sin, src, tmp, D / 2, inverse);
    src = tmp;
  }
  simd::store_row(dst, src, D);
}

// Causal softmax of one row of scores (length n = t + 1 used, T total):
// probs[0..n) = softmax, probs[n..T) = 0.
template <typename T>
inline void softmax_row(float* scores, T* probs, int64_t n, int64_t T_total) {
  const float mx = simd::max_of(scores, n);
  const float inv = 1.0f / simd::exp_shift_sum(scores, n, mx);
#pragma omp simd
  for (int64_t s = 0; s < n; ++s) scores[s] *= inv;
  simd::store_row(probs, scores, n);
  std::memset(static_cast<void*>(probs + n), 0, static_cast<size_t>(T_total - n) * sizeof(T));
}

}  // namespace

RopeTable make_rope_table(int64_t head_dim, int64_t max_seq, float theta, MemoryTracker& tracker) {
  MESHTRAIN_CHECK(head_dim > 0 && head_dim % 2 == 0, "rope: head_dim {} must be even", head_dim);
  MESHTRAIN_CHECK(max_seq > 0, "rope: max_seq {} must be positive", max_seq);
  const int64_t half = head_dim / 2;
  RopeTable table;
  table.head_dim = head_dim;
  table.max_seq = max_seq;
  table.cos = Tensor({max_seq, half}, DType::f32, MemCategory::workspace, tracker);
  table.sin = Tensor({max_seq, half}, DType::f32, MemCategory::workspace, tracker);
  float* c = table.cos.data<float>();
  float* s = table.sin.data<float>();
  // In float, in the order of Meta's precompute_freqs_cis, so angles match PyTorch's.
  for (int64_t i = 0; i < half; ++i) {
    const float freq =
        1.0f / std::pow(theta, static_cast<float>(2 * i) / static_cast<float>(head_dim));
    for (int64_t p = 0; p < max_seq; ++p) {
      const float angle = static_cast<float>(p) * freq;
      c[p * half + i] = std::cos(angle);
      s[p * half + i] = std::sin(angle);
    }
  }
  return table;
}

void rope_apply(const RopeTable& rope, float* x, int64_t rows, int64_t seq, int64_t n_heads,
                int64_t head_dim, int64_t pos0, bool inverse) {
  MESHTRAIN_CHECK(rope.head_dim == head_dim, "rope: table head_dim {} != {}", rope.head_dim, head_dim);
  MESHTRAIN_CHECK(pos0 + std::min(rows, seq) <= rope.max_seq, "rope: positions up to {} beyond table ({})",
                  pos0 + std::min(rows, seq) - 1, rope.max_seq);
  const int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t pos = pos0 + r % seq;
    const float* c = rope.cos.data<float>() + pos * half;
    const float* s = rope.sin.data<float>() + pos * half;
    for (int64_t h = 0; h < n_heads; ++h) {
      float* xh = x + (r * n_heads + h) * head_dim;
      rotate(c, s, xh, xh, half, inverse);
    }
  }
}

void attention_forward(CpuContext& ctx, const AttentionDims& dims, const RopeTable* rope,
                       DType compute, const float* qkv, void* out, AttentionSaved& saved) {
  check_dims(dims, rope, dims.seq);
  const int64_t B = dims.batch, T = dims.seq, H = dims.n_heads, KV = dims.n_kv_heads;
  const int64_t D = dims.head_dim, rep = H / KV, W = dims.qkv_width(), half = D / 2;
  MemoryTracker& tracker = ctx.tracker();
  ensure(saved.q, {B, H, T, D}, compute, tracker);
  ensure(saved.k, {B, KV, T, D}, compute, tracker);
  ensure(saved.v, {B, KV, T, D}, compute, tracker);
  ensure(saved.probs, {B, H, T, T}, compute, tracker);
  const size_t esize = dtype_size(compute);

  simd::dispatch_store(compute, saved.q.raw(), [&](auto* q) {
    using E = std::remove_pointer_t<decltype(q)>;
    E* k = saved.k.data<E>();
    E* v = saved.v.data<E>();
    // 1. Split heads into [B, heads, T, D] layouts, rotating q and k.
#pragma omp parallel
    {
      std::vector<float> tmp(static_cast<size_t>(D));
#pragma omp for schedule(static)
      for (int64_t bt = 0; bt < B * T; ++bt) {
        const int64_t b = bt / T, t = bt % T;
        const float* row = qkv + bt * W;
        const float* c = rope ? rope->cos.data<float>() + t * half : nullptr;
        const float* s = rope ? rope->sin.data<float>() + t * half : nullptr;
        for (int64_t h = 0; h < H; ++h)
          put_head(row + h * D, q + ((b * H + h) * T + t) * D, c, s, D, false, tmp.data());
        for (int64_t j = 0; j < KV; ++j) {
          put_head(row + (H + j) * D, k + ((b * KV + j) * T + t) * D, c, s, D, false, tmp.data());
          put_head(row + (H + KV + j) * D, v + ((b * KV + j) * T + t) * D, nullptr, nullptr, D, false,
                   tmp.data());
        }
      }
    }
    // 2. scores = q k^T / sqrt(D): one batched GEMM per kv group, the group's
    //    query heads stacked as rows ([rep*T, D] against [T, D]).
    E* probs = saved.probs.data<E>();
    float* scores = compute == DType::f32
                        ? reinterpret_cast<float*>(probs)
                        : static_cast<float*>(ctx.impl().scratch(Scratch::attn_a, B * H * T * T * 4));
    MatmulDims qk{B * KV, rep * T, T, D, false, true, false};
    matmul(ctx, qk, compute, q, k, DType::f32, scores, 1.0f / std::sqrt(static_cast<float>(D)));
    // 3. Causal softmax, only over each row's first t + 1 entries.
#pragma omp parallel for schedule(static)
    for (int64_t row = 0; row < B * H * T; ++row) {
      const int64_t t = row % T;
      softmax_row(scores + row * T, probs + row * T, t + 1, T);
    }
    // 4. out_heads = P v, then back to [B, T, H*D].
    E* out_heads = static_cast<E*>(ctx.impl().scratch(Scratch::attn_b, B * H * T * D * esize));
    MatmulDims pv{B * KV, rep * T, D, T, false, false, false};
    matmul(ctx, pv, compute, probs, v, compute, out_heads);
    E* o = static_cast<E*>(out);
#pragma omp parallel for schedule(static)
    for (int64_t bt = 0; bt < B * T; ++bt) {
      const int64_t b = bt / T, t = bt % T;
      for (int64_t h = 0; h < H; ++h)
        std::memcpy(static_cast<void*>(o + (bt * H + h) * D),
                    static_cast<const void*>(out_heads + ((b * H + h) * T + t) * D), D * esize);
    }
  });
}

void attention_backward(CpuContext& ctx, const AttentionDims& dims, const RopeTable* rope,
                        DType compute, const AttentionSaved& saved, const float* d_out, void* d_qkv) {
  check_dims(dims, rope, dims.seq);
  const int64_t B = dims.batch, T = dims.seq, H = dims.n_heads, KV = dims.n_kv_heads;
  const int64_t D = dims.head_dim, rep = H / KV, W = dims.qkv_width(), half = D / 2;
  MESHTRAIN_CHECK(saved.probs.defined() && saved.probs.dtype() == compute &&
                      saved.probs.numel() == B * H * T * T,
                  "attention_backward: saved tensors do not match dims/compute dtype");
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const size_t esize = dtype_size(compute);
  auto& impl = ctx.impl();

  simd::dispatch_store(compute, d_qkv, [&](auto* dqkv) {
    using E = std::remove_pointer_t<decltype(dqkv)>;
    const E* q = saved.q.data<E>();
    const E* k = saved.k.data<E>();
    const E* v = saved.v.data<E>();
    const E* probs = saved.probs.data<E>();
    // 1. d_out to [B, H, T, D] in the compute dtype.
    E* dout_h = static_cast<E*>(impl.scratch(Scratch::attn_a, B * H * T * D * esize));
#pragma omp parallel for schedule(static)
    for (int64_t bt = 0; bt < B * T; ++bt) {
      const int64_t b = bt / T, t = bt % T;
      for (int64_t h = 0; h < H; ++h)
        simd::store_row(dout_h + ((b * H + h) * T + t) * D, d_out + (bt * H + h) * D, D);
    }
    // 2. dP = dO v^T, then dS = P (dP - sum(P dP)) * scale over the causal part.
    float* dp = static_cast<float*>(impl.scratch(Scratch::attn_b, B * H * T * T * 4));
    MatmulDims dov{B * KV, rep * T, T, D, false, true, false};
    matmul(ctx, dov, compute, dout_h, v, DType::f32, dp);
    E* ds = compute == DType::f32 ? reinterpret_cast<E*>(dp)
                                  : static_cast<E*>(impl.scratch(Scratch::attn_c, B * H * T * T * esize));
#pragma omp parallel
    {
      std::vector<float> p(static_cast<size_t>(T));
#pragma omp for schedule(static)
      for (int64_t row = 0; row < B * H * T; ++row) {
        const int64_t n = row % T + 1;
        float* dpr = dp + row * T;
        simd::load_row(p.data(), probs + row * T, n);
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t s = 0; s < n; ++s) dot += p[s] * dpr[s];
#pragma omp simd
        for (int64_t s = 0; s < n; ++s) dpr[s] = p[s] * (dpr[s] - dot) * scale;
        E* dsr = ds + row * T;
        simd::store_row(dsr, dpr, n);
        std::memset(static_cast<void*>(dsr + n), 0, static_cast<size_t>(T - n) * esize);
      }
    }
    // 3. dQ = dS k; dK = dS^T q and dV = P^T dO, each summed over the kv group.
    float* dq = static_cast<float*>(impl.scratch(Scratch::attn_d, B * H * T * D * 4));
    float* dk = static_cast<float*>(impl.scratch(Scratch::attn_e, 2 * B * KV * T * D * 4));
    float* dv = dk + B * KV * T * D;
    matmul(ctx, {B * KV, rep * T, D, T, false, false, false}, compute, ds, k, DType::f32, dq);
    matmul(ctx, {B * KV, T, D, rep * T, true, false, false}, compute, ds, q, DType::f32, dk);
    matmul(ctx, {B * KV, T, D, rep * T, true, false, false}, compute, probs, dout_h, DType::f32, dv);
    // 4. Back to [B, T, (H + 2KV) * D], undoing the rotation.
#pragma omp parallel
    {
      std::vector<float> tmp(static_cast<size_t>(D));
#pragma omp for schedule(static)
      for (int64_t bt = 0; bt < B * T; ++bt) {
        const int64_t b = bt / T, t = bt % T;
        E* row = dqkv + bt * W;
        const float* c = rope ? rope->cos.data<float>() + t * half : nullptr;
        const float* s = rope ? rope->sin.data<float>() + t * half : nullptr;
        for (int64_t h = 0; h < H; ++h)
          put_head(dq + ((b * H + h) * T + t) * D, row + h * D, c, s, D, true, tmp.data());
        for (int64_t j = 0; j < KV; ++j) {
          const int64_t src = ((b * KV + j) * T + t) * D;
          put_head(dk + src, row + (H + j) * D, c, s, D, true, tmp.data());
          put_head(dv + src, row + (H + KV + j) * D, nullptr, nullptr, D, true, tmp.data());
        }
      }
    }
  });
}

void attention_decode(CpuContext& ctx, const AttentionDims& dims, const RopeTable* rope,
                      const float* qkv, int64_t pos0, KVCacheLayer& cache, float* out) {
  const int64_t B = dims.batch, T = dims.seq, H = dims.n_heads, KV = dims.n_kv_heads;
  const int64_t D = dims.head_dim, rep = H / KV, W = dims.qkv_width(), half = D / 2;
  check_dims(dims, rope, pos0 + T);
  MESHTRAIN_CHECK(cache.k.defined() && cache.k.rank() == 4 && cache.k.dim(0) == B &&
                      cache.k.dim(1) == KV && cache.k.dim(3) == D,
                  "attention_decode: cache shape {} does not match batch {} kv_heads {} head_dim {}",
                  shape_str(cache.k.shape()), B, KV, D);
  const int64_t S = cache.k.dim(2);
  MESHTRAIN_CHECK(pos0 >= 0 && pos0 + T <= S, "attention_decode: positions [{}, {}) exceed cache ({})",
                  pos0, pos0 + T, S);
  float* kc = cache.k.data<float>();
  float* vc = cache.v.data<float>();
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  // Append the new positions' k (rotated) and v.
#pragma omp parallel for schedule(static)
  for (int64_t bt = 0; bt < B * T; ++bt) {
    const int64_t b = bt / T, pos = pos0 + bt % T;
    const float* row = qkv + bt * W;
    for (int64_t j = 0; j < KV; ++j) {
      float* kd = kc + ((b * KV + j) * S + pos) * D;
      if (rope != nullptr) {
        rotate(rope->cos.data<float>() + pos * half, rope->sin.data<float>() + pos * half,
               row + (H + j) * D, kd, half, false);
      } else {
        std::memcpy(kd, row + (H + j) * D, static_cast<size_t>(D) * sizeof(float));
      }
      std::memcpy(vc + ((b * KV + j) * S + pos) * D, row + (H + KV + j) * D,
                  static_cast<size_t>(D) * sizeof(float));
    }
  }
  // Each query attends over [0, pos].
#pragma omp parallel
  {
    std::vector<float> qr(static_cast<size_t>(D)), sc(static_cast<size_t>(pos0 + T));
#pragma omp for schedule(static) collapse(2)
    for (int64_t bt = 0; bt < B * T; ++bt) {
      for (int64_t h = 0; h < H; ++h) {
        const int64_t b = bt / T, pos = pos0 + bt % T, j = h / rep;
        const float* qsrc = qkv + bt * W + h * D;
        if (rope != nullptr) {
          rotate(rope->cos.data<float>() + pos * half, rope->sin.data<float>() + pos * half, qsrc,
                 qr.data(), half, false);
        } else {
          std::memcpy(qr.data(), qsrc, static_cast<size_t>(D) * sizeof(float));
        }
        const float* kh = kc + (b * KV + j) * S * D;
        const float* vh = vc + (b * KV + j) * S * D;
        for (int64_t s = 0; s <= pos; ++s) {
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += qr[d] * kh[s * D + d];
          sc[s] = dot * scale;
        }
        const float mx = simd::max_of(sc.data(), pos + 1);
        const float inv = 1.0f / simd::exp_shift_sum(sc.data(), pos + 1, mx);
        float* o = out + bt * H * D + h * D;
        std::fill(o, o + D, 0.0f);
        for (int64_t s = 0; s <= pos; ++s) {
          const float p = sc[s] * inv;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) o[d] += p * vh[s * D + d];
        }
      }
    }
  }
}

}  // namespace meshtrain::cpu
