// Causal grouped-query attention, one block per (query, head, row): the
// reference kernel of the CUDA backend (and the path for what a cuDNN graph
// cannot express: record positions of packed rows), for the whole sequence's
// queries or one context-parallel rank's (AttentionShape); ring attention's
// blocks and decoding over a KV cache. Probabilities are rounded to the
// compute dtype before P·V and dS before its products, as the CPU backend
// stores them (backend/cpu/attention.cpp).
#include <type_traits>

#include "meshtrain/backend/cuda/device.cuh"

namespace meshtrain::cuda {
namespace {

// The sequence index of local query i (its last key).
__device__ __forceinline__ int64_t query_index(const AttentionShape& a, int64_t i) {
  return a.cp_size > 1 ? math::context_global(a.seq, a.cp_rank, a.cp_size, i) : i;
}

// The first key local query i of row b sees.
__device__ __forceinline__ int64_t first_key(const AttentionShape& a, int64_t b, int64_t i) {
  const int64_t t = query_index(a, i);
  const int64_t pos = a.positions != nullptr ? a.positions[b * a.query_rows() + i] : t;
  int64_t first = t - pos;
  if (a.window > 0 && t - a.window + 1 > first) first = t - a.window + 1;
  return first;
}

// The probabilities of local query (b, h, i) over keys [0, T) into p (zero
// outside [first, its index]), each rounded to E; qrow [D] is shared scratch.
template <typename E>
__device__ void probability_row(const AttentionShape& a, const typename E::T* q,
                                const typename E::T* k, int64_t b, int64_t h, int64_t i,
                                float* p, float* qrow, float* scratch) {
  const int64_t T = a.seq, Q = a.query_rows(), D = a.head_dim, g = h / (a.heads / a.kv_heads);
  const int64_t first = first_key(a, b, i), t = query_index(a, i);
  const typename E::T* qr = q + ((b * a.heads + h) * Q + i) * D;
  const typename E::T* kg = k + (b * a.kv_heads + g) * T * D;
  for (int64_t d = threadIdx.x; d < D; d += kThreads) qrow[d] = E::load(qr[d]);
  __syncthreads();
  float mx = math::negative_infinity();
  for (int64_t j = first + threadIdx.x; j <= t; j += kThreads) {
    float dot = 0.0f;
    for (int64_t d = 0; d < D; ++d) dot += qrow[d] * E::load(kg[j * D + d]);
    p[j] = dot * a.scale;
    mx = fmaxf(mx, p[j]);
  }
  mx = block_max(mx, scratch);
  float sum = 0.0f;
  for (int64_t j = first + threadIdx.x; j <= t; j += kThreads) {
    p[j] = expf(p[j] - mx);
    sum += p[j];
  }
  const float inv = 1.0f / block_sum(sum, scratch);
  for (int64_t j = threadIdx.x; j < T; j += kThreads) {
    p[j] = j >= first && j <= t ? E::load(E::store(p[j] * inv)) : 0.0f;
  }
  __syncthreads();
}

template <typename E>
__global__ void split_kernel(AttentionShape a, const float* qkv, const float* cos, const float* sin,
                             typename E::T* q, typename E::T* k, typename E::T* v) {
  const int64_t H = a.heads, KV = a.kv_heads, D = a.head_dim, T = a.seq, half = D / 2;
  const int64_t slots = H + 2 * KV;
  MESHTRAIN_GRID_STRIDE(idx, a.batch * T * slots * half) {
    const int64_t i = idx % half, hs = (idx / half) % slots, bt = idx / (half * slots);
    const int64_t b = bt / T, t = bt % T;
    const float* src = qkv + bt * slots * D + hs * D + 2 * i;
    float x0 = src[0], x1 = src[1];
    if (cos != nullptr && hs < H + KV) {
      const int64_t p = a.positions != nullptr ? a.positions[bt] : t;
      math::rope_rotate(x0, x1, cos[p * half + i], sin[p * half + i], false);
    }
    typename E::T* dst = hs < H ? q + ((b * H + hs) * T + t) * D
                         : hs < H + KV ? k + ((b * KV + hs - H) * T + t) * D
                                       : v + ((b * KV + hs - H - KV) * T + t) * D;
    dst[2 * i] = E::store(x0);
    dst[2 * i + 1] = E::store(x1);
  }
}

template <typename E>
__global__ void forward_kernel(AttentionShape a, const typename E::T* q, const typename E::T* k,
                               const typename E::T* v, typename E::T* probs,
                               typename E::T* out) {
  extern __shared__ float smem[];  // p [T], qrow [D]
  __shared__ float scratch[kThreads / 32];
  const int64_t i = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int64_t T = a.seq, Q = a.query_rows(), D = a.head_dim, g = h / (a.heads / a.kv_heads);
  float* p = smem;
  probability_row<E>(a, q, k, b, h, i, p, smem + T, scratch);
  if (probs != nullptr) {
    typename E::T* row = probs + ((b * a.heads + h) * Q + i) * T;
    for (int64_t j = threadIdx.x; j < T; j += kThreads) row[j] = E::store(p[j]);
  }
  const int64_t first = first_key(a, b, i), t = query_index(a, i);
  const typename E::T* vg = v + (b * a.kv_heads + g) * T * D;
  for (int64_t d = threadIdx.x; d < D; d += kThreads) {
    float acc = 0.0f;
    for (int64_t j = first; j <= t; ++j) acc += p[j] * E::load(vg[j * D + d]);
    out[((b * Q + i) * a.heads + h) * D + d] = E::store(acc);
  }
}

// Per query: dP = dO v^T, dS = P (dP - sum(P dP)) scale (rounded to E) into
// ds_work, and dQ = dS k.
template <typename E>
__global__ void backward_query_kernel(AttentionShape a, const typename E::T* q,
                                      const typename E::T* k, const typename E::T* v,
                                      const typename E::T* probs, float* p_work,
                                      const float* d_out, float* ds_work, float* dq) {
  extern __shared__ float smem[];  // p [T], ds [T], qrow [D], dO [D]
  __shared__ float scratch[kThreads / 32];
  const int64_t i = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int64_t T = a.seq, Q = a.query_rows(), D = a.head_dim, g = h / (a.heads / a.kv_heads);
  const int64_t row = (b * a.heads + h) * Q + i;
  float* p = smem;
  float* ds = smem + T;
  float* qrow = smem + 2 * T;
  float* dor = qrow + D;
  if (probs != nullptr) {
    for (int64_t j = threadIdx.x; j < T; j += kThreads) p[j] = E::load(probs[row * T + j]);
  } else {
    probability_row<E>(a, q, k, b, h, i, p, qrow, scratch);
    for (int64_t j = threadIdx.x; j < T; j += kThreads) p_work[row * T + j] = p[j];
  }
  for (int64_t d = threadIdx.x; d < D; d += kThreads) {
    dor[d] = E::load(E::store(d_out[((b * Q + i) * a.heads + h) * D + d]));
  }
  __syncthreads();
  const int64_t first = first_key(a, b, i), t = query_index(a, i);
  const typename E::T* kg = k + (b * a.kv_heads + g) * T * D;
  const typename E::T* vg = v + (b * a.kv_heads + g) * T * D;
  float dot = 0.0f;
  for (int64_t j = first + threadIdx.x; j <= t; j += kThreads) {
    float dp = 0.0f;
    for (int64_t d = 0; d < D; ++d) dp += dor[d] * E::load(vg[j * D + d]);
    ds[j] = dp;
    dot += p[j] * dp;
  }
  dot = block_sum(dot, scratch);
  for (int64_t j = threadIdx.x; j < T; j += kThreads) {
    const float value = j >= first && j <= t ? E::load(E::store(p[j] * (ds[j] - dot) * a.scale)) : 0.0f;
    ds[j] = value;
    ds_work[row * T + j] = value;
  }
  __syncthreads();
  for (int64_t d = threadIdx.x; d < D; d += kThreads) {
    float acc = 0.0f;
    for (int64_t j = first; j <= t; ++j) acc += ds[j] * E::load(kg[j * D + d]);
    dq[row * D + d] = acc;
  }
}

// Per key j of kv head g: dK = sum over the group's heads and queries of dS q,
// dV = sum of P dO; threads over D. The queries before key j see none of it
// (dS and P are zero there): a whole sequence's start at j.
template <typename E>
__global__ void backward_key_kernel(AttentionShape a, const typename E::T* q,
                                    const typename E::T* probs, const float* p_work,
                                    const float* d_out, const float* ds_work, float* dk,
                                    float* dv) {
  const int64_t j = blockIdx.x, g = blockIdx.y, b = blockIdx.z;
  const int64_t T = a.seq, Q = a.query_rows(), D = a.head_dim, rep = a.heads / a.kv_heads;
  const int64_t start = a.cp_size > 1 ? 0 : j;
  for (int64_t d = threadIdx.x; d < D; d += kThreads) {
    float gk = 0.0f, gv = 0.0f;
    for (int64_t hh = 0; hh < rep; ++hh) {
      const int64_t h = g * rep + hh;
      for (int64_t i = start; i < Q; ++i) {
        if (query_index(a, i) < j) continue;
        const int64_t row = (b * a.heads + h) * Q + i;
        gk += ds_work[row * T + j] * E::load(q[row * D + d]);
        const float pj = probs != nullptr ? E::load(probs[row * T + j]) : p_work[row * T + j];
        gv += pj * E::load(E::store(d_out[((b * Q + i) * a.heads + h) * D + d]));
      }
    }
    const int64_t out = ((b * a.kv_heads + g) * T + j) * D + d;
    dk[out] = gk;
    dv[out] = gv;
  }
}

template <typename E>
__global__ void merge_kernel(AttentionShape a, const float* dq, const float* dk, const float* dv,
                             const float* cos, const float* sin, typename E::T* d_qkv,
                             int64_t slot_begin, int64_t slot_count) {
  const int64_t H = a.heads, KV = a.kv_heads, D = a.head_dim, T = a.seq, half = D / 2;
  const int64_t slots = H + 2 * KV;
  MESHTRAIN_GRID_STRIDE(idx, a.batch * T * slot_count * half) {
    const int64_t i = idx % half, bt = idx / (half * slot_count);
    const int64_t hs = slot_begin + (idx / half) % slot_count;
    const int64_t b = bt / T, t = bt % T;
    const float* src = hs < H ? dq + ((b * H + hs) * T + t) * D
                       : hs < H + KV ? dk + ((b * KV + hs - H) * T + t) * D
                                     : dv + ((b * KV + hs - H - KV) * T + t) * D;
    float x0 = src[2 * i], x1 = src[2 * i + 1];
    if (cos != nullptr && hs < H + KV) {
      const int64_t p = a.positions != nullptr ? a.positions[bt] : t;
      math::rope_rotate(x0, x1, cos[p * half + i], sin[p * half + i], true);
    }
    typename E::T* dst = d_qkv + bt * slots * D + hs * D + 2 * i;
    dst[0] = E::store(x0);
    dst[1] = E::store(x1);
  }
}

// ---- context parallelism: the ranks' packed blocks <-> the sequence's rows.
// Element idx of the packed blocks is [rank][k or v][group][l][d].
template <typename V>
__global__ void context_rows_kernel(int64_t groups, int64_t L, int64_t D, int64_t size,
                                    V* packed, V* whole_k, V* whole_v, bool to_whole) {
  const int64_t T = L * size, part = groups * L * D;
  MESHTRAIN_GRID_STRIDE(idx, size * 2 * part) {
    const int64_t d = idx % D, l = (idx / D) % L, g = (idx / (D * L)) % groups;
    const int64_t which = (idx / part) % 2, rank = idx / (2 * part);
    V* whole = (which == 0 ? whole_k : whole_v) +
               (g * T + math::context_global(T, rank, size, l)) * D + d;
    if (to_whole) {
      *whole = packed[idx];
    } else {
      packed[idx] = *whole;
    }
  }
}

// Whether key j of rank `block_rank`'s block is among [first, last].
__device__ __forceinline__ bool ring_sees(const AttentionShape& a, int64_t block_rank, int64_t j,
                                          int64_t first, int64_t last) {
  const int64_t key = math::context_global(a.seq, block_rank, a.cp_size, j);
  return key >= first && key <= last;
}

// One block of ring attention for local query (b, h, i): its visible scores
// merged into the running softmax (math::ring_rescale), P rounded to E
// before P·V as the CPU backend's.
template <typename E>
__global__ void ring_forward_kernel(AttentionShape a, int64_t block_rank, const typename E::T* q,
                                    const typename E::T* k, const typename E::T* v, float* mx,
                                    float* sum, float* acc, bool first_block) {
  extern __shared__ float smem[];  // p [L], qrow [D]
  __shared__ float scratch[kThreads / 32];
  const int64_t i = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int64_t L = a.query_rows(), D = a.head_dim, g = h / (a.heads / a.kv_heads);
  const int64_t row = (b * a.heads + h) * L + i;
  const int64_t first = first_key(a, b, i), last = query_index(a, i);
  float* p = smem;
  float* qrow = smem + L;
  const typename E::T* kg = k + (b * a.kv_heads + g) * L * D;
  const typename E::T* vg = v + (b * a.kv_heads + g) * L * D;
  for (int64_t d = threadIdx.x; d < D; d += kThreads) qrow[d] = E::load(q[row * D + d]);
  __syncthreads();
  float best = math::negative_infinity();
  for (int64_t j = threadIdx.x; j < L; j += kThreads) {
    if (!ring_sees(a, block_rank, j, first, last)) {
      p[j] = math::negative_infinity();
      continue;
    }
    float dot = 0.0f;
    for (int64_t d = 0; d < D; ++d) dot += qrow[d] * E::load(kg[j * D + d]);
    p[j] = dot * a.scale;
    best = fmaxf(best, p[j]);
  }
  best = block_max(best, scratch);
  const float m0 = first_block ? math::negative_infinity() : mx[row];
  if (best == math::negative_infinity()) {  // nothing of this block is visible
    if (first_block) {
      for (int64_t d = threadIdx.x; d < D; d += kThreads) acc[row * D + d] = 0.0f;
      if (threadIdx.x == 0) {
        mx[row] = m0;
        sum[row] = 0.0f;
      }
    }
    return;
  }
  const math::RingRescale r = math::ring_rescale(m0, best);
  float total = 0.0f;
  for (int64_t j = threadIdx.x; j < L; j += kThreads) {
    if (p[j] == math::negative_infinity()) {
      p[j] = 0.0f;
      continue;
    }
    const float e = expf(p[j] - r.max);
    total += e;
    p[j] = E::load(E::store(e));
  }
  total = block_sum(total, scratch);  // its barriers publish p
  for (int64_t d = threadIdx.x; d < D; d += kThreads) {
    float o = 0.0f;
    for (int64_t j = 0; j < L; ++j) o += p[j] * E::load(vg[j * D + d]);
    acc[row * D + d] = (first_block ? 0.0f : acc[row * D + d] * r.alpha) + o;
  }
  if (threadIdx.x == 0) {
    sum[row] = (first_block ? 0.0f : sum[row] * r.alpha) + total;
    mx[row] = r.max;
  }
}

template <typename E>
__global__ void ring_finish_kernel(AttentionShape a, const float* mx, const float* sum,
                                   const float* acc, typename E::T* out, float* lse) {
  const int64_t L = a.query_rows(), H = a.heads, D = a.head_dim;
  MESHTRAIN_GRID_STRIDE(idx, a.batch * H * L * D) {
    const int64_t d = idx % D, row = idx / D;
    const int64_t i = row % L, h = (row / L) % H, b = row / (L * H);
    out[((b * L + i) * H + h) * D + d] = E::store(acc[idx] * (1.0f / sum[row]));
    if (d == 0) lse[row] = mx[row] + logf(sum[row]);
  }
}

// Backward of one block for local query (b, h, i0 + blockIdx.x) of a tile of
// `tile` queries: P = exp(S - lse) over the visible keys, dS = P (dP - dO·O)
// scale; dq += dS k; P and dS (rounded to E) into p_work and ds_work [B, H,
// tile, L] for the keys' kernel.
template <typename E>
__global__ void ring_backward_query_kernel(AttentionShape a, int64_t block_rank,
                                           const typename E::T* q, const typename E::T* k,
                                           const typename E::T* v, const float* lse,
                                           const float* d_out, const typename E::T* out,
                                           int64_t i0, int64_t tile, float* p_work,
                                           float* ds_work, float* dq) {
  extern __shared__ float smem[];  // ds [L], qrow [D], dO [D]
  __shared__ float scratch[kThreads / 32];
  const int64_t i = i0 + blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int64_t L = a.query_rows(), D = a.head_dim, g = h / (a.heads / a.kv_heads);
  const int64_t row = (b * a.heads + h) * L + i, at = ((b * L + i) * a.heads + h) * D;
  const int64_t work = ((b * a.heads + h) * tile + blockIdx.x) * L;
  const int64_t first = first_key(a, b, i), last = query_index(a, i);
  float* ds = smem;
  float* qrow = smem + L;
  float* dor = qrow + D;
  const typename E::T* kg = k + (b * a.kv_heads + g) * L * D;
  const typename E::T* vg = v + (b * a.kv_heads + g) * L * D;
  float delta = 0.0f;
  for (int64_t d = threadIdx.x; d < D; d += kThreads) {
    qrow[d] = E::load(q[row * D + d]);
    dor[d] = E::load(E::store(d_out[at + d]));
    delta += d_out[at + d] * E::load(out[at + d]);
  }
  delta = block_sum(delta, scratch);  // its barriers publish qrow and dor
  const float l = lse[row];
  for (int64_t j = threadIdx.x; j < L; j += kThreads) {
    float pj = 0.0f, dsj = 0.0f;
    if (ring_sees(a, block_rank, j, first, last)) {
      float dot = 0.0f, dp = 0.0f;
      for (int64_t d = 0; d < D; ++d) {
        dot += qrow[d] * E::load(kg[j * D + d]);
        dp += dor[d] * E::load(vg[j * D + d]);
      }
      pj = expf(dot * a.scale - l);
      dsj = E::load(E::store(pj * (dp - delta) * a.scale));
      pj = E::load(E::store(pj));
    }
    ds[j] = dsj;
    p_work[work + j] = pj;
    ds_work[work + j] = dsj;
  }
  __syncthreads();
  for (int64_t d = threadIdx.x; d < D; d += kThreads) {
    float g_q = 0.0f;
    for (int64_t j = 0; j < L; ++j) g_q += ds[j] * E::load(kg[j * D + d]);
    dq[row * D + d] += g_q;
  }
}

// Per key j of the block and kv head g: dk += dS^T q, dv += P^T dO over the
// group's heads and the tile's local queries [i0, i0 + rows).
template <typename E>
__global__ void ring_backward_key_kernel(AttentionShape a, const typename E::T* q, int64_t i0,
                                         int64_t tile, int64_t rows, const float* p_work,
                                         const float* ds_work, const float* d_out, float* dk,
                                         float* dv) {
  const int64_t j = blockIdx.x, g = blockIdx.y, b = blockIdx.z;
  const int64_t L = a.query_rows(), D = a.head_dim, rep = a.heads / a.kv_heads;
  for (int64_t d = threadIdx.x; d < D; d += kThreads) {
    float gk = 0.0f, gv = 0.0f;
    for (int64_t hh = 0; hh < rep; ++hh) {
      const int64_t h = g * rep + hh;
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = i0 + r, row = (b * a.heads + h) * L + i;
        const int64_t work = ((b * a.heads + h) * tile + r) * L + j;
        gk += ds_work[work] * E::load(q[row * D + d]);
        gv += p_work[work] * E::load(E::store(d_out[((b * L + i) * a.heads + h) * D + d]));
      }
    }
    const int64_t o = ((b * a.kv_heads + g) * L + j) * D + d;
    dk[o] += gk;
    dv[o] += gv;
  }
}

// ---- decoding over a KV cache [B, KV, S, D] f32.
// The most keys one query sees: every position so far, or its window.
__host__ __device__ inline int64_t decode_keys(const AttentionShape& a, int64_t pos0) {
  const int64_t all = pos0 + a.seq;
  return a.window > 0 && a.window < all ? a.window : all;
}

__global__ void decode_append_kernel(AttentionShape a, const float* qkv, const float* cos,
                                     const float* sin, int64_t pos0, int64_t S, float* kc,
                                     float* vc) {
  const int64_t H = a.heads, KV = a.kv_heads, D = a.head_dim, T = a.seq, half = D / 2;
  const int64_t W = (H + 2 * KV) * D;
  MESHTRAIN_GRID_STRIDE(idx, a.batch * T * KV * half) {
    const int64_t x = idx % half, j = (idx / half) % KV, bt = idx / (half * KV);
    const int64_t b = bt / T, pos = pos0 + bt % T;
    const float* kr = qkv + bt * W + (H + j) * D + 2 * x;
    const float* vr = qkv + bt * W + (H + KV + j) * D + 2 * x;
    float x0 = kr[0], x1 = kr[1];
    if (cos != nullptr) math::rope_rotate(x0, x1, cos[pos * half + x], sin[pos * half + x], false);
    const int64_t at = ((b * KV + j) * S + pos) * D + 2 * x;
    kc[at] = x0;
    kc[at + 1] = x1;
    vc[at] = vr[0];
    vc[at + 1] = vr[1];
  }
}

__global__ void decode_kernel(AttentionShape a, const float* qkv, const float* cos,
                              const float* sin, int64_t pos0, int64_t S, const float* kc,
                              const float* vc, float* out) {
  extern __shared__ float smem[];  // scores [decode_keys], qrow [D]
  __shared__ float scratch[kThreads / 32];
  const int64_t t = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int64_t H = a.heads, KV = a.kv_heads, D = a.head_dim, T = a.seq, half = D / 2;
  const int64_t bt = b * T + t, pos = pos0 + t, j = h / (H / KV);
  const int64_t first = a.window > 0 && pos - a.window + 1 > 0 ? pos - a.window + 1 : 0;
  float* sc = smem;  // key s's score at sc[s - first]
  float* qrow = smem + decode_keys(a, pos0);
  const float* qsrc = qkv + bt * (H + 2 * KV) * D + h * D;
  for (int64_t x = threadIdx.x; x < half; x += kThreads) {
    float x0 = qsrc[2 * x], x1 = qsrc[2 * x + 1];
    if (cos != nullptr) math::rope_rotate(x0, x1, cos[pos * half + x], sin[pos * half + x], false);
    qrow[2 * x] = x0;
    qrow[2 * x + 1] = x1;
  }
  __syncthreads();
  const float* kh = kc + (b * KV + j) * S * D;
  const float* vh = vc + (b * KV + j) * S * D;
  float mx = math::negative_infinity();
  for (int64_t s = first + threadIdx.x; s <= pos; s += kThreads) {
    float dot = 0.0f;
    for (int64_t d = 0; d < D; ++d) dot += qrow[d] * kh[s * D + d];
    sc[s - first] = dot * a.scale;
    mx = fmaxf(mx, sc[s - first]);
  }
  mx = block_max(mx, scratch);
  float total = 0.0f;
  for (int64_t s = first + threadIdx.x; s <= pos; s += kThreads) {
    sc[s - first] = expf(sc[s - first] - mx);
    total += sc[s - first];
  }
  const float inv = 1.0f / block_sum(total, scratch);  // its barriers publish sc
  for (int64_t d = threadIdx.x; d < D; d += kThreads) {
    float o = 0.0f;
    for (int64_t s = first; s <= pos; ++s) o += sc[s - first] * inv * vh[s * D + d];
    out[(bt * H + h) * D + d] = o;
  }
}

dim3 query_grid(const AttentionShape& a) {
  return dim3(static_cast<unsigned>(a.query_rows()), static_cast<unsigned>(a.heads),
              static_cast<unsigned>(a.batch));
}

size_t forward_shared(const AttentionShape& a) {
  return static_cast<size_t>(a.seq + a.head_dim) * sizeof(float);
}

size_t backward_shared(const AttentionShape& a) {
  return static_cast<size_t>(2 * a.seq + 2 * a.head_dim) * sizeof(float);
}

// Lets `kernel` take `bytes` of dynamic shared memory (above the 48 KiB default).
template <typename Kernel>
void allow_shared(Kernel kernel, size_t bytes) {
  if (bytes > 48 * 1024) {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                         static_cast<int>(bytes));
  }
}

}  // namespace

