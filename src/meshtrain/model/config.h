// Model shape for the two supported families and the named presets.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "meshtrain/backend/ops.h"
#include "meshtrain/tensor/dtype.h"

namespace meshtrain {

enum class Family { llama, gpt2 };
std::string_view family_name(Family family);
std::vector<std::string> family_names();  // every family, in enum order
// "llama" | "gpt2"; throws Error naming `field` ("model.family") and the known names.
Family parse_family(std::string_view name, std::string_view field = "model family");

enum class NormKind : uint8_t { rms, layer };          // RMSNorm (weight); LayerNorm (weight, bias)
enum class FeedForward : uint8_t { swiglu, gelu };     // gated SwiGLU; GELU MLP (tanh approximation)
enum class Positions : uint8_t { rope, learned };      // rotary; a learned table added to the input

// What a family's model is made of, as data: the model, the planner and the
// exporters read these instead of testing the family by name. A family is
// its recipe plus its checkpoint name map (model/params.cpp, ckpt/hf.cpp).
struct Recipe {
  std::string_view name;
  NormKind norm;
  FeedForward feed_forward;
  Positions positions;
  bool linear_bias;          // every linear layer has a bias
  bool grouped_query;        // n_kv_heads may be below n_heads
  bool always_tied;          // the output layer is the token embedding, whatever tie_embeddings says
  bool conv1d;               // linear weights stored [in, out] (GPT-2's Conv1D), else [out, in]
  bool dropout;              // its published training recipe uses dropout (the planner's "auto")
  // A prefix of every parameter name that some of the family's checkpoints
  // leave out (GPT-2's "transformer."); empty: none.
  std::string_view omittable_prefix;
  // The checkpoint name map of a block: its parameter names start with
  // layer_prefix ({} = the layer); the two norms' modules (".weight", and
  // ".bias" for a LayerNorm); the modules of its four GEMMs, in output order
  // (qkv, attention output, feed-forward in, feed-forward out), whose
  // weights (and biases) are stored one after another and run as one GEMM.
  std::string_view layer_prefix;
  std::array<std::string, 2> norm_modules;
  std::array<std::vector<std::string>, 4> gemm_modules;
  // LoRA: every target name (registry order) and the default targets.
  std::vector<std::string> lora_targets, lora_default;
  // The feed-forward's input projection's width over hidden_dim (gate and up: 2).
  int64_t ff_in_factor() const { return feed_forward == FeedForward::swiglu ? 2 : 1; }
  // f32 values a norm saves per row for its backward: rstd (and the mean).
  int64_t norm_stats() const { return norm == NormKind::layer ? 2 : 1; }
};
const Recipe& recipe(Family family);

// fp32: everything f32. bf16 / fp16: bf16 / f16 compute copies of matmul
// weights and matmul inputs, f32 master weights, f32 gradients and f32 AdamW
// state (fp16 trains with dynamic loss scaling: train/update_gate.h).
enum class Precision { fp32, bf16, fp16 };
Precision parse_precision(std::string_view name);  // "fp32" | "bf16" | "fp16"
std::string_view precision_name(Precision precision);
inline DType compute_dtype(Precision precision) {
  switch (precision) {
    case Precision::bf16: return DType::bf16;
    case Precision::fp16: return DType::f16;
    case Precision::fp32: break;
  }
  return DType::f32;
}

enum class Recompute { none, selective, full };
Recompute parse_recompute(std::string_view name);  // "none" | "selective" | "full"
std::string_view recompute_name(Recompute recompute);

// Activation checkpointing of the training passes (forward_backward,
// stage_forward / stage_backward), per block (docs/distributed.md#activation-checkpointing):
//  none: a block keeps everything its backward reads (model_impl.h BlockActs).
//  selective: it does not keep the attention probabilities, the norm outputs
//    (and their stats) or the MLP activation output; its backward recomputes
//    them (probabilities per (batch, kv head) group inside the attention
//    backward, never all at once). No communication is repeated.
//  full: it keeps only its input (the residual stream); its backward first
//    runs its forward again (tensor-parallel collectives included, in the
//    forward's order on every rank), between before(u, backward) and
//    after(u, backward), so a ZeRO-3 unit is gathered then anyway.
// layers (full only): only the first `layers` blocks of each chunk of layers
// (the whole model: of all layers) are recomputed, the others keep everything
// (Megatron's "block" method); 0 = all. The recomputed tensors of one block
// at a time live in one shared set (category activations). Recomputation
// runs the forward's kernels on the same inputs, so gradients and losses are
// bit-identical to `none`.
struct RecomputePolicy {
  Recompute mode = Recompute::none;
  int64_t layers = 0;
};

// RoPE frequency scaling, as Hugging Face's rope_type names it. none: the
// plain frequencies theta^(-2i/head_dim). linear: every frequency / factor
// (positions stretched). llama3: Llama 3.1's rule: wavelengths above
// original_max_seq / low_freq_factor are divided by factor, those below
// original_max_seq / high_freq_factor are kept, those between are blended.
enum class RopeType { none, linear, llama3 };
std::string_view rope_type_name(RopeType type);  // "default" | "linear" | "llama3" (HF's names)

struct RopeScaling {
  RopeType type = RopeType::none;
  float factor = 1.0f;            // linear, llama3
  float low_freq_factor = 1.0f;   // llama3
  float high_freq_factor = 4.0f;  // llama3
  int64_t original_max_seq = 8192;  // llama3: the context the model was pretrained at
  bool operator==(const RopeScaling&) const = default;
};

// LoRA (Hu et al. 2021) on the model's linear layers: rank 0 = off. With
// rank > 0 every base parameter is frozen and each targeted linear W gets
// trainable adapters A [rank, in] and B [out, rank] (PEFT's shapes):
// y = W x + (alpha / rank) * B (A dropout(x)). targets are module short
// names (llama: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj;
// gpt2: c_attn c_proj c_fc, c_proj meaning both the attention and the MLP
// one). docs/finetune.md#lora.
// quantize_base = nf4 (QLoRA, docs/finetune.md#qlora): the frozen weights of
// every block linear (all the modules LoRA can target, adapted or not) are
// held as NF4 with double quantisation (tensor/nf4.h) and dequantised into a
// workspace before each GEMM; embeddings, norms, biases and the output layer
// keep the run's precision (bitsandbytes' and PEFT's usual recipe).
enum class BaseQuant { none, nf4 };
std::string_view base_quant_name(BaseQuant quant);  // "none" | "nf4"
BaseQuant parse_base_quant(std::string_view name);   // throws Error naming lora.quantize_base
struct LoraConfig {
  int64_t rank = 0;
  float alpha = 16.0f;
  float dropout = 0.0f;
  std::vector<std::string> targets;  // empty: the family's default
  BaseQuant quantize_base = BaseQuant::none;
  bool enabled() const { return rank > 0; }
  float scale() const { return alpha / static_cast<float>(rank); }
  bool operator==(const LoraConfig&) const = default;
};
// The targets a LoRA config names for `family` (its defaults when empty):
// llama ["q_proj", "v_proj"], gpt2 ["c_attn"].
std::vector<std::string> lora_targets(const LoraConfig& lora, Family family);
// Every target name `family` knows, in registry order.
std::vector<std::string> lora_target_names(Family family);

// Mixture of experts ([moe] in a config; docs/moe.md): a MoE layer's feed-forward is a router
// choosing top_k of `experts` routed experts per token (each the family's
// feed-forward of width hidden_dim), weighted by their router scores, plus
// optional shared experts every token passes through. experts = 0: dense.
// Routing as ops::RouterDims describes (score, renormalize, scaling, groups).
// Layers [0, first_dense) are dense, and after them every `every`-th
// (layer - first_dense divisible by every) is a MoE layer, the others dense.
// Auxiliary losses of each MoE layer and micro-batch, weighted like the
// micro-batch's tokens in the main loss: aux_loss * E * sum_e P_e f_e
// (Switch / GShard in Megatron-Core's form: P_e the mean score of expert e,
// f_e the share of the micro-batch's top_k choices it got; 1 for uniform
// routing) and z_loss * mean_t logsumexp(router logits_t)^2.
struct MoeConfig {
  int64_t experts = 0;
  int64_t top_k = 1;
  int64_t hidden_dim = 0;       // each routed expert's feed-forward width
  ops::RouterScore score = ops::RouterScore::softmax;
  bool renormalize = true;      // divide the k weights by their sum
  float scaling = 1.0f;         // routed_scaling_factor
  int64_t n_groups = 1, topk_groups = 1;  // group-limited routing (DeepSeek-V3)
  int64_t shared_hidden = 0;    // the shared experts' total width; 0: none
  bool shared_gate = false;     // Qwen2-MoE's sigmoid(x . w) on the shared output
  int64_t first_dense = 0;
  int64_t every = 1;
  float aux_loss = 0.0f;
  float z_loss = 0.0f;
  // The load-balancing loss's f_e (the share of the choices expert e got):
  // false, each micro-batch's own (Megatron's default); true ("step"), the
  // whole step's, every micro-batch of every dp rank, counted by a
  // forward-only routing pass over the step's micro-batches before their
  // training passes (one more forward per step; docs/moe.md).
  bool aux_per_step = false;
  // > 0: each expert takes at most ceil(capacity_factor * N * top_k / E) of a
  // micro-batch's N tokens, those of the highest routing weight (ties: the
  // lower token); the other choices are dropped (they add nothing: the
  // residual passes through). 0: dropless.
  float capacity_factor = 0.0f;
  // > 0: DeepSeek-V3's auxiliary-loss-free balancing: each MoE layer has a
  // per-expert selection bias (frozen parameter mlp.gate.e_score_correction_bias,
  // saved in checkpoints) added to the scores for the top-k choice only;
  // after every applied optimizer step, bias += rate * sign(mean load - load)
  // over the step's choices summed over the dp ranks, made zero-mean.
  float bias_update_rate = 0.0f;
  int64_t capacity(int64_t tokens) const {
    return static_cast<int64_t>(std::ceil(static_cast<double>(capacity_factor) *
                                          static_cast<double>(tokens * top_k) /
                                          static_cast<double>(experts)));
  }
  bool enabled() const { return experts > 0; }
  bool is_moe_layer(int64_t layer) const {
    return enabled() && layer >= first_dense && (layer - first_dense) % every == 0;
  }
  bool operator==(const MoeConfig&) const = default;
};
std::string_view router_score_name(ops::RouterScore score);  // "softmax" | "sigmoid"

// RMSNorm of the queries and keys after their projection, before RoPE
// (rope families only). head: over each head's head_dim values, one weight
// [head_dim] for q and one for k (Qwen3, Qwen3-MoE: self_attn.q_norm /
// k_norm). full: over the whole projection, weights [n_heads * head_dim] and
// [n_kv_heads * head_dim] (OLMoE), which tensor parallelism cannot split
// (its statistic spans the heads).
enum class QkNorm : uint8_t { none, head, full };
std::string_view qk_norm_name(QkNorm norm);  // "none" | "head" | "full"
QkNorm parse_qk_norm(std::string_view name);  // throws Error naming model.qk_norm
ops::RouterScore parse_router_score(std::string_view name);  // throws Error naming moe.score

// DeepSeek-V2/V3's multi-head latent attention (MLA), for the planner only:
// the engine does not build it (build_param_specs refuses it). Per layer,
// q = q_b(RMSNorm(q_a(x))) (q_a, q_b: ranks q_rank; 0: q projected from x
// directly), [c_kv, k_rope] = kv_a(x), [k_nope, v] = kv_b(RMSNorm(c_kv)); each
// head's key is [k_nope, k_rope] (k_rope shared by the heads), its query as
// wide (nope_dim + rope_dim), its value v_dim; o_proj reads n_heads * v_dim.
struct MlaConfig {
  int64_t q_rank = 0;    // q_lora_rank
  int64_t kv_rank = 0;   // kv_lora_rank; 0: no MLA
  int64_t nope_dim = 0;  // qk_nope_head_dim
  int64_t rope_dim = 0;  // qk_rope_head_dim
  int64_t v_dim = 0;     // v_head_dim
  bool enabled() const { return kv_rank > 0; }
  bool operator==(const MlaConfig&) const = default;
};

struct ModelConfig {
  Family family = Family::llama;
  int64_t dim = 0;
  int64_t n_layers = 0;
  int64_t n_heads = 0;
  int64_t n_kv_heads = 0;   // grouped-query attention (llama); == n_heads for gpt2
  // Each head's width; 0: dim / n_heads. Qwen3 uses 128 whatever dim is, so
  // the attention's width n_heads * head_dim may differ from dim.
  int64_t head_width = 0;
  bool qkv_bias = false;    // q, k and v projections have biases (Qwen2); rope families only
  QkNorm qk_norm = QkNorm::none;
  // Sliding-window attention (Mistral): each token attends the `sliding_window`
  // latest tokens, itself included, in training, evaluation and decoding; 0:
  // the whole causal prefix.
  int64_t sliding_window = 0;
  int64_t hidden_dim = 0;   // feed-forward width (SwiGLU hidden for llama, 4*dim for gpt2)
  int64_t vocab_size = 0;
  int64_t max_seq_len = 0;
  float norm_eps = 1e-5f;
  float rope_theta = 10000.0f;  // llama only
  RopeScaling rope_scaling;     // llama only; default: none (unscaled)
  bool tie_embeddings = true;   // output layer shares the token embedding
  float init_std = 0.02f;
  LoraConfig lora;              // off by default
  MoeConfig moe;                // dense by default
  MlaConfig mla;                // planner only; off by default

