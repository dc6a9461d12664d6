#include "meshtrain/backend/cpu/attention.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
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
  int64_t i = 0;
#if defined(MESHTRAIN_AVX512)
  // 8 pairs per vector: out = x * [c c] + swap_pairs(x) * [-s s] (signs flipped for inverse).
  const __m512i dup = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512 sign = inverse ? _mm512_set_ps(-1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1)
                              : _mm512_set_ps(1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1);
  for (; i + 8 <= half; i += 8) {
    const __m512 c = _mm512_permutexvar_ps(dup, _mm512_castps256_ps512(_mm256_loadu_ps(cos + i)));
    const __m512 s = _mm512_mul_ps(
        sign, _mm512_permutexvar_ps(dup, _mm512_castps256_ps512(_mm256_loadu_ps(sin + i))));
    const __m512 v = _mm512_loadu_ps(x + 2 * i);
    const __m512 swapped = _mm512_permute_ps(v, 0xB1);
    _mm512_storeu_ps(out + 2 * i, _mm512_fmadd_ps(v, c, _mm512_mul_ps(swapped, s)));
  }
#endif
  const float sgn = inverse ? -1.0f : 1.0f;
  for (; i < half; ++i) {
    const float x0 = x[2 * i], x1 = x[2 * i + 1];
    const float c = cos[i], s = sgn * sin[i];
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
  if (d.positions != nullptr) {
    for (int64_t b = 0; b < d.batch; ++b) {
      for (int64_t t = 0; t < d.seq; ++t) {
        const int64_t p = d.position(b, t);
        MESHTRAIN_CHECK(p >= 0 && p <= t && (p == 0 || d.position(b, t - 1) == p - 1),
                        "attention: position {} of token {} in row {} is not 0 or its "
                        "predecessor's + 1 (records restart at 0)",
                        p, t, b);
      }
    }
  }
}

void ensure(Tensor& t, const Shape& shape, DType dtype, MemoryTracker& tracker) {
  if (t.defined() && t.shape() == shape && t.dtype() == dtype) return;
  t = Tensor();
  t = Tensor(shape, dtype, MemCategory::activations, tracker);
}

// A pass's saved keys and values, and its probabilities unless backward
// recomputes them (AttentionSaved::recompute_probs).
void ensure_saved(AttentionSaved& saved, const Shape& kv, const Shape& probs, DType compute,
                  MemoryTracker& tracker) {
  ensure(saved.k, kv, compute, tracker);
  ensure(saved.v, kv, compute, tracker);
  if (saved.recompute_probs) {
    saved.probs = Tensor();
  } else {
    ensure(saved.probs, probs, compute, tracker);
  }
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

// Causal softmax of one row of scores over keys [first, n) (n = t + 1; first:
// the record's first token, 0 unpacked), T total: probs[first..n) = softmax,
// zero elsewhere. scores may alias probs (f32).
template <typename T>
inline void softmax_row(float* scores, T* probs, int64_t first, int64_t n, int64_t T_total) {
  std::memset(static_cast<void*>(probs), 0, static_cast<size_t>(first) * sizeof(T));
  scores += first;
  const int64_t len = n - first;
  const float mx = simd::max_of(scores, len);
  const float inv = 1.0f / simd::exp_shift_sum(scores, len, mx);
#pragma omp simd
  for (int64_t s = 0; s < len; ++s) scores[s] *= inv;
  simd::store_row(probs + first, scores, len);
  std::memset(static_cast<void*>(probs + n), 0, static_cast<size_t>(T_total - n) * sizeof(T));
}

// Softmax backward of one row over keys [first, n), T total: dS = P (dP -
// sum(P dP)) * scale there, zero elsewhere. dp (f32) is overwritten; in f32
// ds aliases it (dS in place), else dS is stored in E.
template <typename E>
inline void softmax_backward_row(float* dp, const E* probs, E* ds, int64_t first, int64_t n,
                                 int64_t T_total, float scale) {
  float* dpr = dp + first;
  const E* pr = probs + first;
  const int64_t len = n - first;
  float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
  for (int64_t s = 0; s < len; ++s) dot += simd::load1(pr + s) * dpr[s];
#pragma omp simd
  for (int64_t s = 0; s < len; ++s) dpr[s] = simd::load1(pr + s) * (dpr[s] - dot) * scale;
  if (static_cast<void*>(ds) != static_cast<void*>(dp)) simd::store_row(ds + first, dpr, len);
  std::memset(static_cast<void*>(ds), 0, static_cast<size_t>(first) * sizeof(E));
  std::memset(static_cast<void*>(ds + n), 0, static_cast<size_t>(T_total - n) * sizeof(E));
}

// Splits rows [B, T, (H + 2KV) D] of qkv into q [B, H, T, D] and k, v [B,
// KV, T, D] (E), rotating q and k by position(b, t) when rope is given.
template <typename E, typename Position>
void split_heads(const float* qkv, int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D,
                 const RopeTable* rope, Position position, E* q, E* k, E* v) {
  const int64_t W = (H + 2 * KV) * D, half = D / 2;
#pragma omp parallel
  {
    std::vector<float> tmp(static_cast<size_t>(D));
#pragma omp for schedule(static)
    for (int64_t bt = 0; bt < B * T; ++bt) {
      const int64_t b = bt / T, t = bt % T, p = position(b, t);
      const float* row = qkv + bt * W;
      const float* c = rope ? rope->cos.data<float>() + p * half : nullptr;
      const float* s = rope ? rope->sin.data<float>() + p * half : nullptr;
      for (int64_t h = 0; h < H; ++h)
        put_head(row + h * D, q + ((b * H + h) * T + t) * D, c, s, D, false, tmp.data());
      for (int64_t j = 0; j < KV; ++j) {
        put_head(row + (H + j) * D, k + ((b * KV + j) * T + t) * D, c, s, D, false, tmp.data());
        put_head(row + (H + KV + j) * D, v + ((b * KV + j) * T + t) * D, nullptr, nullptr, D, false,
                 tmp.data());
      }
    }
  }
}

}  // namespace

RopeTable make_rope_table(int64_t head_dim, int64_t max_seq, float theta, MemoryTracker& tracker) {
  return make_rope_table(head_dim, max_seq, rope_inv_freq(head_dim, theta), tracker);
}

