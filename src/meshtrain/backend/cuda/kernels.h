// The CUDA backend's kernels as host functions that launch them on a stream
// (the .cu files of this folder). Plain pointers and sizes: the backend
// (cuda_backend.cpp) checks arguments and owns memory; these only launch.
// Every reduction runs in a fixed order, so results do not depend on timing.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "meshtrain/backend/cuda/math.h"
#include "meshtrain/backend/routing.h"

namespace meshtrain::cuda {

// The float element types, in DType's order (tensor/dtype.h).
enum class Elem : uint8_t { f32, bf16, f16 };

// ---- elementwise (elementwise.cu)
void launch_convert(cudaStream_t s, Elem from, const void* src, Elem to, void* dst, int64_t n);
void launch_add_inplace(cudaStream_t s, float* x, const float* y, int64_t n);
void launch_mul_inplace(cudaStream_t s, float* x, const float* y, int64_t n);
void launch_add_product(cudaStream_t s, float* x, const float* a, const float* b, int64_t n);
void launch_residual_add(cudaStream_t s, const float* residual, const float* y, const float* bias,
                         float* out, int64_t rows, int64_t n);
// dbias[j] += sum over rows, in row order.
void launch_bias_backward(cudaStream_t s, const float* dy, float* dbias, int64_t rows, int64_t n);
void launch_swiglu_forward(cudaStream_t s, const float* gate_up, Elem out_dtype, void* out,
                           int64_t rows, int64_t hidden);
void launch_swiglu_backward(cudaStream_t s, const float* gate_up, const float* d_out,
                            Elem grad_dtype, void* d_gate_up, int64_t rows, int64_t hidden);
void launch_gelu_forward(cudaStream_t s, const float* x, Elem out_dtype, void* y, int64_t n);
void launch_gelu_backward(cudaStream_t s, const float* x, const float* dy, Elem grad_dtype,
                          void* dx, int64_t n);
// clear_grad: grad is left at 0 (ops::AdamWHyper::clear_grad).
void launch_adamw(cudaStream_t s, const math::AdamWStep& step, float* param, float* grad,
                  bool clear_grad, float* m, float* v, Elem copy_dtype, void* copy, int64_t n);
// sum of x^2 in double: fixed blocks of the input, each summed in a fixed
// tree, then the blocks in a fixed tree: the bits depend on n only.
int64_t sum_squares_partials(int64_t n);
void launch_sum_squares(cudaStream_t s, const float* x, int64_t n, double* partials,
                        double* total);

// ---- norms (norm.cu); backward ADDS into dx, dw, db.
void launch_rmsnorm_forward(cudaStream_t s, const float* x, const float* w, Elem out_dtype,
                            void* y, float* rstd, int64_t rows, int64_t dim, float eps);
void launch_rmsnorm_backward(cudaStream_t s, const float* x, const float* w, const float* rstd,
                             const float* dy, float* dx, float* dw, int64_t rows, int64_t dim);
void launch_layernorm_forward(cudaStream_t s, const float* x, const float* w, const float* b,
                              Elem out_dtype, void* y, float* mean, float* rstd, int64_t rows,
                              int64_t dim, float eps);
void launch_layernorm_backward(cudaStream_t s, const float* x, const float* w, const float* mean,
                               const float* rstd, const float* dy, float* dx, float* dw,
                               float* db, int64_t rows, int64_t dim);
// The residual add fused with the norm of its sum (Backend::residual_add_norm):
// sum = residual + (y + bias) written as the norm reads it; ops::NormArgs'
// fields for the norm.
struct ResidualNorm {
  bool layer_norm = false;  // LayerNorm (w, b, mean), else RMSNorm (w)
  const float* residual = nullptr;
  const float* y = nullptr;
  const float* bias = nullptr;
  float* sum = nullptr;
  const float* w = nullptr;
  const float* b = nullptr;
  float* mean = nullptr;
  float* rstd = nullptr;
  float eps = 0;
};
void launch_residual_add_norm(cudaStream_t s, const ResidualNorm& args, Elem out_dtype, void* out,
                              int64_t rows, int64_t dim);
// QK-norm: groups of `width` within the first `count` of each row, rows
// `stride` apart (ops::GroupNormDims).
struct GroupNorm {
  int64_t rows = 0, stride = 0, count = 0, width = 0;
  float eps = 0;
};
void launch_group_rmsnorm_forward(cudaStream_t s, const GroupNorm& g, float* x, const float* w,
                                  float* saved, float* rstd);
void launch_group_rmsnorm_backward(cudaStream_t s, const GroupNorm& g, const float* saved,
                                   const float* w, const float* rstd, Elem grad_dtype, void* dy,
                                   float* dw);

// ---- embeddings (embedding.cu). Backward: the tokens grouped by the row they
// add to (on the host): group r adds dout[order[starts[r]..starts[r+1])] to
// row rows[r] of `table`, in token order (no atomics).
struct EmbeddingShape {
  int64_t batch = 0, seq = 0, dim = 0, pos0 = 0;
  int64_t vocab_begin = 0, vocab_end = 0;
  const int32_t* pos_ids = nullptr;  // device, or nullptr
};
void launch_embedding_forward(cudaStream_t s, const EmbeddingShape& e, const void* table,
                              Elem table_dtype, const float* positions, const int32_t* ids,
                              float* out);
void launch_add_rows(cudaStream_t s, const int32_t* order, const int32_t* starts,
                     const int32_t* rows, int64_t groups, const float* dout, int64_t dim,
                     float* table);

// ---- attention (attention.cu): causal GQA with optional record positions
// and sliding window, q [B, H, Q, D], k and v [B, KV, T, D] in `e`, where T =
// seq and Q = queries: the whole sequence (queries 0), or under context
// parallelism (cp_size > 1) the Q local tokens of rank cp_rank, local token
// i at math::context_global(T, cp_rank, cp_size, i) of the sequence.
struct AttentionShape {
  int64_t batch = 0, seq = 0, heads = 0, kv_heads = 0, head_dim = 0, window = 0;
  const int32_t* positions = nullptr;  // device [B * Q], or nullptr (position = index)
  float scale = 1;                     // 1 / sqrt(head_dim)
  int64_t queries = 0, cp_rank = 0, cp_size = 1;
  MESHTRAIN_HD int64_t query_rows() const { return queries > 0 ? queries : seq; }
};
// qkv [B, T, (H + 2KV) D] f32 -> q, k (rotated when cos is given), v.
void launch_attention_split(cudaStream_t s, const AttentionShape& a, const float* qkv,
                            const float* cos, const float* sin, Elem e, void* q, void* k, void* v);
// The bytes of dynamic shared memory a row kernel needs (its static part,
// the block reductions' scratch, is at most kStaticSharedBytes more).
inline constexpr size_t kStaticSharedBytes = 64;
size_t attention_shared_bytes(const AttentionShape& a);
// out [B, T, H D] in e; probs [B, H, T, T] in e (nullptr: not kept).
void launch_attention_forward(cudaStream_t s, const AttentionShape& a, Elem e, const void* q,
                              const void* k, const void* v, void* probs, void* out);
// From the kept probabilities (or, probs nullptr, the forward's recomputed
// into p_work [B, H, T, T] f32): ds_work [B, H, T, T] f32 = dS, then dq [B,
// H, T, D], dk and dv [B, KV, T, D] f32 (overwritten).
void launch_attention_backward(cudaStream_t s, const AttentionShape& a, Elem e, const void* q,
                               const void* k, const void* v, const void* probs, float* p_work,
                               const float* d_out, float* ds_work, float* dq, float* dk,
                               float* dv);
// dq, dk (rotated back when cos is given) and dv -> d_qkv [B, T, (H + 2KV) D]
// in e: the head slots [slot_begin, slot_end) of each row (q heads, then k,
// then v; slot_end -1: all), the others left as they are.
void launch_attention_merge(cudaStream_t s, const AttentionShape& a, const float* dq,
                            const float* dk, const float* dv, const float* cos, const float* sin,
                            Elem e, void* d_qkv, int64_t slot_begin = 0, int64_t slot_end = -1);

// Context parallelism's blocks: `size` ranks' packed k and v, each
// [2][groups][L][D] (groups = B KV; `bytes` per element) <-> the whole
// sequence's rows of k and v [groups][size L][D]; to_whole false: back.
void launch_context_rows(cudaStream_t s, int64_t groups, int64_t L, int64_t D, int64_t size,
                         size_t bytes, void* packed, void* whole_k, void* whole_v, bool to_whole);
// Ring attention (a: the context shape, Q = L local queries): the local
// queries q [B, H, L, D] against rank block_rank's keys k, v [B, KV, L, D],
// merged into the running max, sum [B, H, L] and unnormalised output acc
// [B, H, L, D] f32 (first: the first block, which sets them).
void launch_ring_forward_block(cudaStream_t s, const AttentionShape& a, int64_t block_rank,
                               Elem e, const void* q, const void* k, const void* v, float* max,
                               float* sum, float* acc, bool first);
// out [B, L, H D] in e = acc / sum; lse [B, H, L] = max + log(sum).
void launch_ring_forward_finish(cudaStream_t s, const AttentionShape& a, Elem e, const float* max,
                                const float* sum, const float* acc, void* out, float* lse);
// One block's share of backward, probabilities recomputed from lse: dq [B,
// H, L, D], dk and dv [B, KV, L, D] f32 accumulated. The local queries go in
// tiles of ring_backward_tile(a) (kRingTile, or L when fewer), each tile's P
// and dS in p_work and ds_work [B, H, tile, L] f32 scratch. d_out [B, L, H D]
// f32, out the forward's (in e).
inline constexpr int64_t kRingTile = 128;
int64_t ring_backward_tile(const AttentionShape& a);
void launch_ring_backward_block(cudaStream_t s, const AttentionShape& a, int64_t block_rank,
                                Elem e, const void* q, const void* k, const void* v,
                                const float* lse, const float* d_out, const void* out,
                                float* p_work, float* ds_work, float* dq, float* dk, float* dv);
// Decoding (a.seq = the new tokens, at positions [pos0, pos0 + seq)): their k
// (rotated) and v appended to the caches k, v [B, KV, S, D] f32, then each
// query over the keys [0 or its window's first, its position]; qkv [B, seq,
// (H + 2KV) D] f32, out [B, seq, H D] f32.
size_t decode_shared_bytes(const AttentionShape& a, int64_t pos0);
void launch_attention_decode(cudaStream_t s, const AttentionShape& a, const float* qkv,
                             const float* cos, const float* sin, int64_t pos0, int64_t S,
                             float* k_cache, float* v_cache, float* out);

// ---- the classifier's rows (classifier.cu): over logits [rows, ld] f32 (the
// first `valid` columns real, column j the vocabulary's offset + j), each
// row's loss lse - logit[target] in double into losses[rows] (0 for an
// ignored target < 0) and, when d_logits is given, (softmax - onehot) *
// grad_scale * row_weights[r] in grad_dtype (0 in the padding columns and
// for ignored rows). With `stats` (the vocabulary-parallel form) the row's
// max, exp-sum and target logit are the whole vocabulary's, read from
// stats: max [rows], then sums [2 * rows] = exp-sums | target logits, as
// launch_classifier_stats leaves them once the ranks' values are combined.
struct ClassifierRows {
  int64_t rows = 0, ld = 0, valid = 0, offset = 0;
  const int32_t* targets = nullptr;
  float grad_scale = 0;
  const float* row_weights = nullptr;
  const float* stats = nullptr;
};
void launch_classifier_rows(cudaStream_t s, const ClassifierRows& c, const float* logits,
                            double* losses, Elem grad_dtype, void* d_logits);
// The vocabulary-parallel statistics of this slice, in stats [3 * rows]
// (max | exp-sums | target logits): exp_sums false: each row's max and its
// target's logit (0 where the target is another slice's); true: each row's
// sum of exp(logit - max) with the max already combined over the slices.
void launch_classifier_stats(cudaStream_t s, const ClassifierRows& c, const float* logits,
                             float* stats, bool exp_sums);

// ---- mixture of experts (moe.cu): one thread per token for the router
// (backend/routing.h, experts <= kMaxExperts: its scratch is per thread);
// the dispatch's permute, gathers and combine backward without atomics (each
// permuted row belongs to one slot). The sort and capacity run on the host
// (ops::sort_slots, ops::apply_capacity).
inline constexpr int64_t kMaxExperts = 512;
void launch_router_forward(cudaStream_t s, const routing::Params& p, int64_t tokens,
                           const float* logits, float* probs, int32_t* indices, float* weights,
                           float* lse);
void launch_router_backward(cudaStream_t s, const routing::Params& p, int64_t tokens,
                            const float* probs, const int32_t* indices, const float* d_weights,
                            const float* score_grad, float z, const float* lse, float* d_logits);
// y [slots, dim] in out_dtype: row r = x[slot_of_row[r] / top_k].
void launch_moe_permute(cudaStream_t s, int64_t slots, int64_t top_k, int64_t dim,
                        const int32_t* slot_of_row, const float* x, Elem out_dtype, void* y);
// out [tokens, dim] = sum over j of (weights ? weights[t, j] : 1) y[rows[t, j]] (rows < 0 skipped).
void launch_moe_gather_sum(cudaStream_t s, int64_t tokens, int64_t top_k, int64_t dim,
                           const int32_t* rows, const float* weights, const float* y, float* out);
// d_y[rows[t, j]] = weights[t, j] d_out[t] in grad_dtype; d_weights[t, j] = <d_out[t], y[rows[t, j]]>.
void launch_moe_combine_backward(cudaStream_t s, int64_t tokens, int64_t top_k, int64_t dim,
                                 const int32_t* rows, const float* weights, const float* y,
                                 const float* d_out, Elem grad_dtype, void* d_y, float* d_weights);

// ---- NF4 (quant.cu): a packed buffer (tensor/nf4.h's Layout, offsets in
// bytes; -1 where the form has no such piece) to n values in `to`, each
// NF4[q] * absmax rounded once: bit for bit nf4::dequantize (no fused
// multiply-adds: the products and sums are rounded one by one, as bitsandbytes').
struct Nf4Tables {
  float levels[16];
  float dynamic[256];
};
struct Nf4Layout {
  int64_t n = 0, scales_at = -1, offset_at = -1, codes_at = -1, absmax_at = -1, packed_at = 0;
};
void launch_dequantize_nf4(cudaStream_t s, const Nf4Tables& tables, const Nf4Layout& layout,
                           const void* packed, Elem to, void* y);

}  // namespace meshtrain::cuda
