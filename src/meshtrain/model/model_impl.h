// Internal to the model module: the Model's layer plumbing, saved activations
// and workspace. Not part of the public API.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "meshtrain/backend/backend.h"
#include "meshtrain/model/model.h"

namespace meshtrain {

inline constexpr size_t kNoParam = static_cast<size_t>(-1);
inline constexpr size_t kNoUnit = static_cast<size_t>(-1);

// A LoRA adapter of one module of a Linear: A [rank, in], B [out, rank]
// (whatever the base's orientation) adding scale * (x A^T) B^T to the
// Linear's output columns [out_begin, out_begin + out).
// row_parallel: A is split by input columns over tp (a row-parallel layer:
// o_proj, down_proj, c_proj), so x A^T is a partial sum over the tp ranks.
struct LoraAdapter {
  size_t a = kNoParam, b = kNoParam;
  int64_t out_begin = 0, out = 0;
  bool row_parallel = false;
};

// A linear layer over parameters of the registry. `nn_linear`: weight stored
// [out, in] (torch nn.Linear, llama); otherwise [in, out] (HF Conv1D, GPT-2).
// `n_weights` adjacent weight tensors form one GEMM (llama q|k|v, gate|up),
// and their biases (GPT-2's one c_attn.bias, Qwen2's q|k|v biases) one vector.
// `lora`: the adapters of its modules, in output order (registry order too,
// after the weights and bias).
struct Linear {
  size_t weight = kNoParam;
  size_t n_weights = 1;
  size_t bias = kNoParam;  // the first of n_biases adjacent bias tensors (one vector [out])
  size_t n_biases = 1;
  int64_t in = 0, out = 0;
  bool nn_linear = true;
  std::vector<LoraAdapter> lora;
};

// A norm: RMSNorm when bias == kNoParam (llama), LayerNorm otherwise (gpt2).
struct Norm {
  size_t weight = kNoParam;
  size_t bias = kNoParam;
  bool layer_norm() const { return bias != kNoParam; }
};

// A mixture-of-experts feed-forward (config.h MoeConfig; model/moe.cpp):
// the router [E, d] (f32), the routed experts' fused weights gate|up
// [E, 2I, d] and down [E, d, I], and the shared experts (shared_in.weight ==
// kNoParam: none) with their optional sigmoid gate [1, d] (f32).
struct MoeFfn {
  size_t router = kNoParam, experts_in = kNoParam, experts_out = kNoParam;
  size_t selection_bias = kNoParam;  // [E] f32, frozen (moe.bias_update_rate > 0)
  Linear shared_in, shared_out;
  size_t shared_gate = kNoParam;
  bool enabled() const { return router != kNoParam; }
  bool shared() const { return shared_in.weight != kNoParam; }
};

// One pre-norm residual block:
//   mid = x + proj(attention(qkv(norm1(x))));  out = mid + ff_out(act(ff_in(norm2(mid)))),
// or with moe.enabled(): out = mid + moe(norm2(mid)) (ff_in / ff_out unused).
// QK-norm (config.h QkNorm): RMSNorm weights of the queries and keys, applied
// to the qkv GEMM's output before attention; kNoParam: none.
struct QkNormParams {
  size_t q = kNoParam, k = kNoParam;
  bool enabled() const { return q != kNoParam; }
};

struct Block {
  Norm norm1, norm2;
  Linear qkv, proj, ff_in, ff_out;
  QkNormParams qk_norm;
  MoeFfn moe;
};

// What a MoE feed-forward saves between forward and backward (rows N, slots
// S = N * top_k; `dt` the compute dtype), all in its block's category.
struct MoeActs {
  Tensor x32;                   // f32 [N, d]: norm2's output in f32 (mixed precision only)
  Tensor probs, lse;            // f32 [N, E] router scores; [N] log-sum-exp of its logits
  Tensor indices, weights;      // i32 / f32 [N, top_k]: the router's choices
  Tensor slots, rows, counts;   // i32 [S], [S], [E]: the dispatch (ops::DispatchDims)
  Tensor kept;                  // i32 [E]: rows each expert keeps under a capacity
  std::vector<int32_t> counts_host;  // counts (the router's choices) on the host
  std::vector<int32_t> rows_host;    // each expert's rows on the host (kept, or all choices)
  std::vector<float> prob_sums;      // [E] sums over tokens of the scores (load balancing)
  // Context parallelism: the micro-batch's choices over the whole cp group
  // (its rows are cut over the group), for the per-micro-batch balancing statistic.
  std::vector<int32_t> counts_group;
  Tensor xp;                    // dt [S, d]: the rows permuted to their experts
  // Expert parallelism: the exchange with the ep group (at ep 1 the identity,
  // expert_rows = rows_host) and the rows this rank's experts received.
  ExpertExchange exchange;
  Tensor xe;                    // dt [R, d] (ep > 1; else xp is the experts' input)
  // The experts' rows: S at ep 1, else R = exchange.received() (at least 1).
  Tensor pre, act;              // f32 [S | R, 2I] gate|up; dt [S | R, I] SwiGLU output
  Tensor y;                     // f32 [S, d]: the experts' outputs, back on the token side
  Tensor shared_pre, shared_act, shared_y;  // f32 [N, 2Is]; dt [N, Is]; f32 [N, d]
  Tensor gate_prob, gate_index, gate_weight;  // the shared gate as a one-expert sigmoid router
};

// What one block saves between forward and backward (rows N = batch * seq).
// `dt` is the compute dtype (f32, bf16 or f16).
// Under recomputation (model.h RecomputePolicy) the tensors a block does not
// keep are left undefined here and live in Impl::recomputed while it runs.
struct BlockActs {
  MemCategory category = MemCategory::activations;  // workspace when nothing is kept
  Recompute mode = Recompute::none;  // how its forward ran (its backward matches)
  // Norm outputs and stats cover this rank's residual rows (N / tp under
  // sequence parallelism: all-gathered again in backward).
  Tensor xn1, mean1, rstd1;  // norm1 output [N, d] dt; stats [N] f32 (mean: LayerNorm only)
  Tensor qk, qk_rstd;        // QK-norm's input q|k [N, (H + KV) * D] f32 and its stats f32
  ops::AttentionSaved attn;  // q, k, v, probs (allocated by the kernel)
  Tensor att;                // attention output [N, H*D] dt
  Tensor mid;                // residual after attention [N, d] f32
  Tensor xn2, mean2, rstd2;  // norm2 output and stats
  Tensor ff_pre;             // [N, ff_in.out] f32: llama [gate|up], gpt2 pre-GELU
  Tensor ff_act;             // [N, ff_out.in] dt: SwiGLU / GELU output
  MoeActs moe;               // a MoE feed-forward's (instead of ff_pre / ff_act)
};

struct Activations {
  int64_t batch = 0, seq = 0;
  std::vector<int32_t> positions;  // packed records (staged passes); empty: one sequence per row
  MemCategory category = MemCategory::activations;
  std::vector<Tensor> residual;  // f32 [N, d]: residual[l] is the input of block l
  std::vector<BlockActs> blocks;
  Tensor hn, mean_f, rstd_f;     // final norm output [N, d] dt and stats
  const void* head_input = nullptr;  // the classifier's input [N, d] dt: hn, all rows
};

// Temporaries of one block call, reused across blocks and steps.
struct Workspace {
  Tensor qkv;     // f32 [N, qkv width] (forward)
  Tensor dres;    // f32 [N, d]: gradient of the residual stream
  Tensor dres_c;  // dt [N, d]: dres in the compute dtype (mixed precision only)
  Tensor dx;      // f32 [N, max(d, H*D)]: gradient out of a norm's output / attention output
  Tensor dff;     // f32 [N, max(hidden, qkv width)]: d(act output), bias-grad scratch
  Tensor dff_c;   // dt [N, ff_in.out]: d(ff_in output)
  Tensor dqkv;    // dt [N, qkv width]
  // Context parallelism: this rank's k and v (dt), the group's, and their
  // gradients (f32) before and after the reduce-scatter.
  Tensor cp_kv, cp_kv_all, cp_dkv_all, cp_dkv;
  Tensor cp_dq;           // ring: f32 [B, H, local, D]
  // Ulysses: the all-to-alls' send and receive buffers (f32 and the compute
  // dtype), the sequence-order rows (f32, compute dtype), the positions.
  Tensor ul_send32, ul_recv32, ul_send16, ul_recv16, ul_seq32, ul_seq16, ul_pos, ul_pos_seq;
  ops::RingState ring;    // ring: the running softmax of the local queries
  // Tensor parallelism.
  Tensor partial;        // f32 [N, d]: a row-parallel layer's (or the embedding's) partial sum
  Tensor partial_shard;  // f32 [N / tp, d]: its reduce-scattered rows (sequence parallel)
  Tensor dres_full;      // f32 [N, d]: dres all-gathered (sequence parallel)
  Tensor dx_shard;       // f32 [N / tp, d]: ws.dx reduce-scattered (sequence parallel)
  Tensor norm_grads;     // f32: one unit's norm gradients before their tp all-reduce
  Tensor qk_norm_grads;  // f32 [q width + k width]: QK-norm's weight gradients (summed over tp)
  Tensor column_input;   // dt [N, d]: a norm output all-gathered (sequence parallel)
  // LoRA.
  Tensor lora_u;     // dt [N, rank]: x A^T of one adapter
  Tensor lora_u_sum;  // f32 [N, rank]: a row-parallel adapter's x A^T, summed over tp
  Tensor lora_du;    // f32 [adapters of a Linear, N, rank]: d(x A^T), kept from d(input) to dW
  Tensor lora_du_c;  // dt [N, rank]: one of those in the compute dtype
  Tensor discard;    // f32 [2, d]: where a frozen norm's weight / bias gradient goes
  Tensor lora_mask;  // f32 [N, in]: an adapter's dropout factors (0 or 1 / (1 - p))
  Tensor lora_x32;   // f32 [N, in]: its dropped input, or d(input) before the mask
  Tensor lora_x;     // dt [N, in]: the dropped input in the compute dtype (mixed precision)
  Tensor dequant;    // dt [out, in]: QLoRA: one Linear's NF4 weights, dequantised for its GEMM
  // The pass's ids in device memory, uploaded from the caller's host arrays
  // when an op reads them (Impl::upload): i32 [N].
  Tensor tokens, targets, positions;
  // Preference passes (TokenLoss): f32 [N] token loss weights and losses.
  Tensor row_weights, row_losses;
  Tensor position_ids;  // i32 [N / tp]: this rank's rows' positions (tp, learned positions)
  // MoE (model/moe.cpp).
  Tensor router_logits;   // f32 [N, E]; in backward d(logits)
  Tensor moe_out;         // f32 [N, d]: the combined routed (then gated shared) output
  Tensor moe_d_y;         // dt [S, d]: d(expert outputs)
  Tensor moe_d_act;       // f32 [S, I]
  Tensor moe_d_pre;       // dt [S, 2I]
  Tensor moe_d_xp;        // f32 [S, d]: d(permuted rows)
  Tensor moe_d_weights;   // f32 [N, top_k]
  Tensor moe_dx;          // f32 [N, d]: d(norm2 output) of the routed part
  Tensor moe_acc;         // f32 [N, d]: tp > 1 with shared experts: the routed part's and gate's d(x)
  Tensor moe_shared_d;    // f32 / dt [N, d]: d(shared output) (gated; in the compute dtype)
  Tensor moe_gate_d;      // f32 [N, 1] d(gate weight)
  Tensor moe_gate_logits;  // f32 [N, 1]: the shared gate's logits; in backward their gradient
  Tensor moe_score_grad;  // f32 [E]: the load-balancing loss's score gradient
  Tensor moe_prob_sums;   // f32 [E]
  // Expert parallelism (ep > 1), R = the rows this rank's experts received:
  Tensor moe_staging;     // f32 [R, d]: rows as they arrive / before they leave
  Tensor moe_ye;          // f32 [R, d]: the experts' outputs before combine_rows
  Tensor moe_d_ye;        // dt [R, d]: d(expert outputs) after dispatch_rows
  Tensor moe_d_xe;        // f32 [R, d]: d(expert inputs) before combine_rows
  Tensor iota;            // i32 [N]: 0, 1, ... (the shared gate's identity dispatch)
};


struct Model::Impl {
  Impl(Model& model);