RopeTable make_rope_table(int64_t head_dim, int64_t max_seq, std::span<const float> inv_freq,
                          MemoryTracker& tracker) {
  MESHTRAIN_CHECK(head_dim > 0 && head_dim % 2 == 0, "rope: head_dim {} must be even", head_dim);
  MESHTRAIN_CHECK(max_seq > 0, "rope: max_seq {} must be positive", max_seq);
  const int64_t half = head_dim / 2;
  RopeTable table;
  table.head_dim = head_dim;
  table.max_seq = max_seq;
  table.cos = Tensor({max_seq, half}, DType::f32, MemCategory::workspace, tracker);
  table.sin = Tensor({max_seq, half}, DType::f32, MemCategory::workspace, tracker);
  ops::rope_table_values(head_dim, max_seq, inv_freq, table.cos.data<float>(),
                         table.sin.data<float>());
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

namespace {

// Hands out 64-byte aligned pieces of one thread's workspace.
class Carver {
 public:
  explicit Carver(void* base) : p_(static_cast<char*>(base)) {}
  template <typename T>
  T* take(int64_t n) {
    T* out = reinterpret_cast<T*>(p_);
    p_ += (static_cast<size_t>(n) * sizeof(T) + 63) / 64 * 64;
    return out;
  }
  static size_t bytes(std::initializer_list<int64_t> sizes) {
    size_t total = 0;
    for (int64_t s : sizes) total += (static_cast<size_t>(s) + 63) / 64 * 64;
    return total;
  }

 private:
  char* p_;
};

// Query blocks of the causal GEMMs: block i holds queries [i*size, i*size + rows)
// and multiplies only keys [0, end) (end = i*size + rows): the masked upper
// triangle beyond the block's diagonal is never computed (~3/8 of the
// score-sized GEMMs at 4 blocks). ~4 blocks, at most 64 rows each.
struct CausalBlocks {
  explicit CausalBlocks(int64_t T) : seq(T), size(std::max<int64_t>(1, std::min<int64_t>(64, (T + 3) / 4))) {}
  int64_t count() const { return (seq + size - 1) / size; }
  int64_t begin(int64_t i) const { return i * size; }
  int64_t rows(int64_t i) const { return std::min(size, seq - i * size); }
  int64_t end(int64_t i) const { return begin(i) + rows(i); }
  int64_t seq, size;
};

// The per-block GEMMs, one function each, for the kernels' ThreadMatmuls and
// for attention_workspace_bytes. Query block i from key key0 (0 unless packed
// rows skip masked key blocks): scores (and dP) [rows, key0:end) = q[rows]
// k[key0:end)^T; out (and dQ) [rows] = P[rows, key0:end) v[key0:end). Key
// block i: dK[keys] = dS[begin:T, keys]^T q[begin:T] (and dV from P, dO).
// The keys a query block's scores (and dP) are computed for: up to the
// block's last query (the causal part), but in bf16 on a CPU with AMX every
// key to the end of the row. There oneDNN 2.6 runs a bf16 GEMM whose C rows
// are narrower than their stride on gemm:jit, not AMX's brgemm: 27–64 µs
// against 7 µs for a 64-row block at T = 256 (DNNL_VERBOSE). The softmax reads
// only the causal part, so the rest is computed and ignored: twice the score
// FLOPs, 2.3–3.1× faster forward (docs/benchmarks.md). Without AMX (AVX-512
// BF16 brgemm, as on Zen 4) the wider GEMM does not pay: the causal bound was
// 1.3× faster forward and 1.1–1.5× backward at T = 1024. f32 and f16 (f32 GEMMs
// after staging) keep the causal bound: full rows measured 10–15% slower.
bool whole_score_rows(DType compute) {
  static const bool amx = (dnnl_get_effective_cpu_isa() & dnnl_cpu_isa_avx512_core_amx) ==
                          dnnl_cpu_isa_avx512_core_amx;
  return compute == DType::bf16 && amx;
}
int64_t score_end(const CausalBlocks& blk, int64_t i, DType compute) {
  return whole_score_rows(compute) ? blk.seq : blk.end(i);
}
MatmulDims score_dims(const CausalBlocks& blk, int64_t i, int64_t D, DType compute,
                      int64_t key0 = 0) {
  return MatmulDims{1, blk.rows(i), score_end(blk, i, compute) - key0, D, false, true, false,
                    D, D, blk.seq};
}
MatmulDims output_dims(const CausalBlocks& blk, int64_t i, int64_t D, int64_t key0 = 0) {
  return MatmulDims{1, blk.rows(i), D, blk.end(i) - key0, false, false, false, blk.seq, D, D};
}
MatmulDims key_grad_dims(const CausalBlocks& blk, int64_t i, int64_t D) {
  return MatmulDims{1, blk.rows(i), D, blk.seq - blk.begin(i), true, false, false, blk.seq, D, D};
}

float score_scale(int64_t D) { return 1.0f / std::sqrt(static_cast<float>(D)); }

// One thread's workspace: the pieces in the order the kernels carve them
// (M = rep * T rows of a group, e = bytes of the compute dtype, pad = the
// largest GEMM scratchpad of the pass).
size_t forward_thread_bytes(int64_t M, int64_t T, int64_t D, int64_t e, bool keep_probs, size_t pad) {
  const bool f32 = e == 4;
  return Carver::bytes({f32 ? 0 : M * T * 4, keep_probs ? 0 : M * T * e, M * D * e,
                        static_cast<int64_t>(pad)});
}
size_t backward_thread_bytes(int64_t M, int64_t T, int64_t D, int64_t e, bool keep_probs, size_t pad) {
  const bool f32 = e == 4;
  return Carver::bytes({M * D * e, M * T * 4, f32 ? 0 : M * T * e, M * D * 4, T * D * 4, T * D * 4,
                        D * 4, static_cast<int64_t>(pad), keep_probs ? 0 : M * T * e});
}

// A backward thread's pieces of its scratch, carved in backward_thread_bytes'
// order: the group's dO (E), dP (f32) and dS (E; dP itself in f32), dQ, dK,
// dV (f32), a rotation row and the GEMMs' scratchpad; a recomputation's
// probabilities come after (the caller takes them).
template <typename E>
struct BackwardScratch {
  BackwardScratch(Carver& mine, int64_t M, int64_t T, int64_t D, int64_t pad_bytes)
      : dout(mine.take<E>(M * D)),
        dp(mine.take<float>(M * T)),
        ds(std::is_same_v<E, float> ? reinterpret_cast<E*>(dp) : mine.take<E>(M * T)),
        dq(mine.take<float>(M * D)),
        dk(mine.take<float>(T * D)),
        dv(mine.take<float>(T * D)),
        tmp(mine.take<float>(D)),
        pad(mine.take<char>(pad_bytes)) {}
  E* dout;
  float* dp;
  E* ds;
  float *dq, *dk, *dv, *tmp;
  void* pad;
};

// One ThreadMatmul per causal block, dims from make(block index).
template <typename MakeDims>
std::vector<ThreadMatmul> per_block(CpuContext& ctx, const CausalBlocks& blocks, DType ab, DType c,
                                    MakeDims make, float alpha = 1.0f, bool accumulate = false) {
  std::vector<ThreadMatmul> out;
  out.reserve(static_cast<size_t>(blocks.count()));
  for (int64_t i = 0; i < blocks.count(); ++i) out.emplace_back(ctx, make(i), ab, c, alpha, accumulate);
  return out;
}

// Packed rows (AttentionDims::positions) or a sliding window: for row b and
// query block i, the first key block any of the block's queries sees. Keys before it are masked
// for all of them, so the block's GEMMs start there (fully masked blocks are
// skipped). Without positions every block starts at key block 0.
class KeySkip {
 public:
  KeySkip(const AttentionDims& d, const CausalBlocks& blk) : count_(blk.count()) {
    if (d.positions == nullptr && d.window == 0) return;
    first_.resize(static_cast<size_t>(d.batch * count_));
    for (int64_t b = 0; b < d.batch; ++b) {
      for (int64_t i = 0; i < count_; ++i) {
        int64_t first = blk.begin(i);
        for (int64_t t = blk.begin(i); t < blk.end(i); ++t) first = std::min(first, d.first_key(b, t));
        first_[static_cast<size_t>(b * count_ + i)] = first / blk.size;
      }
    }
  }
  int64_t at(int64_t b, int64_t i) const {
    return first_.empty() ? 0 : first_[static_cast<size_t>(b * count_ + i)];
  }
  // Whether some row's block i starts at key block j.
  bool used(int64_t i, int64_t j) const {
    if (first_.empty()) return j == 0;
    for (size_t k = static_cast<size_t>(i); k < first_.size(); k += static_cast<size_t>(count_))
      if (first_[k] == j) return true;
    return false;
  }

 private:
  int64_t count_;
  std::vector<int64_t> first_;  // [batch * count]
};

// A GEMM per query block i and first key block j (keys [j*size, end(i))),
// for the pairs a KeySkip uses (j = 0 only without positions: the same
// GEMMs as per_block). make(i, key0) gives the dims.
class BlockMatmuls {
 public:
  template <typename MakeDims>
  BlockMatmuls(CpuContext& ctx, const CausalBlocks& blk, const KeySkip& skip, DType ab, DType c,
               MakeDims make, float alpha = 1.0f)
      : count_(blk.count()), by_start_(static_cast<size_t>(count_ * count_)) {
    for (int64_t i = 0; i < count_; ++i)
      for (int64_t j = 0; j <= i; ++j)
        if (skip.used(i, j))
          by_start_[static_cast<size_t>(i * count_ + j)] =
              std::make_unique<ThreadMatmul>(ctx, make(i, j * blk.size), ab, c, alpha);
  }
  ThreadMatmul& at(int64_t i, int64_t j) { return *by_start_[static_cast<size_t>(i * count_ + j)]; }
  size_t pad() const {
    size_t pad = 0;
    for (const auto& m : by_start_)
      if (m) pad = std::max(pad, m->scratchpad_bytes());
    return pad;
  }

 private:
  int64_t count_;
  std::vector<std::unique_ptr<ThreadMatmul>> by_start_;  // [i * count + j]
};

size_t max_pad(std::initializer_list<const std::vector<ThreadMatmul>*> groups) {
  size_t pad = 0;
  for (const auto* g : groups)
    for (const ThreadMatmul& m : *g) pad = std::max(pad, m.scratchpad_bytes());
  return pad;
}

// scores[rows, key0:end) = q[rows] k[key0:end)^T / sqrt(D), per query block.
BlockMatmuls score_matmuls(CpuContext& ctx, const CausalBlocks& blk, const KeySkip& skip,
                           DType compute, int64_t D) {
  return BlockMatmuls(ctx, blk, skip, compute, DType::f32,
                      [&](int64_t i, int64_t key0) { return score_dims(blk, i, D, compute, key0); },
                      score_scale(D));
}

// The causal softmax probabilities of one (batch, kv head) group, its rep
// query heads stacked as rows: probs_g [rep*T, T], zero above the diagonal
// and before each query's first key (AttentionDims::first_key).
// q_g [rep*T, D], k_g [T, D]; scores: f32 scratch [rep*T, T] (may alias
// probs_g in f32); b: the group's batch row. Scores before a block's first key block are not
// computed (and not read). Forward and the recomputation in backward both
// run this, so recomputed probabilities are bit-identical.
template <typename E>
void group_probs(BlockMatmuls& qk, const CausalBlocks& blk, const KeySkip& skip,
                 const AttentionDims& dims, int64_t b, int tid, const E* q_g, const E* k_g,
                 int64_t rep, int64_t D, float* scores, E* probs_g, void* pad) {
  const int64_t T = blk.seq;
  for (int64_t hh = 0; hh < rep; ++hh) {
    for (int64_t i = 0; i < blk.count(); ++i) {
      const int64_t r0 = hh * T + blk.begin(i), j = skip.at(b, i), key0 = j * blk.size;
      qk.at(i, j).run(tid, q_g + r0 * D, k_g + key0 * D, scores + r0 * T + key0, pad);
    }
  }
  for (int64_t r = 0; r < rep * T; ++r) {
    const int64_t t = r % T;
    softmax_row(scores + r * T, probs_g + r * T, dims.first_key(b, t), t + 1, T);
  }
}

}  // namespace

namespace {

// The attention slot a pass requests: its threads' layout, and never less
// than the unpacked pass's (attention_workspace_bytes), so packed rows that
// skip key blocks leave the slot at the size the memory plan predicts.
size_t unskipped_workspace(const AttentionDims& dims, DType compute, bool recompute_probs,
                           bool backward, size_t per_thread) {
  const int threads = omp_get_max_threads();
  AttentionDims unpacked = dims;
  unpacked.positions = nullptr;
  unpacked.window = 0;
  return std::max(per_thread * static_cast<size_t>(threads),
                  attention_workspace_bytes(unpacked, compute, recompute_probs, backward, threads));
}

}  // namespace

// Work is split by (batch, kv head) group: a thread takes a group and runs its
// GEMMs single-threaded, stacking the group's rep query heads as rows, so the
// group's scores ([rep*T, T]) stay in that core's L2 between the GEMMs and
// the softmax.
void attention_forward(CpuContext& ctx, const AttentionDims& dims, const RopeTable* rope,
                       DType compute, const float* qkv, void* out, AttentionSaved& saved) {
  check_dims(dims, rope, dims.seq);
  const int64_t B = dims.batch, T = dims.seq, H = dims.n_heads, KV = dims.n_kv_heads;
  const int64_t D = dims.head_dim, rep = H / KV;
  MemoryTracker& tracker = ctx.tracker();
  ensure(saved.q, {B, H, T, D}, compute, tracker);
  ensure_saved(saved, {B, KV, T, D}, {B, H, T, T}, compute, tracker);
  const bool keep_probs = !saved.recompute_probs;
  const int64_t esize = static_cast<int64_t>(dtype_size(compute));

  simd::dispatch_store(compute, saved.q.raw(), [&](auto* q) {
    using E = std::remove_pointer_t<decltype(q)>;
    E* k = saved.k.data<E>();
    E* v = saved.v.data<E>();
    E* probs = keep_probs ? saved.probs.data<E>() : nullptr;
    // 1. Split heads into [B, heads, T, D] layouts, rotating q and k.
    split_heads(qkv, B, T, H, KV, D, rope,
                [&](int64_t b, int64_t t) { return dims.position(b, t); }, q, k, v);
    // 2. Per group: scores = q k^T / sqrt(D), causal softmax, out = P v.
    const int64_t M = rep * T;
    const CausalBlocks blk(T);
    const KeySkip skip(dims, blk);
    // scores[rows, key0:end) = q[rows] k[key0:end)^T; out[rows] = P[rows, key0:end) v[key0:end).
    BlockMatmuls qk = score_matmuls(ctx, blk, skip, compute, D);
    BlockMatmuls pv(ctx, blk, skip, compute, compute,
                    [&](int64_t i, int64_t key0) { return output_dims(blk, i, D, key0); });
    const auto pad = static_cast<int64_t>(std::max(qk.pad(), pv.pad()));
    const bool f32 = compute == DType::f32;
    // Without kept probabilities each thread's group lives in its scratch.
    const size_t per_thread = forward_thread_bytes(M, T, D, esize, keep_probs, pad);
    char* base = static_cast<char*>(ctx.impl().scratch(
        Scratch::attention, unskipped_workspace(dims, compute, !keep_probs, false, per_thread)));
    E* o = static_cast<E*>(out);
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < B * KV; ++g) {
      const int tid = omp_get_thread_num();
      Carver mine(base + per_thread * tid);
      float* scores = f32 ? nullptr : mine.take<float>(M * T);
      E* probs_g = keep_probs ? probs + g * M * T : mine.take<E>(M * T);
      E* out_g = mine.take<E>(M * D);
      void* pad_g = mine.take<char>(pad);
      if (f32) scores = reinterpret_cast<float*>(probs_g);
      const int64_t row = g / KV;
      group_probs(qk, blk, skip, dims, row, tid, q + g * M * D, k + g * T * D, rep, D, scores,
                  probs_g, pad_g);
      for (int64_t hh = 0; hh < rep; ++hh) {
        for (int64_t i = 0; i < blk.count(); ++i) {
          const int64_t r0 = hh * T + blk.begin(i), j = skip.at(row, i), key0 = j * blk.size;
          pv.at(i, j).run(tid, probs_g + r0 * T + key0, v + (g * T + key0) * D, out_g + r0 * D,
                          pad_g);
        }
      }
      const int64_t b = g / KV, h0 = (g % KV) * rep;
      for (int64_t r = 0; r < M; ++r)
        std::memcpy(static_cast<void*>(o + ((b * T + r % T) * H + h0 + r / T) * D),
                    static_cast<const void*>(out_g + r * D), D * esize);
    }
  });
}

