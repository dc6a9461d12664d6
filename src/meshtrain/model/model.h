// A decoder-only transformer (any family's recipe) with explicit forward and
// backward passes on a Backend. The passes take and return host arrays (ids,
// logits, stage activations) and copy them to and from the backend's device
// explicitly; parameters, gradients and activations stay on the device.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "meshtrain/backend/backend.h"
#include "meshtrain/model/config.h"
#include "meshtrain/model/params.h"
#include "meshtrain/parallel/context/context_parallel.h"
#include "meshtrain/parallel/expert/expert_parallel.h"
#include "meshtrain/parallel/tensor/tensor_parallel.h"

namespace meshtrain {

// Per-sequence state for incremental decoding.
struct KVCache {
  int64_t batch = 0, max_seq = 0, length = 0;
  std::vector<ops::KVCacheLayer> layers;
};

enum class UnitPass { forward, backward };

// Called around each unit's use (see units()). before(u, pass): the model is
// about to read unit u's parameters (in backward: and add to its gradients).
// after(u, pass): it is done with them; after(u, backward) means unit u's
// gradients for this micro-batch are complete. An empty function is not called.
// forward_backward fires, for L layers (tied: embeddings are the output layer):
//   before/after(embed, fwd); before/after(layers.i, fwd) for i = 0..L-1;
//   before(head, fwd) final norm after(head, fwd);
//   before(head, bwd) [tied: before(embed, bwd)] classifier (loss, dW, dh) and
//   final-norm backward after(head, bwd); before/after(layers.i, bwd) for i = L-1..0;
//   [untied: before(embed, bwd)] embedding backward after(embed, bwd).
// forward_loss / forward_logits / decode: embed and layers as above, then
//   before(head, fwd) [tied: before(embed, fwd)] final norm and classifier
//   [tied: after(embed, fwd)] after(head, fwd).
struct UnitHooks {
  std::function<void(size_t unit, UnitPass pass)> before, after;
};

// Per-token loss weights and losses of one pass (preference optimisation,
// train/preference_objective.h): weights [batch * seq]: token i's loss enters
// the gradient weighted by grad_scale * weights[i] (any sign); losses [batch *
// seq]: each token's loss written there (0 where the target is negative).
// weigh: the weights from the pass's own token losses (training passes): the
// classifier runs forward first, weigh(losses, weights) fills the weights
// (host arrays of batch * seq), then the classifier runs with its gradients
// (one more logits GEMM, no second forward of the trunk); it replaces
// `weights`. Null / empty: weight 1, losses not written. Host arrays; on a
// pipeline stage only the head chunk reads or writes them.
struct TokenLoss {
  const float* weights = nullptr;
  float* losses = nullptr;
  std::function<void(const float* losses, float* weights)> weigh;
};

// flat: the model owns three flat buffers in registry order (master f32, grad
// f32, compute bf16 or f16) and every Parameter views them. Frozen parameters
// (ParamSpec::trainable false: LoRA's base) have no grad view, and in mixed
// precision a frozen matmul weight has no master view (its compute copy is its
// value); the grad buffer holds the trainable parameters at grad_offset.
// external: no buffers; Parameter::master / compute / grad stay undefined until
// the owner (ZeRO) binds them to its own memory, at the latest in
// unit_hooks.before(u, pass) for unit u's parameters:
//  - the value view of param_compute_dtype(spec, precision): `compute` (bf16 / f16)
//    for mixed-precision matmul weights, `master` (f32) for everything else; in backward
//    also `grad` (f32, gradients are ADDED; trainable parameters only). Shapes as in the spec.
//  - q|k|v and gate|up (llama) are one GEMM each: their views must be adjacent
//    in memory (registry order), value and grad alike.
//  - the embedding lookup reads `master` of the token embedding if bound, else
//    its bf16 `compute` (a tied bf16 embedding): then the embeddings differ from
//    the flat model's by that bf16 rounding.
//  - an NF4 weight (ParamSpec::nf4, QLoRA): `nf4`, i32 words of its packed
//    bytes (nf4_layout(spec).bytes / 4). copy_nf4_from_global writes a weight
//    whose view is not bound through `nf4_writer`, which the owner sets.
//  - views share their storage: assign Tensor() to release it.
// The model checks the bindings at before(u, pass) and throws Error if one is
// missing. init_weights, sync_compute_weights, zero_grads, flat_master,
// flat_grad and decode throw Error in external mode.
enum class ParamStorage { flat, external };

// A MoE layer's routing statistics, summed over the training forwards since
// Model::reset_moe_stats.
struct MoeLayerStats {
  int64_t layer = 0;
  int64_t micro_batches = 0;
  std::vector<int64_t> tokens;  // [E]: choices each expert received
  int64_t dropped = 0;          // of them, over an expert's capacity
  double aux = 0;    // sum over micro-batches of E * sum_e P_e f_e (1 = uniform)
  double z = 0;      // sum over micro-batches of mean_t lse_t^2
};

// Pipeline parallelism: the part of the model a pipeline rank holds. `chunks`
// are global layer ranges [first, end), increasing, one per virtual stage the
// rank runs (interleaved schedules: several). `first`: chunk 0 begins with the
// embeddings; `last`: the last chunk ends with the final norm and head (tied:
// the token embedding is held too, as the output layer). Parameters keep their
// global names, shapes and initial values. Empty chunks: the whole model.
struct StageLayers {
  std::vector<std::pair<int64_t, int64_t>> chunks;
  bool first = true, last = true;
  bool whole() const { return chunks.empty(); }
};

// Tensor parallelism (tp.size() > 1): every parameter is this rank's slice
// (ParamSpec::split); the tp ranks run the same tokens and exchange
// activations inside each block: one all-reduce per attention and per MLP
// block in forward and one in backward (sequence parallel: an all-gather
// before the column-parallel and a reduce-scatter after the row-parallel
// layer instead, with the residual stream and norms on rows / tp rows, and
// one small all-reduce of the norm weights' gradients per unit). Vocab-parallel
// embedding and loss: no rank holds full-vocabulary logits. Every tp rank
// returns the same loss; replicated parameters get identical gradients.
// Gradients of split parameters are this rank's slice. n_heads, n_kv_heads and
// hidden_dim must divide by tp (Error naming the field otherwise), and under
// sequence parallelism batch * seq too. decode needs tp = 1.
class Model {
 public:
  Model(const ModelConfig& config, Precision precision, Backend& backend,
        ParamStorage storage = ParamStorage::flat, const TensorParallel& tp = {},
        const StageLayers& stage = {}, const ExpertParallel& ep = {});
  ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const ModelConfig& config() const { return config_; }
  Precision precision() const { return precision_; }
  Backend& backend() const { return backend_; }
  ParamStorage storage() const { return storage_; }
  const TensorParallel& tensor_parallel() const { return tp_; }
  // Expert parallelism (ep.size() > 1): each MoE layer holds this rank's
  // E / ep experts (ParamSpec::expert) and exchanges token rows with the ep
  // group in every MoE forward and backward (parallel/expert/expert_parallel.h).
  const ExpertParallel& expert_parallel() const { return ep_; }
  // What this rank holds of every global tensor: each parameter's tp slice
  // (its regions) at its flat offset (params()[i].offset), tp-replicated
  // parameters and a tied output layer's stage copy marked as replicas.
  layout::ShardMap shard_map() const;  // params_shard_map over params()
  // Every parameter's split, in registry order (for gather_tp_flat / scatter_tp_flat).
  std::vector<TensorSplit> param_splits() const;