  // Parameter access by registry index.
  const float* master(size_t i) const { return model.params_[i].master.data<float>(); }
  float* grad(size_t i) const { return model.params_[i].grad.data<float>(); }
  bool trains(size_t i) const { return model.params_[i].spec.trainable; }
  // The GEMM operand for dtype dt: the bf16 / f16 compute copy or the f32 master.
  const void* weight(size_t i, DType dt) const;
  // A Linear's weights (all lin.n_weights of them) in dt: weight(), or NF4
  // weights dequantised into ws.dequant (valid until the next call).
  const void* linear_weight(const Linear& lin, DType dt);
  // Reports a complete gradient; checks reverse registry order.
  void ready(size_t i);
  // Fire unit_hooks (external storage: before() then checks the unit's views).
  void before(size_t unit, UnitPass pass);
  void after(size_t unit, UnitPass pass);
  // External storage: throws unless unit's views are bound (see model.h).
  void check_bound(size_t unit, UnitPass pass) const;
  // Units of this model by global layer (kNoUnit: another stage's) and back.
  size_t layer_unit(int64_t layer) const { return unit_of_layer[static_cast<size_t>(layer)]; }
  // The local registry index of global index g (kNoParam: another stage's).
  size_t local(size_t g) const;

  const Block& block(int64_t layer) const { return blocks[static_cast<size_t>(layer)]; }
  Block make_block(int64_t layer) const;  // from the registry, by name
  ops::AttentionDims attention_dims(int64_t batch, int64_t seq) const;
  // Attention under context parallelism (ContextParallel): ws.qkv -> a.att,
  // and d(a.att) -> ws.dqkv, with the cp group's all-gather / reduce-scatter.
  ops::ContextDims context_dims(int64_t batch, int64_t seq) const;
  void context_attention_forward(BlockActs& a, DType dt, int64_t batch, int64_t seq);
  void context_attention_backward(const BlockActs& a, DType dt, int64_t batch, int64_t seq,
                                  const float* d_att);
  void ring_attention_forward(BlockActs& a, DType dt, const ops::ContextDims& d);
  // Ulysses: the whole sequence's dims for this rank's head group (its
  // positions in ws.ul_pos_seq, gathered over the cp group), and the two passes.
  ops::AttentionDims ulysses_dims(const ops::ContextDims& d);
  void ulysses_forward(BlockActs& a, DType dt, const ops::ContextDims& d);
  void ulysses_backward(const BlockActs& a, DType dt, const ops::ContextDims& d, const float* d_att);
  void ring_attention_backward(const BlockActs& a, DType dt, const ops::ContextDims& d,
                               const float* d_att);
  const ops::RopeTable* rope_table() const { return has_rope ? &rope : nullptr; }
  void ensure(Tensor& t, const Shape& shape, DType dtype, MemCategory category) const;
  void check_tokens(const int32_t* ids, int64_t n, bool allow_negative, const char* what) const;