void attention_backward(CpuContext& ctx, const AttentionDims& dims, const RopeTable* rope,
                        DType compute, const AttentionSaved& saved, const float* d_out, void* d_qkv) {
  check_dims(dims, rope, dims.seq);
  const int64_t B = dims.batch, T = dims.seq, H = dims.n_heads, KV = dims.n_kv_heads;
  const int64_t D = dims.head_dim, rep = H / KV, W = dims.qkv_width(), half = D / 2;
  const bool kept = !saved.recompute_probs;
  MESHTRAIN_CHECK(saved.q.defined() && saved.q.dtype() == compute && saved.q.numel() == B * H * T * D &&
                      (!kept || (saved.probs.defined() && saved.probs.dtype() == compute &&
                                 saved.probs.numel() == B * H * T * T)),
                  "attention_backward: saved tensors do not match dims/compute dtype");
  const float scale = score_scale(D);
  const int64_t esize = static_cast<int64_t>(dtype_size(compute));
  const int64_t M = rep * T;

  simd::dispatch_store(compute, d_qkv, [&](auto* dqkv) {
    using E = std::remove_pointer_t<decltype(dqkv)>;
    const E* q = saved.q.data<E>();
    const E* k = saved.k.data<E>();
    const E* v = saved.v.data<E>();
    const E* probs = kept ? saved.probs.data<E>() : nullptr;
    const CausalBlocks blk(T);
    const KeySkip skip(dims, blk);
    // Recomputation: each group's probabilities again, as in the forward.
    std::optional<BlockMatmuls> qk;
    if (!kept) qk.emplace(score_matmuls(ctx, blk, skip, compute, D));
    // dP = dO v^T (the scores' shape); dQ = dS k (the output's), from the block's first key block.
    BlockMatmuls dp_mm(ctx, blk, skip, compute, DType::f32, [&](int64_t i, int64_t key0) {
      return score_dims(blk, i, D, compute, key0);
    });
    BlockMatmuls dq_mm(ctx, blk, skip, compute, DType::f32,
                       [&](int64_t i, int64_t key0) { return output_dims(blk, i, D, key0); });
    // dK and dV sum over the group's heads (the first head overwrites, the others accumulate).
    auto kv_dims = [&](int64_t i) { return key_grad_dims(blk, i, D); };
    auto dkv_mm = per_block(ctx, blk, compute, DType::f32, kv_dims);
    auto dkv_acc = rep > 1 ? per_block(ctx, blk, compute, DType::f32, kv_dims, 1.0f, true)
                           : std::vector<ThreadMatmul>{};
    const auto pad = static_cast<int64_t>(std::max({max_pad({&dkv_mm, &dkv_acc}), dp_mm.pad(),
                                                    dq_mm.pad(), qk ? qk->pad() : size_t{0}}));
    const bool f32 = compute == DType::f32;
    const size_t per_thread = backward_thread_bytes(M, T, D, esize, kept, pad);
    char* base = static_cast<char*>(ctx.impl().scratch(
        Scratch::attention, unskipped_workspace(dims, compute, !kept, true, per_thread)));
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < B * KV; ++g) {
      const int tid = omp_get_thread_num();
      Carver mine(base + per_thread * tid);
      const BackwardScratch<E> w(mine, M, T, D, pad);
      E* dout_g = w.dout;
      float* dp = w.dp;
      E* ds = w.ds;
      float* dq = w.dq;
      float* dk = w.dk;
      float* dv = w.dv;
      float* tmp = w.tmp;
      void* pad_g = w.pad;
      const int64_t b = g / KV, j = g % KV, h0 = j * rep;
      const E* probs_g = kept ? probs + g * M * T : nullptr;
      if (!kept) {
        // bf16: the f32 scores use dp's space, which dP overwrites next.
        E* recomputed = mine.take<E>(M * T);
        float* scores = f32 ? reinterpret_cast<float*>(recomputed) : dp;
        group_probs(*qk, blk, skip, dims, b, tid, q + g * M * D, k + g * T * D, rep, D, scores,
                    recomputed, pad_g);
        probs_g = recomputed;
      }
      // dO for the group's heads, stacked like q.
      for (int64_t r = 0; r < M; ++r)
        simd::store_row(dout_g + r * D, d_out + ((b * T + r % T) * H + h0 + r / T) * D, D);
      // dP = dO v^T; dS = P (dP - sum(P dP)) * scale over the causal part.
      for (int64_t hh = 0; hh < rep; ++hh) {
        for (int64_t i = 0; i < blk.count(); ++i) {
          const int64_t r0 = hh * T + blk.begin(i), kb = skip.at(b, i), key0 = kb * blk.size;
          dp_mm.at(i, kb).run(tid, dout_g + r0 * D, v + (g * T + key0) * D, dp + r0 * T + key0,
                             pad_g);
        }
      }
      for (int64_t r = 0; r < M; ++r) {
        const int64_t n = r % T + 1;
        softmax_backward_row(dp + r * T, probs_g + r * T, ds + r * T, dims.first_key(b, r % T), n,
                             T, scale);
      }
      // dQ = dS k; dK = dS^T q and dV = P^T dO (these sum over the group's heads).
      for (int64_t hh = 0; hh < rep; ++hh) {
        for (int64_t i = 0; i < blk.count(); ++i) {
          const auto bi = static_cast<size_t>(i);
          const int64_t r0 = hh * T + blk.begin(i), s0 = blk.begin(i);
          const int64_t kb = skip.at(b, i), key0 = kb * blk.size;
          dq_mm.at(i, kb).run(tid, ds + r0 * T + key0, k + (g * T + key0) * D, dq + r0 * D, pad_g);
          ThreadMatmul& kv = hh == 0 ? dkv_mm[bi] : dkv_acc[bi];
          kv.run(tid, ds + r0 * T + s0, q + (g * M + r0) * D, dk + s0 * D, pad_g);
          kv.run(tid, probs_g + r0 * T + s0, dout_g + r0 * D, dv + s0 * D, pad_g);
        }
      }
      // Back to [B, T, (H + 2KV) * D], undoing the rotation.
      for (int64_t r = 0; r < M; ++r) {
        const int64_t t = r % T, p = dims.position(b, t);
        const float* c = rope ? rope->cos.data<float>() + p * half : nullptr;
        const float* s = rope ? rope->sin.data<float>() + p * half : nullptr;
        put_head(dq + r * D, dqkv + (b * T + t) * W + (h0 + r / T) * D, c, s, D, true, tmp);
      }
      for (int64_t t = 0; t < T; ++t) {
        const int64_t p = dims.position(b, t);
        const float* c = rope ? rope->cos.data<float>() + p * half : nullptr;
        const float* s = rope ? rope->sin.data<float>() + p * half : nullptr;
        E* row = dqkv + (b * T + t) * W;
        put_head(dk + t * D, row + (H + j) * D, c, s, D, true, tmp);
        put_head(dv + t * D, row + (H + KV + j) * D, nullptr, nullptr, D, true, tmp);
      }
    }
  });
}