size_t attention_shared_bytes(const AttentionShape& a) { return backward_shared(a); }

void launch_attention_split(cudaStream_t s, const AttentionShape& a, const float* qkv,
                            const float* cos, const float* sin, Elem e, void* q, void* k,
                            void* v) {
  const int64_t n = a.batch * a.seq * (a.heads + 2 * a.kv_heads) * (a.head_dim / 2);
  with_elem(e, [&](auto tag) {
    using E = decltype(tag);
    using T = typename E::T;
    split_kernel<E><<<blocks_for(n), kThreads, 0, s>>>(a, qkv, cos, sin, static_cast<T*>(q),
                                                       static_cast<T*>(k), static_cast<T*>(v));
  });
  check_launch("attention split");
}

void launch_attention_forward(cudaStream_t s, const AttentionShape& a, Elem e, const void* q,
                              const void* k, const void* v, void* probs, void* out) {
  with_elem(e, [&](auto tag) {
    using E = decltype(tag);
    using T = typename E::T;
    const size_t shared = forward_shared(a);
    allow_shared(forward_kernel<E>, shared);
    forward_kernel<E><<<query_grid(a), kThreads, shared, s>>>(
        a, static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v),
        static_cast<T*>(probs), static_cast<T*>(out));
  });
  check_launch("attention_forward");
}