  // Embeddings and all blocks, with their forward hooks; returns the last
  // residual. keep_all: one BlockActs and residual per layer (training);
  // otherwise two residuals and one scratch block. cache != nullptr:
  // incremental decoding from position cache->length (dt must be f32; the
  // caller advances cache->length).
  const Tensor& forward_trunk(Activations& acts, const int32_t* tokens, int64_t batch, int64_t seq,
                              DType dt, bool keep_all, KVCache* cache = nullptr);
  // The embedding's lookup over this rank's vocabulary slice (all of it
  // without tp), positions from pos0 or row_positions.
  ops::EmbeddingDims embedding_dims(int64_t batch, int64_t seq, int64_t pos0,
                                    const int32_t* pos_ids) const;
  // Host ids [n] copied into `slot` (i32, on the backend's device); returns
  // its data, or nullptr for nullptr. Every id an op reads comes this way.
  const int32_t* upload(Tensor& slot, const int32_t* host, int64_t n);
  // The classifier call of a pass with `loss` (TokenLoss): its weights
  // uploaded into args, its losses' device buffer set; then fetch_losses
  // copies them to loss.losses.
  void weigh(ops::ClassifierArgs& args, const TokenLoss& loss);
  void fetch_losses(const TokenLoss& loss, int64_t rows);
  std::vector<float> host_losses, host_weights;  // TokenLoss::weigh's arrays
  // Final norm of `last` into acts.hn, then `classifier` (reads the output
  // layer), within the inference head hooks.
  template <typename Classifier>
  void head_forward(Activations& acts, const Tensor& last, DType dt, Classifier&& classifier);
  // cache != nullptr: incremental decoding at positions [pos0, pos0 + seq) (f32 only).
  void forward_block(int64_t layer, const Tensor& x, BlockActs& a, Tensor& out, DType dt,
                     int64_t batch, int64_t seq, ops::KVCacheLayer* cache, int64_t pos0);
  // Workspace dres holds d(out) on entry and d(x) on return.
  void backward_block(int64_t layer, const Tensor& x, BlockActs& a, DType dt, int64_t batch,
                      int64_t seq);
  // The MLP activation: act = SwiGLU(pre) (llama) or GELU(pre), `width` outputs a row.
  // QK-norm of ws.qkv's queries and keys (Block::qk_norm), saving its input
  // to a.qk; its backward turns ws.dqkv's q and k parts into d(input).
  // ws.dx's width: a norm's output (d) or this rank's attention output (H * D).
  int64_t dx_width() const { return std::max(cfg.dim, heads * cfg.head_dim()); }
  std::array<ops::GroupNormDims, 2> qk_norm_dims(const Block& b, int64_t rows) const;
  void qk_norm_forward(const Block& b, BlockActs& a, int64_t rows);
  void qk_norm_backward(const Block& b, const BlockActs& a, DType dt, int64_t rows);
  void mlp_activation(const Tensor& pre, DType dt, Tensor& act, int64_t rows, int64_t width,
                      MemCategory category);
  // A MoE feed-forward (model/moe.cpp): out = mid + moe(xn2), xn2 [rows, d]
  // in dt; records the routing statistics when recording_moe. Its backward
  // writes d(xn2) into ws.dx from d(out) in ws.dres, aux-loss terms weighted by aux_weight.
  void moe_forward(int64_t layer, const Block& b, BlockActs& a, const void* xn2, DType dt,
                   int64_t rows, Tensor& out);
  // Returns d(norm2 output) of this rank's rows (as ffn_backward does).
  const float* moe_backward(int64_t layer, const Block& b, BlockActs& a, DType dt, int64_t rows);
  // A feed-forward's backward (in(x) -> pre -> act -> out, `width` act
  // columns) from dy = d(output) in dt (and f32, or nullptr): the weights'
  // gradients, and d(x) summed over tp (column_parallel_backward). ws.dff
  // must hold [rows, width] (backward_block ensures it).
  const float* ffn_backward(const Linear& in, const Linear& out, DType dt, const void* dy,
                            const float* dy_f32, const Tensor& pre, const Tensor& act,
                            const Tensor& x, int64_t rows, int64_t width);
  ops::RouterDims router_dims(int64_t rows) const;