namespace {

// The workspace of a blocked attention pass over `count` query blocks with
// the given GEMMs (block index -> dims), M stacked query rows of a group and
// T keys: the largest GEMM scratchpad, in the kernels' per-thread layout.
// first_overwrites: dK/dV's first head overwrites (then, with more than one
// head per group, the others accumulate); else every head accumulates.
template <typename Score, typename Output, typename KeyGrad>
size_t blocked_workspace_bytes(int64_t count, Score score, Output output, KeyGrad key_grad,
                               bool first_overwrites, int64_t M, int64_t T, int64_t D,
                               DType compute, bool recompute_probs, bool backward, int threads) {
  size_t pad = 0;
  auto take = [&](const MatmulDims& d, DType c, float alpha = 1.0f, bool accumulate = false) {
    pad = std::max(pad, thread_matmul_scratchpad_bytes(d, compute, c, threads, alpha, accumulate));
  };
  for (int64_t i = 0; i < count; ++i) {
    if (!backward || recompute_probs) take(score(i), DType::f32, score_scale(D));
    if (!backward) {
      take(output(i), compute);
      continue;
    }
    take(score(i), DType::f32);
    take(output(i), DType::f32);
    if (first_overwrites) take(key_grad(i), DType::f32);
    if (!first_overwrites || M > T) take(key_grad(i), DType::f32, 1.0f, true);
  }
  const auto e = static_cast<int64_t>(dtype_size(compute));
  const size_t per_thread = backward ? backward_thread_bytes(M, T, D, e, !recompute_probs, pad)
                                     : forward_thread_bytes(M, T, D, e, !recompute_probs, pad);
  return per_thread * static_cast<size_t>(threads);
}

}  // namespace

size_t attention_workspace_bytes(const AttentionDims& dims, DType compute, bool recompute_probs,
                                 bool backward, int threads) {
  check_dims(dims, nullptr, dims.seq);
  const int64_t T = dims.seq, D = dims.head_dim, M = dims.n_heads / dims.n_kv_heads * T;
  const CausalBlocks blk(T);
  // dK and dV: the group's first head overwrites, the others accumulate.
  return blocked_workspace_bytes(
      blk.count(), [&](int64_t i) { return score_dims(blk, i, D, compute); },
      [&](int64_t i) { return output_dims(blk, i, D); },
      [&](int64_t i) { return key_grad_dims(blk, i, D); }, true, M, T, D, compute,
      recompute_probs, backward, threads);
}

// ---- Context-parallel attention (ops::ContextDims).

namespace {

void check_context(const ContextDims& d, const RopeTable* rope) {
  ops::check_context_dims(d, rope);
  const int64_t T = d.seq();
  for (int64_t b = 0; b < d.batch; ++b) {
    for (int64_t i = 0; i < d.local_seq; ++i) {
      const int64_t p = d.positions[b * d.local_seq + i], g = d.split.global(T, i);
      MESHTRAIN_CHECK(p >= 0 && p <= g && (rope == nullptr || p < rope->max_seq),
                      "context attention: position {} of token {} (global {}) in row {} outside "
                      "[0, {}]{}",
                      p, i, g, b, g, rope ? fmt::format(" or the rope table ({})", rope->max_seq) : "");
    }
  }
}

// The GEMMs of one local chunk's query blocks: chunk k (0 or 1) at global
// offset q0 holds queries [q0, q0 + c); query block i multiplies keys [0,
// q0 + end(i)): the keys after its last query are never computed.
struct ContextBlocks {
  ContextBlocks(const ContextDims& d) : blk(d.local_seq / 2), seq(d.seq()) {
    for (int64_t k = 0; k < 2; ++k) q0[k] = d.split.global(seq, k * blk.seq);
  }
  int64_t count() const { return 2 * blk.count(); }
  // Block n = k * blk.count() + i: its first local row, rows and key end.
  int64_t row(int64_t n) const { return (n / blk.count()) * blk.seq + blk.begin(n % blk.count()); }
  int64_t rows(int64_t n) const { return blk.rows(n % blk.count()); }
  int64_t keys(int64_t n) const { return q0[n / blk.count()] + blk.end(n % blk.count()); }
  CausalBlocks blk;
  int64_t seq;
  int64_t q0[2] = {0, 0};
};

// scores / dP [rows, 0:keys) = a[rows] b[0:keys)^T (ldc = T); out / dQ [rows]
// = P[rows, 0:keys) b[0:keys); dK / dV [0:keys) += dS[rows, 0:keys)^T a[rows].
// In bf16 with AMX over every key of the sequence (whole_score_rows says why).
MatmulDims context_score_dims(const ContextBlocks& cb, int64_t n, int64_t D, DType compute) {
  const int64_t keys = whole_score_rows(compute) ? cb.seq : cb.keys(n);
  return MatmulDims{1, cb.rows(n), keys, D, false, true, false, D, D, cb.seq};
}
MatmulDims context_output_dims(const ContextBlocks& cb, int64_t n, int64_t D) {
  return MatmulDims{1, cb.rows(n), D, cb.keys(n), false, false, false, cb.seq, D, D};
}
MatmulDims context_key_grad_dims(const ContextBlocks& cb, int64_t n, int64_t D) {
  return MatmulDims{1, cb.keys(n), D, cb.rows(n), true, false, false, cb.seq, D, D};
}

template <typename MakeDims>
std::vector<ThreadMatmul> per_context_block(CpuContext& ctx, const ContextBlocks& cb, DType ab,
                                            DType c, MakeDims make, float alpha = 1.0f,
                                            bool accumulate = false) {
  std::vector<ThreadMatmul> out;
  out.reserve(static_cast<size_t>(cb.count()));
  for (int64_t n = 0; n < cb.count(); ++n) out.emplace_back(ctx, make(n), ab, c, alpha, accumulate);
  return out;
}

// The probabilities of one (batch, kv head) group, its rep heads' local
// queries stacked as rows (r = head * L + i): probs_g [rep * L, T] over the
// whole sequence's keys, zero outside [g - position, g] (g: the query's
// global index). scores: f32 scratch [rep * L, T] (may alias probs_g in f32).
template <typename E>
void context_group_probs(std::vector<ThreadMatmul>& qk, const ContextBlocks& cb,
                         const ContextDims& d, int64_t b, int tid, const E* q_g, const E* k_g,
                         int64_t rep, float* scores, E* probs_g, void* pad) {
  const int64_t L = d.local_seq, T = cb.seq, D = d.head_dim;
  for (int64_t hh = 0; hh < rep; ++hh) {
    for (int64_t n = 0; n < cb.count(); ++n) {
      const int64_t r0 = hh * L + cb.row(n);
      qk[static_cast<size_t>(n)].run(tid, q_g + r0 * D, k_g, scores + r0 * T, pad);
    }
  }
  for (int64_t r = 0; r < rep * L; ++r) {
    const int64_t i = r % L, g = d.split.global(T, i);
    softmax_row(scores + r * T, probs_g + r * T, g - d.positions[b * L + i], g + 1, T);
  }
}

// One rank's packed k (or v) block [B][KV][L][D] <-> rows of the whole
// sequence's [B][KV][T][D]; to_whole = false copies the other way.
template <typename E>
void move_rank_rows(const ContextDims& d, int64_t rank, E* packed, E* whole, bool to_whole) {
  const ContextSplit split{rank, d.split.size};
  const int64_t L = d.local_seq, c = L / 2, T = d.seq(), D = d.head_dim;
  const size_t bytes = static_cast<size_t>(c * D) * sizeof(E);
  for (int64_t g = 0; g < d.batch * d.n_kv_heads; ++g) {
    for (int64_t k = 0; k < 2; ++k) {
      E* p = packed + (g * L + k * c) * D;
      E* w = whole + (g * T + split.global(T, k * c)) * D;
      std::memcpy(to_whole ? static_cast<void*>(w) : static_cast<void*>(p),
                  to_whole ? static_cast<const void*>(p) : static_cast<const void*>(w), bytes);
    }
  }
}

}  // namespace

