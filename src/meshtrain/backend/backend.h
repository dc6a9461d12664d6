// A Backend: one device of one kind (the CPU cores of a process; a GPU), its
// execution state, the memory it allocates (every byte reported to the
// MemoryTracker) and the operations the engine runs there. Model, optimizer
// and parallel code call these and nothing device-specific; a new device is a
// new folder under backend/ that implements this class, registers itself in
// registry.cpp and passes `meshtrain ops test --backend NAME`
// (docs/ARCHITECTURE.md#how-to-add-a-backend).
//
// Contract: operations run in issue order on the backend's stream; pointers
// are the backend's device memory (Tensor::device() says whose); results are
// deterministic for given inputs and thread count; an operation that ADDS into
// an output says so. Host code reads or writes device memory only through
// copy_to_host / copy_from_host (after synchronize() where the device runs
// asynchronously).
#pragma once

#include <cstdint>
#include <limits>
#include <span>
#include <string>

#include "meshtrain/backend/ops.h"
#include "meshtrain/tensor/memory_tracker.h"
#include "meshtrain/tensor/nf4.h"
#include "meshtrain/tensor/tensor.h"

namespace meshtrain {

class Backend {
 public:
  virtual ~Backend() = default;
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;

  virtual const char* name() const = 0;  // "cpu", "cuda": what train.device names
  virtual Device device() const = 0;
  virtual std::string device_name() const = 0;  // the hardware: "AMD EPYC 9R14", a GPU's name
  virtual int threads() const = 0;              // host threads the kernels run with
  MemoryTracker& tracker() const { return *tracker_; }

  // ---- memory
  // A zero-filled tensor on this backend's device, counted under `category`.
  virtual Tensor allocate(Shape shape, DType dtype, MemCategory category) = 0;
  virtual void copy_to_host(const Tensor& src, void* dst) = 0;  // src.bytes() bytes
  virtual void copy_from_host(const void* src, const Tensor& dst) = 0;
  virtual void synchronize() = 0;  // every issued operation has finished
  // Host memory this device copies to and from at full speed, for what waits
  // on the host between copies (offload's host tier, a checkpoint's file
  // buffer and staging copy): page-locked on a GPU, where a copy to pageable
  // memory goes through the driver's own buffer. Its tensors are host tensors.
  virtual const Allocator& staging_allocator() const { return host_allocator(); }

  // ---- matmul: C[b] = alpha * op(A[b]) · op(B[b]) (+ bias[n]) (+ C[b] when
  // accumulate). A and B have dtype `ab` (f32, bf16 or f16); C has `c_dtype`
  // (accumulate requires f32); f32 accumulation. bias is f32 or nullptr.
  virtual void matmul(const ops::MatmulDims& dims, DType ab, const void* a, const void* b,
                      DType c_dtype, void* c, float alpha = 1.0f, bool accumulate = false,
                      const float* bias = nullptr) = 0;
  // C = addend + op(A) · op(B) (+ bias[n]): a layer's output joining the
  // residual stream `addend` (f32, C's dense shape, left as it is). Here a
  // copy then an accumulating matmul; a device whose GEMM reads C from one
  // buffer and writes D to another (cuBLASLt) saves the copy's pass.
  virtual void matmul_add(const ops::MatmulDims& dims, DType ab, const void* a, const void* b,
                          const float* addend, float* c, const float* bias = nullptr) {
    convert(DType::f32, addend, DType::f32, c, dims.batch * dims.m * dims.n);
    matmul(dims, ab, a, b, DType::f32, c, 1.0f, true, bias);
  }
  // The groups' GEMMs of ops::GroupedMatmulDims, with matmul's dtypes, alpha
  // and accumulate; one call for the lot, so a device can run them at once.
  virtual void grouped_matmul(const ops::GroupedMatmulDims& dims, DType ab, const void* a,
                              const void* b, DType c_dtype, void* c, float alpha = 1.0f,
                              bool accumulate = false) = 0;
  // This device's sustained matmul FLOP/s with input dtype `ab` (MFU denominators).
  virtual double measure_matmul_peak_flops(DType ab, double seconds = 1.0) = 0;
  // This device's sustained bandwidth copying `bytes` to another buffer (bytes
  // read + written per second): the roofline of a memory-bound op moving as
  // much (a working set in cache copies faster than one in DRAM).
  virtual double measure_copy_bandwidth(size_t bytes, double seconds) = 0;