void launch_attention_backward(cudaStream_t s, const AttentionShape& a, Elem e, const void* q,
                               const void* k, const void* v, const void* probs, float* p_work,
                               const float* d_out, float* ds_work, float* dq, float* dk,
                               float* dv) {
  with_elem(e, [&](auto tag) {
    using E = decltype(tag);
    using T = typename E::T;
    const auto* qq = static_cast<const T*>(q);
    const auto* pp = static_cast<const T*>(probs);
    const size_t shared = backward_shared(a);
    allow_shared(backward_query_kernel<E>, shared);
    backward_query_kernel<E><<<query_grid(a), kThreads, shared, s>>>(
        a, qq, static_cast<const T*>(k), static_cast<const T*>(v), pp, p_work, d_out, ds_work, dq);
    const dim3 keys(static_cast<unsigned>(a.seq), static_cast<unsigned>(a.kv_heads),
                    static_cast<unsigned>(a.batch));
    backward_key_kernel<E><<<keys, kThreads, 0, s>>>(a, qq, pp, p_work, d_out, ds_work, dk, dv);
  });
  check_launch("attention_backward");
}

void launch_attention_merge(cudaStream_t s, const AttentionShape& a, const float* dq,
                            const float* dk, const float* dv, const float* cos, const float* sin,
                            Elem e, void* d_qkv, int64_t slot_begin, int64_t slot_end) {
  const int64_t count = (slot_end < 0 ? a.heads + 2 * a.kv_heads : slot_end) - slot_begin;
  const int64_t n = a.batch * a.seq * count * (a.head_dim / 2);
  if (n <= 0) return;
  with_elem(e, [&](auto tag) {
    using E = decltype(tag);
    merge_kernel<E><<<blocks_for(n), kThreads, 0, s>>>(
        a, dq, dk, dv, cos, sin, static_cast<typename E::T*>(d_qkv), slot_begin, count);
  });
  check_launch("attention merge");
}