void context_attention_project(CpuContext& ctx, const ContextDims& dims, const RopeTable* rope,
                               DType compute, const float* qkv, AttentionSaved& saved,
                               void* kv_send) {
  check_context(dims, rope);
  const int64_t B = dims.batch, L = dims.local_seq, H = dims.n_heads, KV = dims.n_kv_heads;
  const int64_t D = dims.head_dim;
  ensure(saved.q, {B, H, L, D}, compute, ctx.tracker());
  simd::dispatch_store(compute, saved.q.raw(), [&](auto* q) {
    using E = std::remove_pointer_t<decltype(q)>;
    E* k = static_cast<E*>(kv_send);
    split_heads(qkv, B, L, H, KV, D, rope,
                [&](int64_t b, int64_t t) { return dims.positions[b * L + t]; }, q, k,
                k + B * KV * L * D);
  });
}

void context_attention_forward(CpuContext& ctx, const ContextDims& dims, DType compute,
                               const void* kv_all, AttentionSaved& saved, void* out) {
  check_context(dims, nullptr);
  const int64_t B = dims.batch, L = dims.local_seq, H = dims.n_heads, KV = dims.n_kv_heads;
  const int64_t D = dims.head_dim, rep = H / KV, T = dims.seq(), M = rep * L;
  MemoryTracker& tracker = ctx.tracker();
  MESHTRAIN_CHECK(saved.q.defined() && saved.q.dtype() == compute && saved.q.numel() == B * H * L * D,
                  "context attention: run project first (saved q does not match)");
  ensure_saved(saved, {B, KV, T, D}, {B, H, L, T}, compute, tracker);
  const bool keep_probs = !saved.recompute_probs;
  const int64_t esize = static_cast<int64_t>(dtype_size(compute));
  simd::dispatch_store(compute, saved.k.raw(), [&](auto* k) {
    using E = std::remove_pointer_t<decltype(k)>;
    E* v = saved.v.data<E>();
    const E* q = saved.q.data<E>();
    // 1. Every rank's k and v into the whole sequence's rows.
    const int64_t block = dims.kv_block(), half_block = block / 2;
    auto* all = const_cast<E*>(static_cast<const E*>(kv_all));
#pragma omp parallel for schedule(static)
    for (int64_t rank = 0; rank < dims.split.size; ++rank) {
      move_rank_rows(dims, rank, all + rank * block, k, true);
      move_rank_rows(dims, rank, all + rank * block + half_block, v, true);
    }
    // 2. Per group: scores over the whole sequence, masked softmax, out = P v.
    const ContextBlocks cb(dims);
    auto qk = per_context_block(ctx, cb, compute, DType::f32,
                                [&](int64_t n) { return context_score_dims(cb, n, D, compute); },
                                score_scale(D));
    auto pv = per_context_block(ctx, cb, compute, compute,
                                [&](int64_t n) { return context_output_dims(cb, n, D); });
    const auto pad = static_cast<int64_t>(max_pad({&qk, &pv}));
    const bool f32 = compute == DType::f32;
    const size_t per_thread = forward_thread_bytes(M, T, D, esize, keep_probs, pad);
    char* base = static_cast<char*>(
        ctx.impl().scratch(Scratch::attention, per_thread * static_cast<size_t>(omp_get_max_threads())));
    E* probs = keep_probs ? saved.probs.data<E>() : nullptr;
    E* o = static_cast<E*>(out);
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < B * KV; ++g) {
      const int tid = omp_get_thread_num();
      Carver mine(base + per_thread * tid);
      float* scores = f32 ? nullptr : mine.take<float>(M * T);
      E* probs_g = keep_probs ? probs + g * M * T : mine.take<E>(M * T);
      E* out_g = mine.take<E>(M * D);
      void* pad_g = mine.take<char>(pad);
      if (f32) scores = reinterpret_cast<float*>(probs_g);
      const int64_t b = g / KV, h0 = (g % KV) * rep;
      context_group_probs(qk, cb, dims, b, tid, q + g * M * D, k + g * T * D, rep, scores, probs_g,
                          pad_g);
      for (int64_t hh = 0; hh < rep; ++hh) {
        for (int64_t n = 0; n < cb.count(); ++n) {
          const int64_t r0 = hh * L + cb.row(n);
          pv[static_cast<size_t>(n)].run(tid, probs_g + r0 * T, v + g * T * D, out_g + r0 * D,
                                         pad_g);
        }
      }
      for (int64_t r = 0; r < M; ++r)
        std::memcpy(static_cast<void*>(o + ((b * L + r % L) * H + h0 + r / L) * D),
                    static_cast<const void*>(out_g + r * D), static_cast<size_t>(D * esize));
    }
  });
}

