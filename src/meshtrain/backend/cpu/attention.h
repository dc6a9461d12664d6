// Causal multi-head attention with grouped-query heads and (optionally)
// rotary position embeddings over interleaved pairs (x[2i], x[2i+1]), as in
// Meta's Llama and llama2.c.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "meshtrain/backend/cpu/context.h"
#include "meshtrain/backend/ops.h"
#include "meshtrain/tensor/tensor.h"

namespace meshtrain::cpu {

using ops::AttentionDims;

using ops::rope_inv_freq;
using ops::RopeTable;
RopeTable make_rope_table(int64_t head_dim, int64_t max_seq, float theta, MemoryTracker& tracker);
// The table for given inverse frequencies [head_dim / 2] (a scaled RoPE):
// angle(p, i) = p * inv_freq[i] in float.
RopeTable make_rope_table(int64_t head_dim, int64_t max_seq, std::span<const float> inv_freq,
                          MemoryTracker& tracker);

// Rotates [rows, n_heads, head_dim] in place; position of row r is pos0 + r % seq.
// inverse = true applies the transpose rotation (the backward pass).
void rope_apply(const RopeTable& rope, float* x, int64_t rows, int64_t seq, int64_t n_heads,
                int64_t head_dim, int64_t pos0, bool inverse);

using ops::AttentionSaved;

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

// Context-parallel attention (ops::ContextDims, backend.h): project, forward
// over the all-gathered k/v blocks, backward to the blocks' gradients,
// finish with this rank's (reduce-scattered) block.
using ops::ContextDims;
void context_attention_project(CpuContext& ctx, const ContextDims& dims, const RopeTable* rope,
                               DType compute, const float* qkv, AttentionSaved& saved,
                               void* kv_send);
void context_attention_forward(CpuContext& ctx, const ContextDims& dims, DType compute,
                               const void* kv_all, AttentionSaved& saved, void* out);
void context_attention_backward(CpuContext& ctx, const ContextDims& dims, const RopeTable* rope,
                                DType compute, const AttentionSaved& saved, const float* d_out,
                                void* d_qkv, float* dkv_all);
void context_attention_finish(CpuContext& ctx, const ContextDims& dims, const RopeTable* rope,
                              DType compute, const float* dkv, const float* dq, void* d_qkv);
// Ring attention (backend.h): one rank's k/v block at a time.
using ops::RingState;
void ring_attention_forward_block(CpuContext& ctx, const ContextDims& dims, DType compute,
                                  int64_t block_rank, const void* kv_block,
                                  const AttentionSaved& saved, RingState& state, bool first);
void ring_attention_forward_finish(CpuContext& ctx, const ContextDims& dims, DType compute,
                                   RingState& state, AttentionSaved& saved, void* out);
void ring_attention_backward_block(CpuContext& ctx, const ContextDims& dims, DType compute,
                                   int64_t block_rank, const void* kv_block,
                                   const AttentionSaved& saved, const float* d_out,
                                   const void* out, float* dq, float* dkv_block);
// Per thread: the ring kernels' scratch (forward or backward), bytes.
size_t ring_attention_workspace_bytes(const ContextDims& dims, DType compute, bool backward,
                                      int threads);
// The workspace (bytes, the `attention` slot) context_attention_forward or
// _backward takes: attention_workspace_bytes's layout over rep x local rows
// and the whole sequence's keys (dims.positions not read).
size_t context_attention_workspace_bytes(const ContextDims& dims, DType compute,
                                         bool recompute_probs, bool backward, int threads);

using ops::KVCacheLayer;
// qkv: [B, T_new, qkv_width] f32 for positions [pos0, pos0 + T_new); appends to the cache,
// attends causally over [0, pos0 + t]; out: [B, T_new, H*D] f32.
void attention_decode(CpuContext& ctx, const AttentionDims& dims, const RopeTable* rope,
                      const float* qkv, int64_t pos0, KVCacheLayer& cache, float* out);

}  // namespace meshtrain::cpu