  // ---- norms, row-wise over the last dimension. Inputs are the f32 residual
  // stream; outputs in `out_dtype` (what the next matmul reads). Backward ADDS
  // into dx (the residual branch's gradient may be there) and into dw / db.
  // y = x / sqrt(mean(x^2) + eps) * w; saves rstd[rows].
  virtual void rmsnorm_forward(const float* x, const float* w, DType out_dtype, void* y,
                               float* rstd, int64_t rows, int64_t dim, float eps) = 0;
  virtual void rmsnorm_backward(const float* x, const float* w, const float* rstd, const float* dy,
                                float* dx, float* dw, int64_t rows, int64_t dim) = 0;
  // y = (x - mean) * rstd * w + b; saves mean[rows], rstd[rows].
  virtual void layernorm_forward(const float* x, const float* w, const float* b, DType out_dtype,
                                 void* y, float* mean, float* rstd, int64_t rows, int64_t dim,
                                 float eps) = 0;
  virtual void layernorm_backward(const float* x, const float* w, const float* mean,
                                  const float* rstd, const float* dy, float* dx, float* dw,
                                  float* db, int64_t rows, int64_t dim) = 0;

  // Group RMSNorm (ops::GroupNormDims), in place on the strided f32 x: its
  // input is saved to `saved` [rows, count] f32, the stats to rstd
  // [rows * groups]. Backward: dy (grad_dtype, strided like x) is replaced by
  // d(input) in grad_dtype; dw [width] accumulates.
  virtual void group_rmsnorm_forward(const ops::GroupNormDims& dims, float* x, const float* w,
                                     float* saved, float* rstd) = 0;
  virtual void group_rmsnorm_backward(const ops::GroupNormDims& dims, const float* saved,
                                      const float* w, const float* rstd, DType grad_dtype,
                                      void* dy, float* dw) = 0;

  // ---- feed-forward activations (f32 inputs, outputs in the compute dtype)
  // gate_up [rows, 2*hidden] = [gate | up]; out = silu(gate) * up.
  virtual void swiglu_forward(const float* gate_up, DType out_dtype, void* out, int64_t rows,
                              int64_t hidden) = 0;
  // d_gate_up [rows, 2*hidden] in grad_dtype, overwritten.
  virtual void swiglu_backward(const float* gate_up, const float* d_out, DType grad_dtype,
                               void* d_gate_up, int64_t rows, int64_t hidden) = 0;
  // GELU, tanh approximation (GPT-2's); dx (grad_dtype) overwritten.
  virtual void gelu_forward(const float* x, DType out_dtype, void* y, int64_t n) = 0;
  virtual void gelu_backward(const float* x, const float* dy, DType grad_dtype, void* dx,
                             int64_t n) = 0;
  virtual void add_inplace(float* x, const float* y, int64_t n) = 0;  // x += y
  virtual void mul_inplace(float* x, const float* y, int64_t n) = 0;  // x *= y (a dropout mask)
  // x += a * b, elementwise.
  virtual void add_product(float* x, const float* a, const float* b, int64_t n) = 0;
  // out[r, j] = residual[r, j] + (y[r, j] + bias[j]) (bias nullptr: + 0): a
  // row-parallel layer's reduced output joining the residual stream.
  virtual void residual_add(const float* residual, const float* y, const float* bias, float* out,
                            int64_t rows, int64_t n) = 0;
  // residual_add, then the norm of the sum it writes, in one pass over each
  // row (the sum is still in cache, or in registers on a GPU, when the norm
  // reads it): out = norm(sum) in out_dtype, as rmsnorm_forward or
  // layernorm_forward would compute it from `sum`, bit for bit.
  virtual void residual_add_norm(const float* residual, const float* y, const float* bias,
                                 float* sum, const ops::NormArgs& norm, DType out_dtype, void* out,
                                 int64_t rows, int64_t n) = 0;
  // dst = src converted from `from` to `to` (round to nearest even, as the
  // allocator's copy); both in this device's memory. Float dtypes only.
  virtual void convert(DType from, const void* src, DType to, void* dst, int64_t n) = 0;
  // dbias[j] += sum_r dy[r, j], in a fixed order.
  virtual void bias_backward(const float* dy, float* dbias, int64_t rows, int64_t n) = 0;