void context_attention_backward(CpuContext& ctx, const ContextDims& dims, const RopeTable* rope,
                                DType compute, const AttentionSaved& saved, const float* d_out,
                                void* d_qkv, float* dkv_all) {
  check_context(dims, rope);
  const int64_t B = dims.batch, L = dims.local_seq, H = dims.n_heads, KV = dims.n_kv_heads;
  const int64_t D = dims.head_dim, rep = H / KV, T = dims.seq(), M = rep * L, half = D / 2;
  const int64_t W = dims.qkv_width();
  const bool kept = !saved.recompute_probs;
  MESHTRAIN_CHECK(saved.q.defined() && saved.q.dtype() == compute && saved.q.numel() == B * H * L * D &&
                      saved.k.defined() && saved.k.numel() == B * KV * T * D &&
                      (!kept || (saved.probs.defined() && saved.probs.dtype() == compute &&
                                 saved.probs.numel() == B * H * L * T)),
                  "context attention backward: saved tensors do not match dims/compute dtype");
  const float scale = score_scale(D);
  const int64_t esize = static_cast<int64_t>(dtype_size(compute));
  simd::dispatch_store(compute, d_qkv, [&](auto* dqkv) {
    using E = std::remove_pointer_t<decltype(dqkv)>;
    const E* q = saved.q.data<E>();
    const E* k = saved.k.data<E>();
    const E* v = saved.v.data<E>();
    const E* probs = kept ? saved.probs.data<E>() : nullptr;
    const ContextBlocks cb(dims);
    std::vector<ThreadMatmul> qk;
    if (!kept) {
      qk = per_context_block(ctx, cb, compute, DType::f32,
                             [&](int64_t n) { return context_score_dims(cb, n, D, compute); },
                             score_scale(D));
    }
    auto dp_mm = per_context_block(ctx, cb, compute, DType::f32,
                                   [&](int64_t n) { return context_score_dims(cb, n, D, compute); });
    auto dq_mm = per_context_block(ctx, cb, compute, DType::f32,
                                   [&](int64_t n) { return context_output_dims(cb, n, D); });
    auto dkv_mm = per_context_block(ctx, cb, compute, DType::f32,
                                    [&](int64_t n) { return context_key_grad_dims(cb, n, D); },
                                    1.0f, true);
    const auto pad = static_cast<int64_t>(max_pad({&qk, &dp_mm, &dq_mm, &dkv_mm}));
    const bool f32 = compute == DType::f32;
    const size_t per_thread = backward_thread_bytes(M, T, D, esize, kept, pad);
    char* base = static_cast<char*>(
        ctx.impl().scratch(Scratch::attention, per_thread * static_cast<size_t>(omp_get_max_threads())));
    const int64_t block = dims.kv_block(), half_block = block / 2;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < B * KV; ++g) {
      const int tid = omp_get_thread_num();
      Carver mine(base + per_thread * tid);
      const BackwardScratch<E> w(mine, M, T, D, pad);
      E* dout_g = w.dout;
      float* dp = w.dp;
      E* ds = w.ds;
      float* dq = w.dq;
      float* dk = w.dk;
      float* dv = w.dv;
      float* tmp = w.tmp;
      void* pad_g = w.pad;
      const int64_t b = g / KV, h0 = (g % KV) * rep;
      const E* probs_g = kept ? probs + g * M * T : nullptr;
      if (!kept) {
        E* recomputed = mine.take<E>(M * T);
        float* scores = f32 ? reinterpret_cast<float*>(recomputed) : dp;
        context_group_probs(qk, cb, dims, b, tid, q + g * M * D, k + g * T * D, rep, scores,
                            recomputed, pad_g);
        probs_g = recomputed;
      }
      for (int64_t r = 0; r < M; ++r)
        simd::store_row(dout_g + r * D, d_out + ((b * L + r % L) * H + h0 + r / L) * D, D);
      for (int64_t hh = 0; hh < rep; ++hh) {
        for (int64_t n = 0; n < cb.count(); ++n) {
          const int64_t r0 = hh * L + cb.row(n);
          dp_mm[static_cast<size_t>(n)].run(tid, dout_g + r0 * D, v + g * T * D, dp + r0 * T, pad_g);
        }
      }
      for (int64_t r = 0; r < M; ++r) {
        const int64_t i = r % L, gi = dims.split.global(T, i);
        softmax_backward_row(dp + r * T, probs_g + r * T, ds + r * T,
                             gi - dims.positions[b * L + i], gi + 1, T, scale);
      }
      std::memset(dk, 0, static_cast<size_t>(T * D) * sizeof(float));
      std::memset(dv, 0, static_cast<size_t>(T * D) * sizeof(float));
      for (int64_t hh = 0; hh < rep; ++hh) {
        for (int64_t n = 0; n < cb.count(); ++n) {
          const auto bn = static_cast<size_t>(n);
          const int64_t r0 = hh * L + cb.row(n);
          dq_mm[bn].run(tid, ds + r0 * T, k + g * T * D, dq + r0 * D, pad_g);
          dkv_mm[bn].run(tid, ds + r0 * T, q + (g * M + r0) * D, dk, pad_g);
          dkv_mm[bn].run(tid, probs_g + r0 * T, dout_g + r0 * D, dv, pad_g);
        }
      }
      // dQ into d_qkv's q columns, undoing the rotation.
      for (int64_t r = 0; r < M; ++r) {
        const int64_t i = r % L, p = dims.positions[b * L + i];
        const float* c = rope ? rope->cos.data<float>() + p * half : nullptr;
        const float* s = rope ? rope->sin.data<float>() + p * half : nullptr;
        put_head(dq + r * D, dqkv + (b * L + i) * W + (h0 + r / L) * D, c, s, D, true, tmp);
      }
      // This group's dK, dV rows to their owners' blocks (g's rows of each).
      for (int64_t rank = 0; rank < dims.split.size; ++rank) {
        ContextDims one = dims;
        one.batch = 1;
        one.n_kv_heads = 1;
        const int64_t at = (g * L) * D;
        move_rank_rows(one, rank, dkv_all + rank * block + at, dk, false);
        move_rank_rows(one, rank, dkv_all + rank * block + half_block + at, dv, false);
      }
    }
  });
}

size_t context_attention_workspace_bytes(const ContextDims& dims, DType compute,
                                         bool recompute_probs, bool backward, int threads) {
  const int64_t T = dims.seq(), D = dims.head_dim;
  const int64_t M = dims.n_heads / dims.n_kv_heads * dims.local_seq;
  const ContextBlocks cb(dims);
  // dK and dV accumulate into zeroed buffers.
  return blocked_workspace_bytes(
      cb.count(), [&](int64_t n) { return context_score_dims(cb, n, D, compute); },
      [&](int64_t n) { return context_output_dims(cb, n, D); },
      [&](int64_t n) { return context_key_grad_dims(cb, n, D); }, false, M, T, D, compute,
      recompute_probs, backward, threads);
}

void context_attention_finish(CpuContext& /*ctx*/, const ContextDims& dims, const RopeTable* rope,
                              DType compute, const float* dkv, const float* dq, void* d_qkv) {
  check_context(dims, rope);
  const int64_t B = dims.batch, L = dims.local_seq, H = dims.n_heads, KV = dims.n_kv_heads;
  const int64_t D = dims.head_dim, W = dims.qkv_width(), half = D / 2;
  const float* dk = dkv;
  const float* dv = dkv + dims.kv_block() / 2;
  simd::dispatch_store(compute, d_qkv, [&](auto* dqkv) {
#pragma omp parallel
    {
      std::vector<float> tmp(static_cast<size_t>(D));
#pragma omp for schedule(static)
      for (int64_t bt = 0; bt < B * L; ++bt) {
        const int64_t b = bt / L, i = bt % L, p = dims.positions[bt];
        const float* c = rope ? rope->cos.data<float>() + p * half : nullptr;
        const float* s = rope ? rope->sin.data<float>() + p * half : nullptr;
        auto* row = dqkv + bt * W;
        for (int64_t h = 0; dq != nullptr && h < H; ++h)
          put_head(dq + ((b * H + h) * L + i) * D, row + h * D, c, s, D, true, tmp.data());
        for (int64_t j = 0; j < KV; ++j) {
          const int64_t at = ((b * KV + j) * L + i) * D;
          put_head(dk + at, row + (H + j) * D, c, s, D, true, tmp.data());
          put_head(dv + at, row + (H + KV + j) * D, nullptr, nullptr, D, true, tmp.data());
        }
      }
    }
  });
}

// ---- Ring attention: one rank's k/v block at a time.

namespace {

// A tile of `rows` of a group's rep x local query rows against `keys` of a
// block's L local keys (rows of the scores L apart): scores (and dP) [rows,
// keys] = a b^T; out (and dQ) [rows, D] += P b; dK (and dV) [keys, D] +=
// dS^T a.
MatmulDims ring_score_dims(int64_t rows, int64_t keys, int64_t L, int64_t D) {
  return MatmulDims{1, rows, keys, D, false, true, false, D, D, L};
}
MatmulDims ring_output_dims(int64_t rows, int64_t keys, int64_t L, int64_t D) {
  return MatmulDims{1, rows, D, keys, false, false, false, L, D, D};
}
MatmulDims ring_key_grad_dims(int64_t rows, int64_t keys, int64_t L, int64_t D) {
  return MatmulDims{1, keys, D, rows, true, false, false, L, D, D};
}

// A group's M query rows in tiles of at most 128, so a thread's scores are
// [128, L] whatever the sequence (flash attention's row blocks).
struct RingTiles {
  explicit RingTiles(int64_t rows) : M(rows), size(std::min<int64_t>(rows, 128)) {}
  int64_t count() const { return (M + size - 1) / size; }
  int64_t begin(int64_t t) const { return t * size; }
  int64_t rows(int64_t t) const { return std::min(size, M - t * size); }
  int64_t rest() const { return M % size; }  // the last tile's rows, 0 when all are full
  int64_t M, size;
};

// The keys of a block a tile of queries sees: one of its chunks or both
// (the block's local keys are in global order), or none (keys = 0).
struct KeySpan {
  int64_t first = 0, keys = 0;
};

// A GEMM per tile height (full tiles, the shorter last one) and key span
// (one chunk of the block, c keys, or both, L).
class TileMatmul {
 public:
  template <typename MakeDims>
  TileMatmul(CpuContext& ctx, const RingTiles& tiles, int64_t L, DType ab, MakeDims make,
             float alpha = 1.0f, bool accumulate = false)
      : size_(tiles.size), L_(L) {
    for (int64_t rows : {tiles.size, tiles.rest()}) {
      for (int64_t keys : {L / 2, L}) {
        if (rows > 0) {
          gemms_.emplace_back(std::make_unique<ThreadMatmul>(ctx, make(rows, keys), ab, DType::f32,
                                                             alpha, accumulate));
        } else {
          gemms_.emplace_back();
        }
      }
    }
  }
  ThreadMatmul& at(int64_t rows, int64_t keys) {
    return *gemms_[static_cast<size_t>((rows == size_ ? 0 : 2) + (keys == L_ ? 1 : 0))];
  }
  size_t pad() const {
    size_t pad = 0;
    for (const auto& g : gemms_)
      if (g) pad = std::max(pad, g->scratchpad_bytes());
    return pad;
  }