void launch_context_rows(cudaStream_t s, int64_t groups, int64_t L, int64_t D, int64_t size,
                         size_t bytes, void* packed, void* whole_k, void* whole_v, bool to_whole) {
  const int64_t n = size * 2 * groups * L * D;
  auto run = [&](auto* tag) {
    using V = std::remove_pointer_t<decltype(tag)>;
    context_rows_kernel<V><<<blocks_for(n), kThreads, 0, s>>>(
        groups, L, D, size, static_cast<V*>(packed), static_cast<V*>(whole_k),
        static_cast<V*>(whole_v), to_whole);
  };
  if (bytes == 4) {
    run(static_cast<uint32_t*>(nullptr));
  } else {
    run(static_cast<uint16_t*>(nullptr));
  }
  check_launch("context attention rows");
}

void launch_ring_forward_block(cudaStream_t s, const AttentionShape& a, int64_t block_rank,
                               Elem e, const void* q, const void* k, const void* v, float* max,
                               float* sum, float* acc, bool first) {
  const size_t shared = static_cast<size_t>(a.query_rows() + a.head_dim) * sizeof(float);
  with_elem(e, [&](auto tag) {
    using E = decltype(tag);
    using T = typename E::T;
    allow_shared(ring_forward_kernel<E>, shared);
    ring_forward_kernel<E><<<query_grid(a), kThreads, shared, s>>>(
        a, block_rank, static_cast<const T*>(q), static_cast<const T*>(k),
        static_cast<const T*>(v), max, sum, acc, first);
  });
  check_launch("ring attention forward");
}