  // Training passes of one block under the recompute policy (recompute.cpp).
  // chunk_first: the first layer of the chunk (0 for the whole model).
  // train_backward_block's `out` is the block's output slot, which a full
  // recomputation writes again (bit-identical; nothing reads it afterwards).
  Recompute layer_recompute(int64_t layer, int64_t chunk_first) const;
  void train_forward_block(int64_t layer, int64_t chunk_first, const Tensor& x, BlockActs& a,
                           Tensor& out, DType dt, int64_t batch, int64_t seq);
  void train_backward_block(int64_t layer, const Tensor& x, BlockActs& a, Tensor& out, DType dt,
                            int64_t batch, int64_t seq);

  void norm_forward(const Norm& norm, const Tensor& x, DType dt, Tensor& y, Tensor& mean,
                    Tensor& rstd, int64_t rows, MemCategory category);
  // y [rows, d] in dt, rstd (and a LayerNorm's mean) made to hold `rows`
  // rows; the backend's description of the norm writing them.
  ops::NormArgs norm_outputs(const Norm& norm, DType dt, Tensor& y, Tensor& mean, Tensor& rstd,
                             int64_t rows, MemCategory category);
  void norm_backward(const Norm& norm, const Tensor& x, const Tensor& mean, const Tensor& rstd,
                     const float* dy, float* dx, int64_t rows);
  // y[rows, out] = (addend +) x · W (+ bias), x in dt; addend f32 [rows, out].
  void linear_forward(const Linear& lin, DType dt, const void* x, int64_t rows, float* y,
                      const float* addend = nullptr);
  // Adds the weight (and bias) gradients, reports them ready, and writes
  // dx[rows, in] when dx != nullptr. dy: dY in dt; dy_f32: dY in f32 or nullptr
  // (then the bias gradient converts dy into `scratch`).
  void linear_backward(const Linear& lin, DType dt, const void* dy, const float* dy_f32,
                       const void* x, int64_t rows, float* dx, float* scratch);
  // LoRA: adds the adapters' terms to y (linear_forward); d(x A^T) of each
  // adapter into ws.lora_du and (dx != nullptr) its term added to dx; the
  // adapters' gradients from ws.lora_du (under tp first summed over the tp
  // ranks: B's rows are split, A is replicated).
  void lora_forward(const Linear& lin, DType dt, const void* x, int64_t rows, float* y);
  bool adapters_on = true;  // Model::set_adapters_enabled
  // ws.lora_u = x A^T (x [rows, lin.in] in dt), summed over tp for a row-parallel adapter.
  const void* lora_input_product(const Linear& lin, const LoraAdapter& ad, DType dt,
                                 const void* x, int64_t rows);
  // Adapter dropout (model.h set_lora_dropout): whether it applies to this
  // pass, ws.lora_mask for adapter ad over x [rows, lin.in], and x with it applied.
  bool dropping() const { return dropout.active; }
  void lora_dropout_mask(const Linear& lin, const LoraAdapter& ad, int64_t rows);
  const void* lora_dropped_input(const Linear& lin, const LoraAdapter& ad, DType dt,
                                 const void* x, int64_t rows);
  void lora_backward_input(const Linear& lin, DType dt, const void* dy, int64_t rows, float* dx);
  void lora_backward_weight(const Linear& lin, DType dt, const void* dy, const void* x,
                            int64_t rows);
  // The two halves of linear_backward: weight (and bias) gradients; dx.
  // linear_backward_input runs first (the adapters' weight gradients need
  // its ws.lora_du).
  void linear_backward_weight(const Linear& lin, DType dt, const void* dy, const float* dy_f32,
                              const void* x, int64_t rows, float* scratch);
  void linear_backward_input(const Linear& lin, DType dt, const void* dy, int64_t rows, float* dx);
  // dres (f32 [rows, d]) in the compute dtype (dres itself in fp32).
  const void* residual_grad_compute(DType dt, const Tensor& dres, int64_t rows);