 private:
  int64_t size_, L_;
  std::vector<std::unique_ptr<ThreadMatmul>> gemms_;  // [full, rest] x [one chunk, both]
};

// One thread's scratch: f32 scores (P in f32), P in 16 bits of a tile;
// backward adds dP (f32) and dS in 16 bits of a tile and the group's dO;
// then the GEMMs' scratchpad.
size_t ring_thread_bytes(int64_t tile, int64_t M, int64_t L, int64_t D, int64_t e, bool backward,
                         size_t pad) {
  const int64_t narrow = e == 4 ? 0 : tile * L * e;
  if (!backward) return Carver::bytes({tile * L * 4, narrow, static_cast<int64_t>(pad)});
  return Carver::bytes(
      {tile * L * 4, narrow, tile * L * 4, narrow, M * D * e, static_cast<int64_t>(pad)});
}

// Local query i of row b sees the keys of `block`'s tokens whose global
// index is within [the query's record start, the query]: in each of the
// block's two chunks one contiguous range of its local keys, [lo, hi).
struct RingMask {
  const ContextDims& d;
  ContextSplit keys;
  int64_t seq;
  struct Ranges {
    int64_t lo[2], hi[2];
  };
  Ranges visible(int64_t b, int64_t i) const {
    const int64_t g = d.split.global(seq, i), first = g - d.positions[b * d.local_seq + i];
    const int64_t c = d.local_seq / 2;
    Ranges r{};
    for (int64_t k = 0; k < 2; ++k) {
      const int64_t k0 = keys.global(seq, k * c);  // the chunk's first global index
      r.lo[k] = k * c + std::clamp<int64_t>(first - k0, 0, c);
      r.hi[k] = std::max(r.lo[k], k * c + std::clamp<int64_t>(g - k0 + 1, 0, c));
    }
    return r;
  }
  // The block's keys any of a group's query rows [r0, r0 + rows) sees
  // (row r is local token r % local_seq): chunk 0, chunk 1, both or none;
  // with `whole` (bf16 with AMX, whole_score_rows says why) the whole block once any is seen.
  KeySpan tile_keys(int64_t b, int64_t r0, int64_t rows, bool whole) const {
    bool chunk[2] = {false, false};
    for (int64_t r = r0; r < r0 + rows; ++r) {
      const Ranges v = visible(b, r % d.local_seq);
      for (int64_t k = 0; k < 2; ++k) chunk[k] = chunk[k] || v.hi[k] > v.lo[k];
    }
    const int64_t c = d.local_seq / 2;
    if (!chunk[0] && !chunk[1]) return {};
    if (whole || (chunk[0] && chunk[1])) return {0, 2 * c};
    return chunk[0] ? KeySpan{0, c} : KeySpan{c, c};
  }
};

// Zeroes row[0, n) outside the ranges.
inline void zero_outside(float* row, int64_t n, const RingMask::Ranges& v) {
  int64_t at = 0;
  for (int64_t k = 0; k < 2; ++k) {
    std::fill(row + at, row + v.lo[k], 0.0f);
    at = v.hi[k];
  }
  std::fill(row + at, row + n, 0.0f);
}

}  // namespace

void ring_attention_forward_block(CpuContext& ctx, const ContextDims& dims, DType compute,
                                  int64_t block_rank, const void* kv_block,
                                  const AttentionSaved& saved, RingState& state, bool first) {
  check_context(dims, nullptr);
  const int64_t B = dims.batch, L = dims.local_seq, H = dims.n_heads, KV = dims.n_kv_heads;
  const int64_t D = dims.head_dim, rep = H / KV, M = rep * L;
  MESHTRAIN_CHECK(
      saved.q.defined() && saved.q.dtype() == compute && saved.q.numel() == B * H * L * D,
      "ring attention: run project first (saved q does not match)");
  MESHTRAIN_CHECK(block_rank >= 0 && block_rank < dims.split.size, "ring attention: block {} of {}",
                  block_rank, dims.split.size);
  MemoryTracker& tracker = ctx.tracker();
  if (first) {
    // Scratch of the forward (workspace), reused by every layer.
    auto scratch = [&](Tensor& t, const Shape& shape) {
      if (!t.defined() || t.shape() != shape)
        t = Tensor(shape, DType::f32, MemCategory::workspace, tracker);
    };
    scratch(state.max, {B, H, L});
    scratch(state.sum, {B, H, L});
    scratch(state.acc, {B, H, L, D});
    std::fill_n(state.max.data<float>(), B * H * L, -std::numeric_limits<float>::infinity());
    std::fill_n(state.sum.data<float>(), B * H * L, 0.0f);
    std::fill_n(state.acc.data<float>(), B * H * L * D, 0.0f);
  }
  const RingMask mask{dims, ContextSplit{block_rank, dims.split.size}, dims.seq()};
  const int64_t esize = static_cast<int64_t>(dtype_size(compute));
  simd::dispatch_store(compute, const_cast<void*>(kv_block), [&](auto* kb) {
    using E = std::remove_pointer_t<decltype(kb)>;
    const E* k = kb;
    const E* v = kb + dims.kv_block() / 2;
    const E* q = saved.q.data<E>();
    const RingTiles tiles(M);
    TileMatmul qk(
        ctx, tiles, L, compute,
        [&](int64_t n, int64_t keys) { return ring_score_dims(n, keys, L, D); }, score_scale(D));
    TileMatmul pv(
        ctx, tiles, L, compute,
        [&](int64_t n, int64_t keys) { return ring_output_dims(n, keys, L, D); }, 1.0f, true);
    const size_t pad = std::max(qk.pad(), pv.pad());
    const bool f32 = compute == DType::f32;
    const size_t per_thread = ring_thread_bytes(tiles.size, M, L, D, esize, false, pad);
    char* base = static_cast<char*>(ctx.impl().scratch(
        Scratch::attention, per_thread * static_cast<size_t>(omp_get_max_threads())));
    float* mx = state.max.data<float>();
    float* sum = state.sum.data<float>();
    float* acc = state.acc.data<float>();
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < B * KV; ++g) {
      const int tid = omp_get_thread_num();
      Carver mine(base + per_thread * tid);
      float* scores = mine.take<float>(tiles.size * L);
      E* probs = f32 ? reinterpret_cast<E*>(scores) : mine.take<E>(tiles.size * L);
      void* pad_g = mine.take<char>(static_cast<int64_t>(pad));
      const int64_t b = g / KV;
      for (int64_t t = 0; t < tiles.count(); ++t) {
        const int64_t r0 = tiles.begin(t), n = tiles.rows(t);
        const KeySpan span = mask.tile_keys(b, r0, n, whole_score_rows(compute));
        if (span.keys == 0) continue;  // the block is after (or before) every query of the tile
        const int64_t j0 = span.first;
        qk.at(n, span.keys).run(tid, q + (g * M + r0) * D, k + (g * L + j0) * D, scores + j0, pad_g);
        for (int64_t r = 0; r < n; ++r) {
          const int64_t i = (r0 + r) % L, at = g * M + r0 + r;
          float* s = scores + r * L;
          const RingMask::Ranges vis = mask.visible(b, i);
          float best = -std::numeric_limits<float>::infinity();
          for (int64_t part = 0; part < 2; ++part) {
            const int64_t lo = vis.lo[part], len = vis.hi[part] - lo;
            if (len > 0) best = std::max(best, simd::max_of(s + lo, len));
          }
          if (best == -std::numeric_limits<float>::infinity()) {  // nothing of this block visible
            std::fill_n(s, L, 0.0f);
          } else {
            const float m = std::max(mx[at], best), alpha = std::exp(mx[at] - m);
            float total = 0;
            for (int64_t part = 0; part < 2; ++part) {
              const int64_t lo = vis.lo[part], len = vis.hi[part] - lo;
              if (len > 0) total += simd::exp_shift_sum(s + lo, len, m);
            }
            zero_outside(s, L, vis);
            sum[at] = sum[at] * alpha + total;
            mx[at] = m;
            float* a = acc + at * D;
#pragma omp simd
            for (int64_t x = 0; x < D; ++x) a[x] *= alpha;
          }
          if (!f32) simd::store_row(probs + r * L, s, L);
        }
        pv.at(n, span.keys).run(tid, probs + j0, v + (g * L + j0) * D, acc + (g * M + r0) * D,
                                pad_g);
      }
    }
  });
}

void ring_attention_forward_finish(CpuContext& ctx, const ContextDims& dims, DType compute,
                                   RingState& state, AttentionSaved& saved, void* out) {
  const int64_t B = dims.batch, L = dims.local_seq, H = dims.n_heads, D = dims.head_dim;
  ensure(saved.lse, {B, H, L}, DType::f32, ctx.tracker());
  const float* mx = state.max.data<float>();
  const float* sum = state.sum.data<float>();
  const float* acc = state.acc.data<float>();
  float* lse = saved.lse.data<float>();
  simd::dispatch_store(compute, out, [&](auto* o) {
#pragma omp parallel
    {
      std::vector<float> row(static_cast<size_t>(D));
#pragma omp for schedule(static)
      for (int64_t at = 0; at < B * H * L; ++at) {
        const int64_t b = at / (H * L), h = (at / L) % H, i = at % L;
        const float inv = 1.0f / sum[at];
        for (int64_t x = 0; x < D; ++x) row[static_cast<size_t>(x)] = acc[at * D + x] * inv;
        simd::store_row(o + ((b * L + i) * H + h) * D, row.data(), D);
        lse[at] = mx[at] + std::log(sum[at]);
      }
    }
  });
}