  // ---- RoPE and attention
  // angle(p, i) = p * inv_freq[i] in float, for p < max_seq.
  virtual ops::RopeTable make_rope_table(int64_t head_dim, int64_t max_seq,
                                         std::span<const float> inv_freq) = 0;
  // qkv: [B, T, (H + 2*KV)*D] f32, rows [q heads | k heads | v heads]. out:
  // [B, T, H*D] in `compute`. rope == nullptr: no rotation (GPT-2).
  virtual void attention_forward(const ops::AttentionDims& dims, const ops::RopeTable* rope,
                                 DType compute, const float* qkv, void* out,
                                 ops::AttentionSaved& saved) = 0;
  // d_out: [B, T, H*D] f32. d_qkv: [B, T, (H + 2*KV)*D] in `compute`, overwritten.
  virtual void attention_backward(const ops::AttentionDims& dims, const ops::RopeTable* rope,
                                  DType compute, const ops::AttentionSaved& saved,
                                  const float* d_out, void* d_qkv) = 0;
  // Context-parallel attention (ops::ContextDims; `saved` holds the local q,
  // the whole sequence's k and v, and the probabilities [B, H, local, seq]).
  // project: qkv [B, local, qkv_width] f32 -> saved.q and this rank's k and v
  // packed into kv_send [kv_block()] (`compute`).
  virtual void context_attention_project(const ops::ContextDims& dims, const ops::RopeTable* rope,
                                         DType compute, const float* qkv,
                                         ops::AttentionSaved& saved, void* kv_send) = 0;
  // kv_all: the cp group's kv_send blocks by rank (all-gathered). out: [B,
  // local, H*D] in `compute`.
  virtual void context_attention_forward(const ops::ContextDims& dims, DType compute,
                                         const void* kv_all, ops::AttentionSaved& saved,
                                         void* out) = 0;
  // d_out [B, local, H*D] f32 -> d_qkv's q columns (`compute`, the k and v
  // columns left for finish) and dkv_all [size * kv_block()] f32: the
  // gradients of every rank's k and v from this rank's queries, by rank (to
  // be reduce-scattered).
  virtual void context_attention_backward(const ops::ContextDims& dims,
                                          const ops::RopeTable* rope, DType compute,
                                          const ops::AttentionSaved& saved, const float* d_out,
                                          void* d_qkv, float* dkv_all) = 0;
  // dkv [kv_block()] f32: this rank's k and v gradients (summed over the
  // group) -> d_qkv's k and v columns; and dq [B, H, local, D] f32 (the
  // ring's; nullptr: the q columns are written already) -> its q columns.
  virtual void context_attention_finish(const ops::ContextDims& dims, const ops::RopeTable* rope,
                                        DType compute, const float* dkv, const float* dq,
                                        void* d_qkv) = 0;
  // Ulysses' layouts (cp_comm = "alltoall"): rows [rows, width] <-> head
  // groups [groups][rows][width / groups] (to_groups false: back); and the
  // cp group's tokens by rank [size][batch][local_seq][width] (as an
  // all-to-all delivers them) <-> the sequence [batch][seq][width] in global
  // order (to_sequence false: back). Any dtype (element size); data movement
  // only.
  virtual void head_groups(const ops::HeadGroups& g, DType dtype, const void* rows, void* groups,
                           bool to_groups) = 0;
  virtual void context_sequence(const ops::ContextDims& dims, int64_t width, DType dtype,
                                const void* by_rank, void* sequence, bool to_sequence) = 0;
  // Ring attention (cp_comm = "ring"): the local queries (saved.q, from
  // project) against one rank's packed k/v block at a time (`block_rank`'s
  // tokens), merged into `state` (first: the first block, which resets it);
  // finish writes out [B, local, H*D] (`compute`) and saved.lse.
  virtual void ring_attention_forward_block(const ops::ContextDims& dims, DType compute,
                                            int64_t block_rank, const void* kv_block,
                                            const ops::AttentionSaved& saved,
                                            ops::RingState& state, bool first) = 0;
  virtual void ring_attention_forward_finish(const ops::ContextDims& dims, DType compute,
                                             ops::RingState& state, ops::AttentionSaved& saved,
                                             void* out) = 0;
  // One block's share of backward: the probabilities recomputed from
  // saved.lse; dq [B, H, local, D] f32 and dkv_block [kv_block()] f32 (the
  // block's k and v gradients) accumulated. d_out [B, local, H*D] f32, out
  // the forward's output (`compute`).
  virtual void ring_attention_backward_block(const ops::ContextDims& dims, DType compute,
                                             int64_t block_rank, const void* kv_block,
                                             const ops::AttentionSaved& saved, const float* d_out,
                                             const void* out, float* dq, float* dkv_block) = 0;
  // qkv: [B, T_new, qkv_width] f32 for positions [pos0, pos0 + T_new); appends
  // to the cache, attends over [0, pos0 + t]; out: [B, T_new, H*D] f32.
  virtual void attention_decode(const ops::AttentionDims& dims, const ops::RopeTable* rope,
                                const float* qkv, int64_t pos0, ops::KVCacheLayer& cache,
                                float* out) = 0;