  // Tensor parallelism (tensor_parallel.cpp); with tp = 1 each is the plain
  // single-rank step. Rows of the residual stream on this rank: rows / tp
  // under sequence parallelism, else rows.
  int64_t shard_rows(int64_t rows) const { return sp ? rows / tp.size() : rows; }
  // y = norm(x) over this rank's shard_rows(rows) rows; returns the
  // column-parallel layer's input over all rows: y, or (sequence parallel) y
  // all-gathered into ws.column_input.
  const void* column_input(const Norm& norm, const Tensor& x, DType dt, Tensor& y, Tensor& mean,
                           Tensor& rstd, int64_t rows, MemCategory category);
  // The input over all rows from a saved y (sequence parallel: all-gathered again).
  const void* all_rows(const Tensor& y, int64_t rows, DType dt);
  // out = residual + lin(in) + bias: a row-parallel layer's partial sums
  // all-reduced (sequence parallel: reduce-scattered), the bias added once.
  void row_parallel_add(const Linear& lin, DType dt, const void* in, int64_t rows,
                        const Tensor& residual, Tensor& out);
  // row_parallel_add, then column_input's norm of `out`: under tp the add
  // and the norm are one pass over this rank's rows (residual_add_norm);
  // returns the next column-parallel layer's input.
  const void* row_parallel_add_norm(const Linear& lin, DType dt, const void* in, int64_t rows,
                                    const Tensor& residual, Tensor& out, const Norm& norm,
                                    Tensor& y, Tensor& mean, Tensor& rstd, MemCategory category);
  // lin's partial sums over tp reduced: all rows, or (sequence parallel) this
  // rank's rows; the bias not yet added.
  const float* row_parallel_sum(const Linear& lin, DType dt, const void* in, int64_t rows);
  const float* bias_of(const Linear& lin) const {
    return lin.bias != kNoParam ? master(lin.bias) : nullptr;
  }
  // ws.dx [rows, d] holds a column-parallel layer's partial d(input): summed
  // over tp; returns this rank's shard_rows(rows) rows.
  const float* reduce_input_grad(int64_t rows);
  // A column-parallel layer's backward from its saved input y (this rank's
  // rows under sequence parallelism) with the communication overlapped: d(input)
  // into ws.dx first and its tp reduction issued, then the weight gradient
  // while it runs (sequence parallel: y's all-gather is issued before d(input)
  // and awaited before the weight gradient, as in Megatron). Returns
  // d(input)'s rows of this rank, summed over tp.
  const float* column_parallel_backward(const Linear& lin, DType dt, const void* dy,
                                        const Tensor& y, int64_t rows, float* scratch);
  // ws.dres over all rows (sequence parallel: all-gathered into ws.dres_full).
  const Tensor& full_residual_grad(int64_t rows);
  // Where norm_backward adds a norm parameter's gradient: the parameter's
  // grad, or (sequence parallel: a partial over this rank's rows) a slot that
  // flush_norm_grads() all-reduces over tp and adds to it.
  // A frozen norm parameter's goes to ws.discard (slot 0: weight, 1: bias).
  float* norm_grad(size_t param, int slot = 0);
  void flush_norm_grads();
  // Token (+ position) embeddings of all rows into out [shard_rows(rows), d].
  void embed_tokens(const int32_t* tokens, int64_t batch, int64_t seq, int64_t pos0, Tensor& out);
  // The embeddings' gradients from ws.dres.
  void embed_backward(const int32_t* tokens, int64_t batch, int64_t seq);
  // The fused classifier's arguments over h [rows, d] (vocab slice and reductions).
  ops::ClassifierArgs classifier_args(const void* h, const int32_t* targets, int64_t rows,
                                      DType dt);

