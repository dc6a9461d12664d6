// The ops layer's argument types: the shapes, dtypes and options of every
// operation the model, the optimizer and the parallel modes ask a Backend for
// (backend.h). Plain data, no device code: a backend folder implements the
// operations over these, and `meshtrain ops test` holds each implementation to
// the float64 reference (docs/ARCHITECTURE.md#how-to-add-a-backend).
// Pointers in these structs are device pointers of the backend that runs the op.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <span>
#include <vector>

#include "meshtrain/tensor/dtype.h"
#include "meshtrain/tensor/tensor.h"
#include "meshtrain/util/context_split.h"

namespace meshtrain::ops {

// C[b] = alpha * op(A[b]) · op(B[b]) (+ bias[n]) (+ C[b] when accumulating).
struct MatmulDims {
  int64_t batch = 1;
  int64_t m = 0, n = 0, k = 0;
  bool trans_a = false;      // A stored [k, m] instead of [m, k]
  bool trans_b = false;      // B stored [n, k] instead of [k, n] (nn.Linear weights)
  bool broadcast_b = false;  // one B shared by every batch
  // Leading dimensions (elements between rows as stored); 0 = dense. batch 1 only.
  int64_t lda = 0, ldb = 0, ldc = 0;
};

// A grouped matmul (an MoE layer's experts; torch._grouped_mm): one GEMM
// per group g over its `sizes[g]` consecutive rows of the grouped operands
// (row offsets are the prefix sums of sizes; a group of 0 rows is skipped).
//  - along m: the groups split M. C[rows_g] = alpha * A[rows_g] · op(B_g)
//    (+ C[rows_g]), A [rows, k], C [rows, n] (ldc 0: dense, else its row
//    stride), B_g = B + g * k * n ([n, k] when trans_b, else [k, n]).
//  - along k: the groups split K. C_g = alpha * A[rows_g]^T · B[rows_g] (+ C_g),
//    A [rows, m], B [rows, n], C_g = C + g * m * n ([m, n]).
// `max_rows` bounds sum(sizes): the rows the grouped buffers hold. The
// workspace depends on it, not on the sizes, so it is fixed for a buffer.
struct GroupedMatmulDims {
  std::vector<int32_t> sizes = {};  // host memory
  bool along_k = false;
  int64_t m = 0, n = 0, k = 0;  // the one the groups split is ignored
  bool trans_b = false;          // along m only
  int64_t ldc = 0;               // along m only
  int64_t max_rows = 0;
};

// The workspace one matmul takes beyond its operands (bytes): the library's
// scratchpad and, where a dtype is staged through f32, the staging copies.
struct MatmulWorkspace {
  size_t scratchpad = 0, f16_staging = 0;
};

// The workspace the fused classifier takes over `rows` rows: its GEMMs' (as
// MatmulWorkspace) and its own buffers (logits chunk, 16-bit d_logits, d(W)^T).
struct ClassifierWorkspace {
  MatmulWorkspace gemms;
  size_t buffers = 0;
};

// The workspace the start-up matmul peak probe takes: its operands and result
// while it runs, and what its GEMMs leave in the backend's workspace slots.
struct PeakProbeWorkspace {
  size_t operands = 0;
  MatmulWorkspace slots;
};

// Causal multi-head attention with grouped-query heads.
struct AttentionDims {
  int64_t batch = 0, seq = 0;
  int64_t n_heads = 0, n_kv_heads = 0, head_dim = 0;
  // Packed sequences (SFT): [batch * seq] each token's position within its
  // record, restarting at 0 where a record begins (0 <= positions[t] <= t).
  // Query t attends keys [t - positions[t], t] only (causal AND same record)
  // and RoPE rotates by positions[t]. nullptr: one sequence per row (position t).
  const int32_t* positions = nullptr;
  // Sliding-window attention (Mistral): a query sees at most the `window`
  // latest keys, itself included (Hugging Face's sliding_window); 0: no limit.
  int64_t window = 0;
  int64_t qkv_width() const { return (n_heads + 2 * n_kv_heads) * head_dim; }
  int64_t position(int64_t b, int64_t t) const { return positions ? positions[b * seq + t] : t; }
  // The first key query t of row b sees (its last is t).
  int64_t first_key(int64_t b, int64_t t) const {
    const int64_t first = t - position(b, t);
    return window > 0 ? std::max(first, t - window + 1) : first;
  }
};

// Context-parallel attention (parallel.cp): a rank's queries are its local
// tokens, chunks of a longer sequence (util/context_split.h), and its keys
// and values the whole sequence's. The kernels run in three steps around the
// cp group's collectives (model/block.cpp): project (q kept, this rank's k
// and v packed to send) -> all-gather -> attend; and in backward attend's
// backward (dQ, and every rank's dK/dV partial sums packed rank-major) ->
// reduce-scatter -> finish (this rank's dK, dV into d_qkv).
struct ContextDims {
  int64_t batch = 0, local_seq = 0;  // local_seq: this rank's tokens per row
  int64_t n_heads = 0, n_kv_heads = 0, head_dim = 0;
  ContextSplit split;                // this rank of the cp group
  // [batch * local_seq] each local token's position: RoPE (and learned
  // positions) use it, and local token i attends keys [g - positions[i], g]
  // where g = split.global(seq(), i): record-local positions in packed rows,
  // g itself otherwise. Required.
  const int32_t* positions = nullptr;
  int64_t seq() const { return local_seq * split.size; }
  int64_t qkv_width() const { return (n_heads + 2 * n_kv_heads) * head_dim; }
  // Elements of one rank's packed k and v ([2][batch][kv heads][local_seq][head_dim]).
  int64_t kv_block() const { return 2 * batch * n_kv_heads * local_seq * head_dim; }
};

// Throws Error naming what is wrong with `d`'s sizes, its rank of the group
// (two chunks of local_seq / 2 tokens each), missing positions or a rope
// table of another head width (rope may be nullptr). The positions
// themselves are each backend's to check where it can read them.
struct RopeTable;
void check_context_dims(const ContextDims& d, const RopeTable* rope);

// Ulysses (cp_comm = "alltoall") moves rows between two layouts around its
// all-to-alls: this rank's tokens with every head, and the whole sequence
// with one head group. HeadGroups: a row of `width` values made of parts
// (q | k | v, or the attention output), each part split evenly into
// `groups` column slices; group g is the concatenation of every part's g-th
// slice ([groups][rows][width / groups] when grouped).
struct HeadGroups {
  int64_t rows = 0, groups = 1;
  std::vector<int64_t> parts;  // each part's width (a multiple of groups)
  int64_t width() const {
    int64_t w = 0;
    for (int64_t p : parts) w += p;
    return w;
  }
};

// One strided copy of data movement: `rows` rows of `bytes` bytes each, from
// src + src_offset (rows src_pitch bytes apart) to dst + dst_offset (dst_pitch
// apart). Ulysses' layouts are lists of these that every backend runs with its
// own copy (the CPU: memcpy; CUDA: cudaMemcpy2DAsync), so the lists, made and
// checked once here, are what the CPU tests check for every backend.
struct Copy2D {
  int64_t src_offset = 0, dst_offset = 0, bytes = 0, rows = 1, src_pitch = 0, dst_pitch = 0;
};
struct CopyPlan {
  std::vector<Copy2D> copies;
  const void* src = nullptr;
  void* dst = nullptr;
};
// Backend::head_groups' copies (rows -> groups when to_groups, else back);
// throws Error for a part that does not split into g.groups.
CopyPlan head_group_copies(const HeadGroups& g, DType dtype, const void* rows, void* groups,
                           bool to_groups);
// Backend::context_sequence's copies (by rank -> sequence when to_sequence,
// else back): each rank's rows of one batch row in runs of consecutive
// sequence positions.
CopyPlan context_sequence_copies(const ContextDims& dims, int64_t width, DType dtype,
                                 const void* by_rank, void* sequence, bool to_sequence);

// Which norm Backend::residual_add_norm applies to the sum it writes, its
// parameters and the statistics it saves (as rmsnorm_forward /
// layernorm_forward: rstd [rows], and LayerNorm's mean [rows]).
struct NormArgs {
  bool layer_norm = false;  // LayerNorm (w, b, mean), else RMSNorm (w)
  const float* w = nullptr;
  const float* b = nullptr;
  float* mean = nullptr;
  float* rstd = nullptr;
  float eps = 1e-5f;
};

// RMSNorm over groups of a strided f32 matrix (QK-norm, config.h QkNorm):
// each of `rows` rows, `stride` values apart, has its first `count` values
// normalised `width` at a time (a head's head_dim, or the whole
// projection), each group with the same weight [width].
struct GroupNormDims {
  int64_t rows = 0, stride = 0, count = 0, width = 0;
  float eps = 1e-6f;
  int64_t groups() const { return count / width; }  // per row
};

// Token embeddings, learned positions optional. ids [batch * seq]; the table
// holds the vocabulary slice [vocab_begin, vocab_end) (a tensor-parallel rank
// holds one): ids outside it read zero rows and send no gradient. Token i's
// position row is pos0 + i % seq, or pos_ids[i] when given (packed records).
struct EmbeddingDims {
  int64_t batch = 0, seq = 0, dim = 0;
  int64_t pos0 = 0;
  const int32_t* pos_ids = nullptr;
  int64_t vocab_begin = 0, vocab_end = std::numeric_limits<int64_t>::max();
  int64_t position(int64_t i) const { return pos_ids ? pos_ids[i] : pos0 + i % seq; }
  bool holds(int64_t id) const { return id >= vocab_begin && id < vocab_end; }
};

// RoPE over interleaved pairs (x[2i], x[2i+1]), as in Meta's Llama and
// llama2.c: cos/sin of position p and pair i, [max_seq, head_dim/2].
struct RopeTable {
  Tensor cos, sin;
  int64_t head_dim = 0, max_seq = 0;
};

// Unscaled inverse frequencies theta^(-2i/head_dim), i < head_dim / 2, in float
// in the order of Meta's precompute_freqs_cis, so angles match PyTorch's.
std::vector<float> rope_inv_freq(int64_t head_dim, float theta);

// A RopeTable's values in host memory: cos and sin [max_seq, inv_freq.size()]
// of the float angle p * inv_freq[i] (every backend's table, whatever memory
// it then lives in). Checks head_dim == 2 * inv_freq.size() and max_seq > 0.
void rope_table_values(int64_t head_dim, int64_t max_seq, std::span<const float> inv_freq,
                       float* cos, float* sin);

// What attention's backward needs, allocated by attention_forward (category
// activations), reused across calls when shapes and dtype match.
// recompute_probs (selective activation checkpointing): forward does not keep
// probs; backward recomputes each (batch, kv head) group's probabilities from
// q and k with the forward's kernels, so the gradients are bit-identical.
// Under context parallelism (ContextDims) q is [B, H, local, D] and, with
// the all-gather, k and v the whole sequence's and probs [B, H, local, seq];
// in the ring k holds this rank's packed k/v block and lse the queries'
// log-sum-exp (no probabilities: backward recomputes them block by block).
struct AttentionSaved {
  Tensor q, k, v;  // post-RoPE, compute dtype: q [B, H, T, D], k and v [B, KV, T, D]
  Tensor probs;    // softmax probabilities [B, H, T, T], compute dtype, zero above the diagonal
  Tensor lse;      // ring: f32 [B, H, local]; a fused kernel's (CUDA's cuDNN path) [B, H, T]
  Tensor out;      // a fused kernel's output [B, T, H, D], compute dtype, for its backward
  bool recompute_probs = false;
};

// A fused attention kernel's bytes (BackendKind::fused_attention): what
// forward keeps in AttentionSaved beside q, k and v, and the workspace of one
// forward and of one backward call.
struct FusedAttentionBytes {
  size_t saved = 0, forward_workspace = 0, backward_workspace = 0;
};

// Ring attention's running softmax of the local queries over the blocks seen
// so far (flash attention's online softmax): per query row its score max and
// exp-sum, f32 [B, H, local], and its unnormalised output f32 [B, H, local, D].
struct RingState {
  Tensor max, sum, acc;
};

// Incremental decoding: post-RoPE k and v for positions [0, len).
struct KVCacheLayer {
  Tensor k, v;  // [B, KV, max_seq, D] f32
};

// The output layer fused with softmax cross-entropy and its backward: logits
// h · W^T a chunk of rows at a time, never a [tokens x vocab] buffer.
struct ClassifierArgs {
  int64_t rows = 0, dim = 0, vocab = 0;
  DType compute = DType::f32;   // dtype of h and w
  const void* h = nullptr;      // [rows, dim]
  const void* w = nullptr;      // [vocab, dim] (the embedding layout)
  const int32_t* targets = nullptr;  // [rows]; a negative target is ignored (no loss, no grad)
  float grad_scale = 0.0f;      // d(total loss)/d(row loss), e.g. 1/(tokens in the step)
  // Optional [rows]: row r's d(total loss)/d(row loss) is grad_scale *
  // row_weights[r] (any sign; preference losses weigh each response's tokens).
  const float* row_weights = nullptr;
  float* dh = nullptr;          // [rows, dim] f32, overwritten; nullptr = no backward
  float* dw = nullptr;          // [vocab, dim] f32, accumulated; nullptr = no backward
  float* row_losses = nullptr;  // optional [rows]
  int64_t chunk_rows = 0;       // rows per logits chunk; 0 = the backend's default
  // Vocab parallel: w holds rows [vocab_offset, vocab_offset + vocab) of a
  // vocab_total-row output layer, of which the first vocab_valid are real (the
  // rest is padding: excluded from the softmax, zero gradient). reduce_max and
  // reduce_sum combine per-row values in place over the ranks holding the
  // other slices, so full-vocabulary logits never exist on one rank. dh is
  // then this slice's partial sum. Defaults: one rank, the whole vocabulary.
  int64_t vocab_offset = 0, vocab_valid = -1, vocab_total = 0;
  std::function<void(float* values, int64_t n)> reduce_max = nullptr, reduce_sum = nullptr;
};

// Mixture-of-experts routing (Megatron-Core's TopKRouter): from a token's
// router logits [experts] (f32 whatever the precision), its scores p
// (softmax over the experts, or an elementwise sigmoid), the top_k experts by
// p + bias (bias: a per-expert selection bias that chooses but does not weigh,
// DeepSeek-V3's; nullptr: none), ties to the lower expert index, listed by
// that order, and their weights p[e] (renormalize: divided by the k weights'
// sum, as Mixtral and Qwen3-MoE; not, as Qwen2-MoE and OLMoE) times
// `scaling`. Group-limited routing (n_groups > 1): the experts form n_groups
// equal groups, a group scores the sum of its two best p + bias (its best
// alone for one-expert groups), and only the experts of the topk_groups best
// groups (ties to the lower group) are chosen from.
enum class RouterScore : uint8_t { softmax, sigmoid };
struct RouterDims {
  int64_t tokens = 0, experts = 0, top_k = 1;
  RouterScore score = RouterScore::softmax;
  bool renormalize = false;
  float scaling = 1.0f;
  int64_t n_groups = 1, topk_groups = 1;
  const float* bias = nullptr;  // [experts]
};

// Throws Error naming the field when `dims` is out of range (top_k > experts,
// groups that do not divide the experts or cannot hold top_k of them).
void check_router(const RouterDims& dims);

// The auxiliary losses' gradients router_backward adds to the routing's.
// score_grad [experts]: added to d p[t, e] of every token t (the
// load-balancing loss, linear in the scores with per-expert slopes); nullptr:
// none. z: d logits[t, e] += z * lse[t] * softmax(logits[t])[e] (the router
// z-loss mean(lse^2) scaled: z = 2 * coefficient * weight / tokens), lse
// [tokens] from router_forward; z = 0: none.
struct RouterAuxGrad {
  const float* score_grad = nullptr;
  const float* lse = nullptr;
  float z = 0;
};

// Token dispatch to the experts and the weighted combine back (Megatron-Core's
// token dispatcher, on one rank). Token t's j-th choice of the router is slot
// s = t * top_k + j; the permuted rows group the slots by expert, in slot
// order within an expert, so each expert's rows are contiguous.
struct DispatchDims {
  int64_t tokens = 0, top_k = 1, experts = 0, dim = 0;
  int64_t slots() const { return tokens * top_k; }
};

// backend.h's moe_sort and moe_capacity on host arrays: the integer bookkeeping
// every backend shares (a device one copies the indices in and the result out).
void sort_slots(const DispatchDims& dims, const int32_t* indices, int32_t* slots, int32_t* rows,
                int32_t* counts);
void apply_capacity(const DispatchDims& dims, int64_t capacity, const float* weights,
                    const int32_t* counts, int32_t* slots, int32_t* rows, int32_t* kept);

// AdamW (decoupled weight decay, bias correction); all state f32.
struct AdamWHyper {
  float lr = 0, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0;
  int64_t step = 1;        // 1-based, for bias correction
  float grad_scale = 1.0f; // multiplies the gradient first (clipping)
  // Leaves the gradient at 0 once read, so the next step accumulates into a
  // cleared buffer without a zeroing pass of its own (one more write stream
  // in a pass that reads it anyway).
  bool clear_grad = false;
};

// Where the update also writes the parameter in the compute dtype: bf16 or
// f16 compute copies in mixed precision, none (nullptr) in fp32.
struct ComputeCopy {
  ComputeCopy(std::nullptr_t = nullptr) {}
  ComputeCopy(bf16* p) : data(p), dtype(DType::bf16) {}
  ComputeCopy(f16* p) : data(p), dtype(DType::f16) {}
  ComputeCopy(void* p, DType d) : data(d == DType::f32 ? nullptr : p), dtype(d) {}
  void* data = nullptr;
  DType dtype = DType::bf16;
};

}  // namespace meshtrain::ops