  // Registry order: embeddings, then per layer, then final norm and (untied) output.
  std::vector<Parameter>& params() { return params_; }
  const std::vector<Parameter>& params() const { return params_; }
  const Parameter& param(const std::string& name) const;  // throws Error if unknown
  Parameter& param(const std::string& name);
  // Contiguous registry ranges in registry order: embed, layers.0 .. layers.{L-1}, head.
  const std::vector<ParamUnit>& units() const { return units_; }
  Tensor& flat_master();  // flat storage only
  Tensor& flat_grad();    // flat storage only
  int64_t num_params() const { return num_params_; }  // this rank's (tp slices)
  bool holds_nf4() const { return holds_nf4_; }  // QLoRA: some weights are NF4
  // Of those, the trainable ones (the flat grad buffer's size; all without LoRA).
  int64_t num_trainable() const { return num_trainable_; }
  // The f32 values of state-space elements [offset, offset + count)
  // (Parameter::offset; every parameter, frozen ones included: a frozen bf16
  // weight is read from / rounded into its compute copy). Flat storage only;
  // after writing call sync_compute_weights.
  void read_values(int64_t offset, int64_t count, float* out);
  void write_values(int64_t offset, int64_t count, const float* in);
  // The f32 master weights of `p` to / from host memory (p.spec.numel()
  // floats) through the backend: how importers and exporters reach the
  // weights, whatever device holds them. After writing, sync_compute_weights.
  // An NF4 weight (ParamSpec::nf4) reads as its dequantised values and is
  // quantised on writing: these values as one tensor (under tp not the whole
  // tensor's quantisation: copy_nf4_from_global is).
  void copy_master_to_host(const Parameter& p, float* dst) const;
  void copy_master_from_host(Parameter& p, const float* src);
  // An NF4 weight from the whole tensor's values (its global shape): quantised
  // whole, this rank's slice kept (nf4::Form::slice under tp), so every tp
  // layout holds the tp = 1 values bit for bit.
  void copy_nf4_from_global(Parameter& p, const float* global);
  // p's master values += delta (p.spec.numel() floats), through the host; an
  // f32 parameter (its master is what the model reads).
  void add_to_master(Parameter& p, std::span<const float> delta);

