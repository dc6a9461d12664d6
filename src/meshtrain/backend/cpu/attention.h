// Causal multi-head attention with grouped-query heads and (optionally)
// rotary position embeddings over interleaved pairs (x[2i], x[2i+1]), as in
// Meta's Llama and llama2.c.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "meshtrain/backend/cpu/context.h"
#include "meshtrain/tensor/tensor.h"

namespace meshtrain::cpu {

struct AttentionDims {
  int64_t batch = 0, seq = 0;
  int64_t n_heads = 0, n_kv_heads = 0, head_dim = 0;
  // Packed sequences (SFT): [batch * seq] each token's position within its
  // record, restarting at 0 where a record begins (0 <= positions[t] <= t).
  // Query t attends keys [t - positions[t], t] only (causal AND same record)
  // and RoPE rotates by positions[t]. nullptr: one sequence per row (position t).
  const int32_t* positions = nullptr;
  int64_t qkv_width() const { return (n_heads + 2 * n_kv_heads) * head_dim; }
  int64_t position(int64_t b, int64_t t) const { return positions ? positions[b * seq + t] : t; }
};

// cos/sin of position p and pair i: [max_seq, head_dim/2].
struct RopeTable {
  Tensor cos, sin;
  int64_t head_dim = 0, max_seq = 0;
};
// Unscaled inverse frequencies theta^(-2i/head_dim), i < head_dim / 2, in float
// in the order of Meta's precompute_freqs_cis, so angles match PyTorch's.
std::vector<float> rope_inv_freq(int64_t head_dim, float theta);
RopeTable make_rope_table(int64_t head_dim, int64_t max_seq, float theta, MemoryTracker& tracker);
// The table for given inverse frequencies [head_dim / 2] (a scaled RoPE):
// angle(p, i) = p * inv_freq[i] in float.
RopeTable make_rope_table(int64_t head_dim, int64_t max_seq, std::span<const float> inv_freq,
                          MemoryTracker& tracker);

// Rotates [rows, n_heads, head_dim] in place; position of row r is pos0 + r % seq.
// inverse = true applies the transpose rotation (the backward pass).
void rope_apply(const RopeTable& rope, float* x, int64_t rows, int64_t seq, int64_t n_heads,
                int64_t head_dim, int64_t pos0, bool inverse);

// What the backward pass needs, allocated by attention_forward (category activations).
// Reused across calls when shapes and dtype match (no reallocation per step).
// recompute_probs (selective activation checkpointing): forward does not keep
// probs (frees it); backward recomputes each (batch, kv head) group's
// probabilities from q and k in its thread's scratch with the forward's
// kernels, so the gradients are bit-identical and no [B, H, T, T] tensor lives.
struct AttentionSaved {
  Tensor q, k, v;  // post-RoPE, compute dtype: q [B, H, T, D], k and v [B, KV, T, D]
  Tensor probs;    // softmax probabilities [B, H, T, T], compute dtype, zero above the diagonal
  bool recompute_probs = false;
};

// qkv: [B, T, (H + 2*KV)*D] f32, each row = [q heads | k heads | v heads].
// out: [B, T, H*D] in `compute` dtype. rope == nullptr means no rotation (GPT-2).
void attention_forward(CpuContext& ctx, const AttentionDims& dims, const RopeTable* rope,
                       DType compute, const float* qkv, void* out, AttentionSaved& saved);
// d_out: [B, T, H*D] f32. d_qkv: [B, T, (H + 2*KV)*D] in `compute` dtype (overwritten).
void attention_backward(CpuContext& ctx, const AttentionDims& dims, const RopeTable* rope,
                        DType compute, const AttentionSaved& saved, const float* d_out, void* d_qkv);

// The workspace (bytes; the context's `attention` slot, grown, never shrunk)
// attention_forward (backward = false) or attention_backward takes with
// `threads` OpenMP threads: per thread, one (batch, kv head) group's f32
// scores, its probabilities when they are recomputed, its output (forward) or
// gradients (backward), and its GEMMs' largest scratchpad; the kernels carve
// their buffer by the same per-thread layout.
size_t attention_workspace_bytes(const AttentionDims& dims, DType compute, bool recompute_probs,
                                 bool backward, int threads);

// Incremental decoding. The cache holds post-RoPE k and v for positions [0, len).
struct KVCacheLayer {
  Tensor k, v;  // [B, KV, max_seq, D] f32
};
// qkv: [B, T_new, qkv_width] f32 for positions [pos0, pos0 + T_new); appends to the cache,
// attends causally over [0, pos0 + t]; out: [B, T_new, H*D] f32.
void attention_decode(CpuContext& ctx, const AttentionDims& dims, const RopeTable* rope,
                      const float* qkv, int64_t pos0, KVCacheLayer& cache, float* out);

}  // namespace meshtrain::cpu