  int64_t head_dim() const { return head_width > 0 ? head_width : dim / n_heads; }
  int64_t attention_width() const { return n_heads * head_dim(); }  // q's and o_proj's input
  // QK-norm (qk_norm) of one layer on a rank holding q and kv widths of the
  // projections: its two weights' elements, and the f32 values a row keeps for
  // backward (its q|k input and a statistic per group). Zero without QK-norm.
  struct QkNormSizes {
    double weights = 0, row_values = 0;
  };
  QkNormSizes qk_norm_sizes(double q, double kv) const;
  const Recipe& recipe() const { return meshtrain::recipe(family); }
  // Whether the output layer is the token embedding.
  bool tied_output() const { return recipe().always_tied || tie_embeddings; }
  // RoPE's inverse frequencies [head_dim / 2] (theta and scaling), computed in
  // float in the order of HF's rope init functions so angles match PyTorch's.
  std::vector<float> rope_frequencies() const;
  // Throws Error naming the first invalid field ("model.n_heads: ...").
  void validate() const;
  // Parameter count (tied output counted once); every expert counted.
  int64_t num_params() const;
  // Model FLOPs per token of training (forward + backward): 6 * matmul params
  // (incl. output layer; 4 for a frozen one: no weight gradient, LoRA's base,
  // as plan/ counts it; a routed expert's times top_k / experts: the active
  // parameters) + 12 * layers * seq * n_heads * head_dim for attention (PaLM
  // convention).
  double train_flops_per_token(int64_t seq) const;
  // The sequence length attention FLOP counts (s keys per query, PaLM's
  // convention) take for rows of `seq` tokens: `seq`, or under a sliding
  // window shorter than it `seq` scaled by the share of the causal (query,
  // key) pairs the window keeps.
  double attention_seq(double seq) const;
};

// A Llama shape: RMSNorm, RoPE, SwiGLU of width `hidden`, `kv_heads` key/value heads.
ModelConfig llama_shape(int64_t dim, int64_t layers, int64_t heads, int64_t kv_heads,
                        int64_t hidden, int64_t vocab, int64_t max_seq, bool tied,
                        float rope_theta = 10000.0f);
// A GPT-2 shape: LayerNorm, learned positions, GELU MLP of 4 * dim, tied output.
ModelConfig gpt2_shape(int64_t dim, int64_t layers, int64_t heads, int64_t vocab,
                       int64_t max_seq);

// Named shapes: "llama-tiny", "llama-60M", "gpt2-124M", "stories260K".
ModelConfig model_preset(std::string_view name);
std::vector<std::string> model_preset_names();

}  // namespace meshtrain