  // The running pass's per-token record positions (Model::forward_backward),
  // or nullptr: the caller's host array and its upload (ws.positions); set by
  // the public passes through PassPositions.
  const int32_t* row_positions_host = nullptr;
  const int32_t* row_positions = nullptr;
  struct PassPositions {
    PassPositions(Impl& impl, const int32_t* p, int64_t rows) : m(impl) {
      m.row_positions_host = p;
      m.row_positions = m.upload(m.ws.positions, p, rows);
    }
    ~PassPositions() { m.row_positions_host = m.row_positions = nullptr; }
    Impl& m;
  };

  Model& model;
  const ModelConfig& cfg;
  Backend& backend;
  const TensorParallel& tp;
  const ExpertParallel& ep;
  bool sp = false;                           // sequence parallel (and tp > 1)
  int64_t heads = 0, kv_heads = 0, hidden = 0;  // this rank's
  int64_t dequant_numel = 0;  // QLoRA: the widest NF4 Linear (ws.dequant's size)
  int64_t vocab_rows = 0, vocab_begin = 0, vocab_valid = 0;  // its vocabulary slice
  std::vector<std::pair<size_t, int64_t>> pending_norm_grads;  // (param, offset in ws.norm_grads)
  bool has_rope = false;
  ops::RopeTable rope;
  size_t embed = 0, positions = kNoParam, output = 0;
  size_t embed_unit = 0, head_unit = 0;  // kNoUnit on stages without them
  std::vector<size_t> unit_of_layer;     // by global layer
  std::vector<int64_t> layer_of_unit;    // by unit: its global layer, -1 for embed / head
  bool tied = false;  // the token embedding is the output layer
  Norm final_norm;
  std::vector<Block> blocks;  // by global layer (default for another stage's)
  struct LoraDropout {
    uint64_t seed = 0;
    int64_t step = 0, seq = 0;
    std::vector<int64_t> samples;  // the micro-batch rows' sample indices
    std::vector<float> mask;       // one adapter's factors, drawn on the host
    bool active = false;           // inside forward_backward, lora.dropout > 0
  } dropout;
  size_t next_ready = 0;  // the registry index + 1 the next ready() must report
  RecomputePolicy recompute;
  BlockActs recomputed;  // the one block's tensors its mode does not keep
  Activations train;
  // MoE: routing statistics by MoE layer (model.h moe_stats), whether the
  // running forward records them (a training forward, not its recomputation),
  // and the weight of the auxiliary losses in the running backward (the
  // micro-batch's tokens' share of the loss: grad_scale * rows).
  std::vector<MoeLayerStats> moe_stats;
  int64_t max_expert_rows = 0;  // model.h Model::max_expert_rows
  std::vector<int64_t> step_routing;  // model.h Model::step_routing
  bool counting_routing = false;
  // The load-balancing loss's counts of MoE layer `layer` for the micro-batch
  // `s`: its own choices per expert, or the step's (moe.aux_scope = "step");
  // f_e = counts[e] / total.
  struct BalanceCounts {
    std::vector<double> counts;
    double total = 0;
  };
  BalanceCounts balance_counts(int64_t layer, const MoeActs& s) const;
  int64_t moe_layer_index(int64_t layer) const;  // in moe_stats
  bool recording_moe = false;
  float aux_weight = 0;
  std::map<std::pair<int, int64_t>, Activations> staged;  // (chunk, micro-batch) in flight
  Workspace ws;
};

}  // namespace meshtrain

namespace meshtrain {

template <typename Classifier>
void Model::Impl::head_forward(Activations& acts, const Tensor& last, DType dt,
                               Classifier&& classifier) {
  before(head_unit, UnitPass::forward);
  if (tied) before(embed_unit, UnitPass::forward);
  acts.head_input = column_input(final_norm, last, dt, acts.hn, acts.mean_f, acts.rstd_f,
                                 acts.batch * acts.seq, acts.category);
  classifier();
  if (tied) after(embed_unit, UnitPass::forward);
  after(head_unit, UnitPass::forward);
}

}  // namespace meshtrain