void ring_attention_backward_block(CpuContext& ctx, const ContextDims& dims, DType compute,
                                   int64_t block_rank, const void* kv_block,
                                   const AttentionSaved& saved, const float* d_out, const void* out,
                                   float* dq, float* dkv_block) {
  check_context(dims, nullptr);
  const int64_t B = dims.batch, L = dims.local_seq, H = dims.n_heads, KV = dims.n_kv_heads;
  const int64_t D = dims.head_dim, rep = H / KV, M = rep * L;
  MESHTRAIN_CHECK(
      saved.lse.defined() && saved.lse.numel() == B * H * L && saved.q.dtype() == compute,
      "ring attention backward: saved tensors do not match dims/compute dtype");
  const RingMask mask{dims, ContextSplit{block_rank, dims.split.size}, dims.seq()};
  const float scale = score_scale(D);
  const int64_t esize = static_cast<int64_t>(dtype_size(compute));
  simd::dispatch_store(compute, const_cast<void*>(kv_block), [&](auto* kb) {
    using E = std::remove_pointer_t<decltype(kb)>;
    const E* k = kb;
    const E* v = kb + dims.kv_block() / 2;
    const E* q = saved.q.data<E>();
    const E* o = static_cast<const E*>(out);
    const float* lse = saved.lse.data<float>();
    const RingTiles tiles(M);
    auto scores = [&](int64_t n, int64_t keys) { return ring_score_dims(n, keys, L, D); };
    TileMatmul qk(ctx, tiles, L, compute, scores, scale);
    TileMatmul dp_mm(ctx, tiles, L, compute, scores);
    TileMatmul dq_mm(
        ctx, tiles, L, compute,
        [&](int64_t n, int64_t keys) { return ring_output_dims(n, keys, L, D); }, 1.0f, true);
    TileMatmul dkv_mm(
        ctx, tiles, L, compute,
        [&](int64_t n, int64_t keys) { return ring_key_grad_dims(n, keys, L, D); }, 1.0f, true);
    const size_t pad = std::max({qk.pad(), dp_mm.pad(), dq_mm.pad(), dkv_mm.pad()});
    const bool f32 = compute == DType::f32;
    const size_t per_thread = ring_thread_bytes(tiles.size, M, L, D, esize, true, pad);
    char* base = static_cast<char*>(ctx.impl().scratch(
        Scratch::attention, per_thread * static_cast<size_t>(omp_get_max_threads())));
    float* dk = dkv_block;
    float* dv = dkv_block + dims.kv_block() / 2;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < B * KV; ++g) {
      const int tid = omp_get_thread_num();
      Carver mine(base + per_thread * tid);
      float* p = mine.take<float>(tiles.size * L);
      E* p_e = f32 ? reinterpret_cast<E*>(p) : mine.take<E>(tiles.size * L);
      float* dp = mine.take<float>(tiles.size * L);
      E* ds = f32 ? reinterpret_cast<E*>(dp) : mine.take<E>(tiles.size * L);
      E* dout_g = mine.take<E>(M * D);
      void* pad_g = mine.take<char>(static_cast<int64_t>(pad));
      const int64_t b = g / KV, h0 = (g % KV) * rep;
      for (int64_t r = 0; r < M; ++r)
        simd::store_row(dout_g + r * D, d_out + ((b * L + r % L) * H + h0 + r / L) * D, D);
      for (int64_t t = 0; t < tiles.count(); ++t) {
        const int64_t r0 = tiles.begin(t), n = tiles.rows(t);
        const KeySpan span = mask.tile_keys(b, r0, n, whole_score_rows(compute));
        if (span.keys == 0) continue;
        const int64_t j0 = span.first, j1 = j0 + span.keys;
        qk.at(n, span.keys).run(tid, q + (g * M + r0) * D, k + (g * L + j0) * D, p + j0, pad_g);
        dp_mm.at(n, span.keys).run(tid, dout_g + r0 * D, v + (g * L + j0) * D, dp + j0, pad_g);
        for (int64_t r = 0; r < n; ++r) {
          const int64_t i = (r0 + r) % L, h = h0 + (r0 + r) / L;
          // D_r = dO . O over the row (the probabilities of every block sum to 1).
          const float* dor = d_out + ((b * L + i) * H + h) * D;
          const E* orow = o + ((b * L + i) * H + h) * D;
          float delta = 0;
          for (int64_t x = 0; x < D; ++x) delta += dor[x] * simd::load1(orow + x);
          const float l = lse[g * M + r0 + r];
          float* pr = p + r * L;
          float* dpr = dp + r * L;
          const RingMask::Ranges vis = mask.visible(b, i);
          for (int64_t part = 0; part < 2; ++part) {
            const int64_t lo = vis.lo[part], len = vis.hi[part] - lo;
            if (len > 0) simd::exp_shift_sum(pr + lo, len, l);
          }
          zero_outside(pr, L, vis);
          // Only the span's keys were computed (and are read by the GEMMs below).
#pragma omp simd
          for (int64_t j = j0; j < j1; ++j) dpr[j] = pr[j] * (dpr[j] - delta) * scale;
          if (!f32) {
            simd::store_row(p_e + r * L + j0, pr + j0, span.keys);
            simd::store_row(ds + r * L + j0, dpr + j0, span.keys);
          }
        }
        dq_mm.at(n, span.keys).run(tid, ds + j0, k + (g * L + j0) * D, dq + (g * M + r0) * D, pad_g);
        dkv_mm.at(n, span.keys).run(tid, ds + j0, q + (g * M + r0) * D, dk + (g * L + j0) * D,
                                    pad_g);
        dkv_mm.at(n, span.keys).run(tid, p_e + j0, dout_g + r0 * D, dv + (g * L + j0) * D, pad_g);
      }
    }
  });
}

size_t ring_attention_workspace_bytes(const ContextDims& dims, DType compute, bool backward,
                                      int threads) {
  const int64_t L = dims.local_seq, D = dims.head_dim, M = dims.n_heads / dims.n_kv_heads * L;
  const RingTiles tiles(M);
  size_t pad = 0;
  for (int64_t n : {tiles.size, tiles.rest()}) {
    for (int64_t keys : {L / 2, L}) {
      if (n == 0) continue;
      auto take = [&](const MatmulDims& d, float alpha = 1.0f, bool accumulate = false) {
        pad = std::max(pad, thread_matmul_scratchpad_bytes(d, compute, DType::f32, threads, alpha,
                                                           accumulate));
      };
      take(ring_score_dims(n, keys, L, D), score_scale(D));
      if (!backward) {
        take(ring_output_dims(n, keys, L, D), 1.0f, true);
      } else {
        take(ring_score_dims(n, keys, L, D));
        take(ring_output_dims(n, keys, L, D), 1.0f, true);
        take(ring_key_grad_dims(n, keys, L, D), 1.0f, true);
      }
    }
  }
  const auto e = static_cast<int64_t>(dtype_size(compute));
  return ring_thread_bytes(tiles.size, M, L, D, e, backward, pad) * static_cast<size_t>(threads);
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
  // Each query attends over [first, pos]: from 0, or its window's first key.
#pragma omp parallel
  {
    std::vector<float> qr(static_cast<size_t>(D)), sc(static_cast<size_t>(pos0 + T));
#pragma omp for schedule(static) collapse(2)
    for (int64_t bt = 0; bt < B * T; ++bt) {
      for (int64_t h = 0; h < H; ++h) {
        const int64_t b = bt / T, pos = pos0 + bt % T, j = h / rep;
        const int64_t first = dims.window > 0 ? std::max<int64_t>(0, pos - dims.window + 1) : 0;
        const float* qsrc = qkv + bt * W + h * D;
        if (rope != nullptr) {
          rotate(rope->cos.data<float>() + pos * half, rope->sin.data<float>() + pos * half, qsrc,
                 qr.data(), half, false);
        } else {
          std::memcpy(qr.data(), qsrc, static_cast<size_t>(D) * sizeof(float));
        }
        const float* kh = kc + (b * KV + j) * S * D;
        const float* vh = vc + (b * KV + j) * S * D;
        for (int64_t s = first; s <= pos; ++s) {
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += qr[d] * kh[s * D + d];
          sc[s] = dot * scale;
        }
        const float mx = simd::max_of(sc.data() + first, pos + 1 - first);
        const float inv = 1.0f / simd::exp_shift_sum(sc.data() + first, pos + 1 - first, mx);
        float* o = out + bt * H * D + h * D;
        std::fill(o, o + D, 0.0f);
        for (int64_t s = first; s <= pos; ++s) {
          const float p = sc[s] * inv;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) o[d] += p * vh[s * D + d];
        }
      }
    }
  }
}

}  // namespace meshtrain::cpu