  // Layout-independent initialisation from the seed.
  void init_weights(uint64_t seed);
  // Refreshes the bf16 / f16 compute copies from the f32 master weights (no-op for fp32).
  // Call after changing master weights by hand (load, init); the optimizer
  // writes the copies itself.
  void sync_compute_weights();
  void zero_grads();

  // One micro-batch: tokens/targets [batch * seq]. Gradients are ADDED to the
  // grad buffer, each token's loss weighted by grad_scale (so grad_scale =
  // 1 / loss-tokens-in-the-optimizer-step gives the mean over the step). A
  // negative target is ignored (no loss, no gradient: SFT prompts, padding).
  // positions (packed records, ops::AttentionDims::positions): [batch * seq]
  // each token's position in its record; attention never crosses a record
  // and positions (RoPE, learned) restart at 0. nullptr: one sequence per row.
  // Returns the sum of the token losses.
  // `loss`: per-token weights and losses (TokenLoss).
  double forward_backward(const int32_t* tokens, const int32_t* targets, int64_t batch,
                          int64_t seq, float grad_scale, const int32_t* positions = nullptr,
                          const TokenLoss& loss = {});
  // LoRA adapter dropout (lora.dropout > 0) in the following forward_backward
  // calls: element (row, j) of an adapter's input is kept iff
  // uniform_at(stream_key(seed, "lora_dropout.<step>.<module>"), (samples[b] *
  // seq + t) * in + j) >= p, row = b * seq + t (then scaled by 1 / (1 - p)), so
  // the mask depends on the sample and position, never on the layout or the
  // micro-batch split. samples: each row's sample index (MicroBatch::samples);
  // forward_backward throws Error when their count is not its batch. Evaluation
  // passes never drop. Pipeline stage passes refuse lora.dropout > 0.
  void set_lora_dropout(uint64_t seed, int64_t step, std::vector<int64_t> samples);

  // Forward only: sum of token losses (evaluation); each token's in
  // loss.losses when set.
  double forward_loss(const int32_t* tokens, const int32_t* targets, int64_t batch, int64_t seq,
                      const int32_t* positions = nullptr, const TokenLoss& loss = {});
  // LoRA: whether the adapters add their terms in the following forward
  // passes (default on). Off, the model computes its frozen base: the
  // reference policy of preference optimisation, without a second copy.
  void set_adapters_enabled(bool on);
  // Forward only: full logits [batch * seq, vocab] f32 (tests, small inputs;
  // under tp the slices are all-gathered, on every rank).
  void forward_logits(const int32_t* tokens, int64_t batch, int64_t seq, float* logits,
                      const int32_t* positions = nullptr);