void launch_ring_forward_finish(cudaStream_t s, const AttentionShape& a, Elem e, const float* max,
                                const float* sum, const float* acc, void* out, float* lse) {
  const int64_t n = a.batch * a.heads * a.query_rows() * a.head_dim;
  with_elem(e, [&](auto tag) {
    using E = decltype(tag);
    ring_finish_kernel<E><<<blocks_for(n), kThreads, 0, s>>>(
        a, max, sum, acc, static_cast<typename E::T*>(out), lse);
  });
  check_launch("ring attention finish");
}

int64_t ring_backward_tile(const AttentionShape& a) {
  return a.query_rows() < kRingTile ? a.query_rows() : kRingTile;
}

void launch_ring_backward_block(cudaStream_t s, const AttentionShape& a, int64_t block_rank,
                                Elem e, const void* q, const void* k, const void* v,
                                const float* lse, const float* d_out, const void* out,
                                float* p_work, float* ds_work, float* dq, float* dk, float* dv) {
  const int64_t L = a.query_rows(), tile = ring_backward_tile(a);
  const size_t shared = static_cast<size_t>(L + 2 * a.head_dim) * sizeof(float);
  with_elem(e, [&](auto tag) {
    using E = decltype(tag);
    using T = typename E::T;
    const auto* qq = static_cast<const T*>(q);
    allow_shared(ring_backward_query_kernel<E>, shared);
    for (int64_t i0 = 0; i0 < L; i0 += tile) {
      const int64_t rows = L - i0 < tile ? L - i0 : tile;
      const dim3 queries(static_cast<unsigned>(rows), static_cast<unsigned>(a.heads),
                         static_cast<unsigned>(a.batch));
      ring_backward_query_kernel<E><<<queries, kThreads, shared, s>>>(
          a, block_rank, qq, static_cast<const T*>(k), static_cast<const T*>(v), lse, d_out,
          static_cast<const T*>(out), i0, tile, p_work, ds_work, dq);
      const dim3 keys(static_cast<unsigned>(L), static_cast<unsigned>(a.kv_heads),
                      static_cast<unsigned>(a.batch));
      ring_backward_key_kernel<E><<<keys, kThreads, 0, s>>>(a, qq, i0, tile, rows, p_work,
                                                             ds_work, d_out, dk, dv);
    }
  });
  check_launch("ring attention backward");
}

size_t decode_shared_bytes(const AttentionShape& a, int64_t pos0) {
  return static_cast<size_t>(decode_keys(a, pos0) + a.head_dim) * sizeof(float);
}

void launch_attention_decode(cudaStream_t s, const AttentionShape& a, const float* qkv,
                             const float* cos, const float* sin, int64_t pos0, int64_t S,
                             float* k_cache, float* v_cache, float* out) {
  const int64_t n = a.batch * a.seq * a.kv_heads * (a.head_dim / 2);
  decode_append_kernel<<<blocks_for(n), kThreads, 0, s>>>(a, qkv, cos, sin, pos0, S, k_cache,
                                                          v_cache);
  const size_t shared = decode_shared_bytes(a, pos0);
  allow_shared(decode_kernel, shared);
  decode_kernel<<<query_grid(a), kThreads, shared, s>>>(a, qkv, cos, sin, pos0, S, k_cache,
                                                        v_cache, out);
  check_launch("attention_decode");
}

}  // namespace meshtrain::cuda