  // ---- embeddings
  // out[i] = table[ids[i] - vocab_begin] as f32 (zero outside the slice)
  // + positions[dims.position(i)] when positions is not nullptr. The table is
  // f32, bf16 or f16.
  virtual void embedding_forward(const ops::EmbeddingDims& dims, const void* table,
                                 DType table_dtype, const float* positions, const int32_t* ids,
                                 float* out) = 0;
  // dtable[ids[i] - vocab_begin] += dout[i] for ids in the slice;
  // dpositions[dims.position(i)] += dout[i] (when not nullptr). Deterministic.
  virtual void embedding_backward(const ops::EmbeddingDims& dims, const int32_t* ids,
                                  const float* dout, float* dtable, float* dpositions) = 0;

  // ---- the output layer fused with cross-entropy: the sum over rows of
  // -log softmax(h · W^T)[target], and its backward when dh / dw are given.
  virtual double fused_classifier(const ops::ClassifierArgs& args) = 0;

  // ---- quantised weights
  // y[0, n) (f32, bf16 or f16) = the values an NF4 buffer of n elements in
  // `form` holds (tensor/nf4.h: its f32 dequantisation, rounded once to `to`).
  // QLoRA's frozen base weights (a tp rank's: a slice), dequantised into a
  // workspace before each GEMM.
  virtual void dequantize_nf4(const void* packed, int64_t n, DType to, void* y,
                              nf4::Form form = nf4::Form::whole) = 0;