  // Pipeline stage passes (a model built with StageLayers; also the whole
  // model as one stage). Chunk c of stage_layers().chunks on micro-batch mb:
  // stage_forward keeps that pass's activations, keyed by (c, mb), until
  // stage_backward(c, mb) frees them, so several micro-batches can be in
  // flight. Activations between stages are [stage_rows(batch, seq), dim] f32
  // (this rank's rows under sequence parallelism).
  // stage_forward: the embedding chunk reads `tokens`, others `input`; writes
  // `output` unless the chunk ends with the head (null there). `positions`
  // as in forward_backward (every chunk needs them: its attention); kept with
  // the pass's activations for its backward.
  void stage_forward(int chunk, int64_t micro_batch, const int32_t* tokens, const float* input,
                     int64_t batch, int64_t seq, float* output, const int32_t* positions = nullptr);
  // stage_backward: the head chunk computes the loss of `targets` (returns the
  // sum of token losses; gradients weighted by grad_scale and ADDED), other
  // chunks start from `output_grad`. Writes `input_grad` unless the chunk
  // begins with the embeddings (which need `tokens`). Hooks fire as in
  // forward_backward for the chunk's units; with tied embeddings on a last
  // stage that is not the first, the output layer (unit embed) completes at
  // the end of the head chunk's backward.
  // `loss` as in forward_backward (the head chunk's).
  double stage_backward(int chunk, int64_t micro_batch, const int32_t* tokens,
                        const int32_t* targets, float grad_scale, const float* output_grad,
                        float* input_grad, const TokenLoss& loss = {});
  // Evaluation: the sum of token losses of a head chunk's held forward (each
  // token's in loss.losses when set); frees its activations (no gradients).
  double stage_loss(int chunk, int64_t micro_batch, const int32_t* targets,
                    const TokenLoss& loss = {});
  int64_t stage_rows(int64_t batch, int64_t seq) const;
  // Passes whose activations are held (forward done, backward not yet).
  size_t stage_in_flight() const;
  // Frees every held activation (after a failed step).
  void drop_stage_activations();
  // As constructed, with empty chunks filled in as one chunk of all layers.
  const StageLayers& stage_layers() const { return stage_; }
  // This stage's parameter i is also held by another stage (a tied output
  // layer on the last stage): whole-model sums must skip it.
  bool param_is_duplicate(size_t i) const;

  // Mixture of experts: each MoE layer's routing statistics (this stage's, in
  // layer order), summed over the training forwards since reset_moe_stats.
  const std::vector<MoeLayerStats>& moe_stats() const;
  void reset_moe_stats();
  // The most expert-side rows one MoE layer's experts on this rank got from
  // one pass (R: the ep group's rows for its experts, any forward, since the
  // model was made); 0 before the first. The memory plan's routed basis.
  int64_t max_expert_rows() const;
  // moe.aux_scope = "step": the step's choices per expert of this stage's MoE
  // layers ([MoE layer in moe_stats order][E], summed by the caller over the
  // dp ranks), which the load-balancing loss's f then reads instead of the
  // micro-batch's. While count_routing(true), every forward adds its choices.
  std::vector<int64_t>& step_routing();
  void count_routing(bool on);
  // DeepSeek-V3's balancing (moe.bias_update_rate > 0; config.h MoeConfig):
  // MoE layer `layer`'s selection bias (empty without one), and its update
  // from the step's choices per expert (summed over every rank that routed
  // that layer's tokens): bias += rate * sign(mean - load), made zero-mean.
  // A no-op without a bias. The parameter's master must be bound.
  std::vector<float> selection_bias(int64_t layer) const;
  void update_selection_bias(int64_t layer, std::span<const int64_t> tokens);
  // The same for any storage: the bias's registry index (none without one),
  // and the change the loads ask for (added to it by whoever owns its values).
  std::optional<size_t> selection_bias_param(int64_t layer) const;
  std::vector<float> selection_bias_change(std::span<const int64_t> tokens) const;

  // Unit indices into units(); used by data parallelism and ZeRO.
  UnitHooks unit_hooks;
  // External storage: receives an NF4 weight's packed bytes (registry index,
  // nf4_layout(spec).bytes) when its `nf4` view is not bound.
  std::function<void(size_t param, std::span<const uint8_t> packed)> nf4_writer;

  // Activation checkpointing (config.h RecomputePolicy). Frees every held
  // activation (training and stages) and applies `policy`
  // from the next forward. Throws Error naming recompute_layers when it is
  // negative or set without mode full.
  void set_recompute(const RecomputePolicy& policy);
  const RecomputePolicy& recompute() const;

  // Context parallelism (cp.size() > 1; parallel/context/context_parallel.h):
  // every training pass's rows then hold this rank's tokens of sequences cp
  // times longer, their positions required (record-local in packed rows,
  // global indices otherwise); attention all-gathers K and V over the cp
  // group and reduce-scatters their gradients. Set before the first pass.
  void set_context_parallel(const ContextParallel& cp) { cp_ = cp; }
  const ContextParallel& context_parallel() const { return cp_; }

