// Causal grouped-query attention, one block per (query, head, row): the
// reference kernel of the CUDA backend (and the path for what a cuDNN graph
// cannot express: record positions of packed rows). Probabilities are
// rounded to the compute dtype before P·V and dS before its products, as the
// CPU backend stores them (backend/cpu/attention.cpp).
#include "meshtrain/backend/cuda/device.cuh"

namespace meshtrain::cuda {
namespace {

__device__ __forceinline__ int64_t first_key(const AttentionShape& a, int64_t b, int64_t t) {
  const int64_t pos = a.positions != nullptr ? a.positions[b * a.seq + t] : t;
  int64_t first = t - pos;
  if (a.window > 0 && t - a.window + 1 > first) first = t - a.window + 1;
  return first;
}

// The probabilities of query (b, h, t) over keys [0, T) into p (zero outside
// [first, t]), each rounded to E; qrow [D] is shared scratch.
template <typename E>
__device__ void probability_row(const AttentionShape& a, const typename E::T* q,
                                const typename E::T* k, int64_t b, int64_t h, int64_t t,
                                float* p, float* qrow, float* scratch) {
  const int64_t T = a.seq, D = a.head_dim, g = h / (a.heads / a.kv_heads);
  const int64_t first = first_key(a, b, t);
  const typename E::T* qr = q + ((b * a.heads + h) * T + t) * D;
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
  const int64_t t = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int64_t T = a.seq, D = a.head_dim, g = h / (a.heads / a.kv_heads);
  float* p = smem;
  probability_row<E>(a, q, k, b, h, t, p, smem + T, scratch);
  if (probs != nullptr) {
    typename E::T* row = probs + ((b * a.heads + h) * T + t) * T;
    for (int64_t j = threadIdx.x; j < T; j += kThreads) row[j] = E::store(p[j]);
  }
  const int64_t first = first_key(a, b, t);
  const typename E::T* vg = v + (b * a.kv_heads + g) * T * D;
  for (int64_t d = threadIdx.x; d < D; d += kThreads) {
    float acc = 0.0f;
    for (int64_t j = first; j <= t; ++j) acc += p[j] * E::load(vg[j * D + d]);
    out[((b * T + t) * a.heads + h) * D + d] = E::store(acc);
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
  const int64_t t = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int64_t T = a.seq, D = a.head_dim, g = h / (a.heads / a.kv_heads);
  const int64_t row = (b * a.heads + h) * T + t;
  float* p = smem;
  float* ds = smem + T;
  float* qrow = smem + 2 * T;
  float* dor = qrow + D;
  if (probs != nullptr) {
    for (int64_t j = threadIdx.x; j < T; j += kThreads) p[j] = E::load(probs[row * T + j]);
  } else {
    probability_row<E>(a, q, k, b, h, t, p, qrow, scratch);
    for (int64_t j = threadIdx.x; j < T; j += kThreads) p_work[row * T + j] = p[j];
  }
  for (int64_t d = threadIdx.x; d < D; d += kThreads) {
    dor[d] = E::load(E::store(d_out[((b * T + t) * a.heads + h) * D + d]));
  }
  __syncthreads();
  const int64_t first = first_key(a, b, t);
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
// dV = sum of P dO; threads over D.
template <typename E>
__global__ void backward_key_kernel(AttentionShape a, const typename E::T* q,
                                    const typename E::T* probs, const float* p_work,
                                    const float* d_out, const float* ds_work, float* dk,
                                    float* dv) {
  const int64_t j = blockIdx.x, g = blockIdx.y, b = blockIdx.z;
  const int64_t T = a.seq, D = a.head_dim, rep = a.heads / a.kv_heads;
  for (int64_t d = threadIdx.x; d < D; d += kThreads) {
    float gk = 0.0f, gv = 0.0f;
    for (int64_t hh = 0; hh < rep; ++hh) {
      const int64_t h = g * rep + hh;
      for (int64_t t = j; t < T; ++t) {
        const int64_t row = (b * a.heads + h) * T + t;
        gk += ds_work[row * T + j] * E::load(q[row * D + d]);
        const float pj = probs != nullptr ? E::load(probs[row * T + j]) : p_work[row * T + j];
        gv += pj * E::load(E::store(d_out[((b * T + t) * a.heads + h) * D + d]));
      }
    }
    const int64_t out = ((b * a.kv_heads + g) * T + j) * D + d;
    dk[out] = gk;
    dv[out] = gv;
  }
}

template <typename E>
__global__ void merge_kernel(AttentionShape a, const float* dq, const float* dk, const float* dv,
                             const float* cos, const float* sin, typename E::T* d_qkv) {
  const int64_t H = a.heads, KV = a.kv_heads, D = a.head_dim, T = a.seq, half = D / 2;
  const int64_t slots = H + 2 * KV;
  MESHTRAIN_GRID_STRIDE(idx, a.batch * T * slots * half) {
    const int64_t i = idx % half, hs = (idx / half) % slots, bt = idx / (half * slots);
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

dim3 query_grid(const AttentionShape& a) {
  return dim3(static_cast<unsigned>(a.seq), static_cast<unsigned>(a.heads),
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
                            Elem e, void* d_qkv) {
  const int64_t n = a.batch * a.seq * (a.heads + 2 * a.kv_heads) * (a.head_dim / 2);
  with_elem(e, [&](auto tag) {
    using E = decltype(tag);
    merge_kernel<E><<<blocks_for(n), kThreads, 0, s>>>(a, dq, dk, dv, cos, sin,
                                                       static_cast<typename E::T*>(d_qkv));
  });
  check_launch("attention merge");
}

}  // namespace meshtrain::cuda