  // ---- mixture of experts
  // logits [tokens, experts] f32 -> probs [tokens, experts] (the scores p,
  // kept for backward), indices [tokens, top_k] (i32) and weights [tokens,
  // top_k] f32, as ops::RouterDims describes; lse [tokens] (when not
  // nullptr): each token's log-sum-exp of its logits (the z-loss's input).
  virtual void router_forward(const ops::RouterDims& dims, const float* logits, float* probs,
                              int32_t* indices, float* weights, float* lse) = 0;
  // d_logits [tokens, experts] (overwritten) from d_weights [tokens, top_k],
  // through the weights' normalisation and the score function, plus the
  // auxiliary losses' terms (ops::RouterAuxGrad); the choice of experts
  // itself has no gradient.
  virtual void router_backward(const ops::RouterDims& dims, const float* probs,
                               const int32_t* indices, const float* d_weights,
                               const ops::RouterAuxGrad& aux, float* d_logits) = 0;

  // Dispatch (ops::DispatchDims; i32 indices [tokens, top_k] from
  // router_forward): slots [slots()] (permuted row r holds slot slots[r]),
  // rows [slots()] (its inverse: slot s is permuted row rows[s]) and counts
  // [experts] (each expert's rows, contiguous in expert order). Throws Error
  // for an index outside [0, experts).
  virtual void moe_sort(const ops::DispatchDims& dims, const int32_t* indices, int32_t* slots,
                        int32_t* rows, int32_t* counts) = 0;
  // Token dropping: from moe_sort's slots, rows and counts, each expert keeps
  // at most `capacity` of its slots, those of the highest weight (weights
  // [tokens, top_k]; ties to the lower slot), in slot order; kept [experts]
  // (overwritten) their counts. slots is rewritten: the kept rows first,
  // grouped by expert, then the dropped slots in slot order, whose rows[s]
  // become -1: moe_permute_backward, moe_combine and its backward skip them
  // (a dropped choice adds nothing and gets no gradient).
  virtual void moe_capacity(const ops::DispatchDims& dims, int64_t capacity, const float* weights,
                            const int32_t* counts, int32_t* slots, int32_t* rows,
                            int32_t* kept) = 0;
  // out [slots(), dim] in out_dtype: row r = x[slots[r] / top_k] (x f32 [tokens, dim]).
  virtual void moe_permute(const ops::DispatchDims& dims, const int32_t* slots, const float* x,
                           DType out_dtype, void* out) = 0;
  // dx [tokens, dim] f32, overwritten: dx[t] = sum over j (ascending) of
  // d_out[rows[t*top_k + j]] (rows of -1, dropped choices, skipped here and below).
  virtual void moe_permute_backward(const ops::DispatchDims& dims, const int32_t* rows,
                                    const float* d_out, float* dx) = 0;
  // out [tokens, dim] f32, overwritten: out[t] = sum over j (ascending) of
  // weights[t, j] * y[rows[t*top_k + j]] (y f32 [slots(), dim]).
  virtual void moe_combine(const ops::DispatchDims& dims, const int32_t* rows, const float* weights,
                           const float* y, float* out) = 0;
  // d_y [slots(), dim] in grad_dtype, overwritten: row rows[t*top_k + j] =
  // weights[t, j] * d_out[t]; d_weights [tokens, top_k] f32, overwritten:
  // <d_out[t], y[rows[t*top_k + j]]>.
  virtual void moe_combine_backward(const ops::DispatchDims& dims, const int32_t* rows,
                                    const float* weights, const float* y, const float* d_out,
                                    DType grad_dtype, void* d_y, float* d_weights) = 0;

  // ---- optimizer
  // p -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * p), m and v from grad * grad_scale;
  // with a compute copy, also writes the updated parameter there; grad is
  // left at 0 when hyper.clear_grad, else unchanged.
  virtual void adamw_update(const ops::AdamWHyper& hyper, float* param, float* grad, float* m,
                            float* v, ops::ComputeCopy compute, int64_t n) = 0;
  // sum of x[i]^2 in double, the same bits for a given n whatever the thread count.
  virtual double sum_squares(const float* x, int64_t n) = 0;

 protected:
  explicit Backend(MemoryTracker& tracker) : tracker_(&tracker) {}

 private:
  MemoryTracker* tracker_;
};

}  // namespace meshtrain