  // Incremental decoding with a KV cache.
  KVCache make_kv_cache(int64_t batch, int64_t max_seq);
  // Runs tokens [batch, n_new] at positions [cache.length, cache.length + n_new),
  // appends to the cache and writes the last position's logits [batch, vocab].
  void decode(const int32_t* tokens, int64_t batch, int64_t n_new, KVCache& cache,
              float* last_logits);

 private:
  struct Impl;  // layers and saved activations, in model.cpp
  void require_flat(const char* what) const;  // throws Error in external storage
  void require_whole(const char* what) const;  // throws Error on a pipeline stage
  // Checks stage_, drops the parameters and units other stages hold from
  // specs / units_ and fills local_index_ (stage.cpp).
  void select_stage(std::vector<ParamSpec>& specs);
  ModelConfig config_;
  Precision precision_;
  Backend& backend_;
  ParamStorage storage_;
  TensorParallel tp_;
  StageLayers stage_;
  ExpertParallel ep_;
  ContextParallel cp_;
  // Global registry index -> index in params_ (kNoParam when another stage
  // holds it); empty for the whole model.
  std::vector<size_t> local_index_;
  std::vector<Parameter> params_;
  std::vector<ParamUnit> units_;
  int64_t num_params_ = 0, num_trainable_ = 0;
  Tensor flat_master_, flat_grad_, flat_compute_;
  Tensor flat_nf4_;  // flat storage: the packed NF4 weights (ParamSpec::nf4), bytes in i32 words
  bool holds_nf4_ = false;
  // write_values of an NF4 weight: its values gathered until all have arrived
  // (by Parameter::offset).
  struct NF4Staging {
    std::vector<float> values;
    int64_t written = 0;
  };
  std::map<int64_t, NF4Staging> nf4_staging_;
  std::unique_ptr<Impl> impl_;
};

// The global registry indices (build_param_specs order) a stage holds, in
// its own registry order. Throws Error for invalid layer ranges.
std::vector<size_t> stage_param_indices(const ModelConfig& config, const StageLayers& stage);

// What a stage holds, as data (no tensors): its parameters in its registry
// order and its units (runs of held parameters within each global unit).
// `specs` is the whole registry (build_param_specs, any tp slice); the Model
// is built from the same selection, so a planner reading this sees the
// engine's layout. local_index: global registry index -> stage index
// (kNoParam-like -1 for another stage's); empty when the stage holds all.
struct StageParams {
  std::vector<ParamSpec> specs;
  std::vector<ParamUnit> units;
  std::vector<size_t> local_index;
};
StageParams select_stage_params(const ModelConfig& config, const StageLayers& stage,
                                std::vector<ParamSpec> specs);
// The layout of parameters `specs` stored back to back in that order (a
// stage's, as select_stage_params gives them) on tp rank `tp_rank`: each
// one's tp slice as regions of its global tensor (split_regions), replica 0
// where this rank writes it (tp-replicated ones on tp rank 0; the spec at
// index `duplicate`, a tied output layer's copy on a later stage, never); a
// frozen parameter has master weights only (no moments).
layout::ShardMap params_shard_map(const std::vector<ParamSpec>& specs, int tp_rank,
                                  size_t duplicate = static_cast<size_t>(-1));

// The whole model's gradient norm under tensor parallelism (flat storage):
// every global element counted once (tp_counts_once), collective over tp.
// At tp 1 it is sqrt of the sum over parameters, as global_grad_norm.
double tensor_parallel_grad_norm(const Model& model);
// Whether this tp rank counts parameter `spec` in whole-model sums (the
// gradient norm): tp_counts_once, except routed experts, whole on every tp
// rank (their split is over ep), counted on tp rank 0.
inline bool counts_once_over_tp(const TensorParallel& tp, const ParamSpec& spec) {
  return spec.expert ? tp.rank() == 0 : tp_counts_once(tp, spec.split);
}
// Its square before the root, also for a pipeline stage (whose tied output
// layer copy is skipped): every element this stage holds counted once over
// the tp and ep groups (collective over both).
double grad_sum_squares(const Model& model);

}  // namespace meshtrain
