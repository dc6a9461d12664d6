#include "meshtrain/plan/memory.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>

#include "meshtrain/model/params.h"
#include "meshtrain/plan/option_names.h"
#include "meshtrain/plan/transformer.h"
#include "meshtrain/tensor/memory_tracker.h"
#include "meshtrain/util/error.h"

namespace meshtrain::plan {

namespace {

constexpr OptionNames<Schedule, 4> kSchedule{"schedule",
                                             {"gpipe", "1f1b", "interleaved", "dualpipe"}};
constexpr OptionNames<Offload, 2> kOffload{"offload", {"none", "optimizer"}};
constexpr OptionNames<Optimizer, 2> kOptimizer{"optimizer", {"adamw", "sgd"}};

}  // namespace

std::string_view schedule_name(Schedule s) { return kSchedule.name(s); }
Schedule parse_schedule(std::string_view name) { return kSchedule.parse(name); }
std::string_view offload_name(Offload o) { return kOffload.name(o); }
Offload parse_offload(std::string_view name) { return kOffload.parse(name); }
std::string_view optimizer_name(Optimizer o) { return kOptimizer.name(o); }
Optimizer parse_optimizer(std::string_view name) { return kOptimizer.parse(name); }

StateBytes state_bytes(Precision precision, Optimizer optimizer) {
  const double moments = optimizer == Optimizer::adamw ? 8 : 4;  // Adam m and v; SGD momentum
  if (precision == Precision::bf16) return {2, 2, 4 + moments};  // + fp32 master copy
  return {4, 4, moments};
}

ModelStates model_state_memory(double psi, const StateBytes& b, int zero_stage, int64_t n) {
  MESHTRAIN_CHECK(zero_stage >= 0 && zero_stage <= 3, "plan: zero stage must be 0..3, got {}",
                  zero_stage);
  MESHTRAIN_CHECK(n > 0, "plan: data-parallel size must be > 0, got {}", n);
  const double shards = static_cast<double>(n);
  ModelStates s;
  s.params = b.weights * psi / (zero_stage >= 3 ? shards : 1.0);
  s.grads = b.grads * psi / (zero_stage >= 2 ? shards : 1.0);
  s.optimizer = b.optimizer * psi / (zero_stage >= 1 ? shards : 1.0);
  return s;
}

// DeepSpeed counts 16-bit weights and gradients whole on every GPU at ZeRO-2
// (4 bytes) and 16 bytes of fp32 state sharded; ZeRO-3 shards 18 bytes and
// keeps the largest layer's fp32 copy (4 bytes per parameter) live.
double deepspeed_zero2_gpu_bytes(double params, int64_t gpus_per_node, int64_t nodes) {
  const double gpus = static_cast<double>(gpus_per_node * nodes);
  return 4 * params + 16 * params / gpus;
}

double deepspeed_zero3_gpu_bytes(double params, double largest_layer_params,
                                 int64_t gpus_per_node, int64_t nodes) {
  const double gpus = static_cast<double>(gpus_per_node * nodes);
  return 4 * largest_layer_params + 18 * params / gpus;
}

namespace {

struct Dims {
  double s, b, h, a, f, t, e;
  double full_seq;  // the keys every query attends to (s = this rank's seq / cp)
  AttentionShape attention;
};

Dims dims(const ActivationShape& x) {
  const ModelConfig& c = x.model;
  return {static_cast<double>(x.seq) / static_cast<double>(x.cp), static_cast<double>(x.micro_batch),
          static_cast<double>(c.dim), static_cast<double>(c.n_heads),
          static_cast<double>(c.hidden_dim), static_cast<double>(x.tp), x.value_bytes,
          static_cast<double>(x.seq), attention_shape(c)};
}

}  // namespace

double layer_activation_bytes(const ActivationShape& x) {
  const Dims d = dims(x);
  const double sbh = d.s * d.b * d.h, sb = d.s * d.b, mask = x.dropout ? 1.0 : 0.0;
  // Korthikanti et al. count 2-byte values and 1-byte masks; `e` scales the values.
  const double half = d.e / 2;
  if (x.recompute == Recompute::full) {
    return d.e * sbh / (x.sequence_parallel ? d.t : 1.0);
  }
  // What the linear layers keep: 16-bit values unless their GEMMs run in FP8.
  const double q = x.linear_input_bytes > 0 ? x.linear_input_bytes : d.e;
  // The two norms' inputs (4sbh), the attention and MLP inputs (2sbh each), masks.
  const double whole = half * 4 * sbh + q * 2 * sbh + mask * 2 * sbh;
  // Gated MLP: gate|up (2sbf values) and their product (sbf); selective
  // recomputation recomputes the product from gate|up in backward.
  const bool gated = x.model.recipe().feed_forward == FeedForward::swiglu;
  const double mlp = gated ? (x.recompute == Recompute::selective ? 2 : 3) : 2;
  const AttentionShape& at = d.attention;
  const double qkv = at.qk + at.k + at.v -
                     (x.recompute == Recompute::selective ? at.from_latent : 0);
  const double split = d.e * sb * qkv + q * sb * at.values() + q * mlp * sb * d.f;
  const double core = (half * 2 + mask * (1 + 2 * half)) * d.a * d.s * d.full_seq * d.b;
  // MLA's latents: every tp rank computes them from the whole (gathered) input.
  double bytes = whole / (x.sequence_parallel ? d.t : 1.0) + split / d.t + half * 2 * sb * at.latent;
  if (x.recompute == Recompute::none) bytes += core / d.t;
  return bytes;
}

double first_stage_activation_bytes(const ActivationShape& x) {
  const Dims d = dims(x);
  return (x.dropout ? 1.0 : 0.0) * d.s * d.b * d.h / (x.sequence_parallel ? d.t : 1.0);
}

double last_stage_activation_bytes(const ActivationShape& x) {
  const Dims d = dims(x);
  const double split_h = x.sequence_parallel ? d.t : 1.0;
  const double vocab = static_cast<double>(x.model.vocab_size);
  return 2 * d.e * d.s * d.b * d.h / split_h + 4 * d.s * d.b * vocab / d.t;
}

double inflight_microbatches(Schedule schedule, int64_t p, int64_t v, int64_t m, int64_t stage) {
  MESHTRAIN_CHECK(p > 0 && v > 0 && m > 0 && stage >= 0 && stage < p,
                  "plan: bad pipeline (p {}, v {}, m {}, stage {})", p, v, m, stage);
  switch (schedule) {
    case Schedule::gpipe:
      return static_cast<double>(m);
    case Schedule::one_f_one_b:
      return static_cast<double>(std::min(p - stage, m));
    case Schedule::interleaved: {
      const int64_t chunks = std::min(2 * (p - stage - 1) + (v - 1) * p + 1, m * v);
      return static_cast<double>(chunks) / static_cast<double>(v);
    }
    case Schedule::dualpipe:
      return static_cast<double>(std::min(p + 1, m));
  }
  return 0;
}

double bubble_fraction(int64_t p, int64_t v, int64_t m) {
  return static_cast<double>(p - 1) / (static_cast<double>(v) * static_cast<double>(m));
}

std::vector<std::pair<std::string, double>> categories(const MemoryBreakdown& m) {
  return {{std::string(mem_category_name(MemCategory::params)), m.params},
          {std::string(mem_category_name(MemCategory::grads)), m.grads},
          {std::string(mem_category_name(MemCategory::optimizer)), m.optimizer},
          {std::string(mem_category_name(MemCategory::activations)), m.activations},
          {std::string(mem_category_name(MemCategory::workspace)), m.workspace},
          {std::string(mem_category_name(MemCategory::comm)), m.comm},
          {std::string(mem_category_name(MemCategory::offloaded)), m.offloaded},
          {"fragmentation", m.fragmentation}};
}

MemoryBreakdown engine_memory(const ModelConfig& c, Precision precision, int64_t micro_batch,
                              int64_t seq, const RecomputePolicy& recompute, int64_t cp,
                              CpComm method) {
  c.validate();
  MESHTRAIN_CHECK(micro_batch > 0 && seq > 0 && seq <= c.max_seq_len,
                  "plan: micro-batch {} and seq {} must be > 0 (seq <= max_seq_len {})",
                  micro_batch, seq, c.max_seq_len);
  MESHTRAIN_CHECK(cp >= 1 && seq % (2 * cp) == 0, "plan: seq {} does not divide by 2 x cp {}", seq,
                  cp);
  const bool ring = cp > 1 && method == CpComm::ring;
  const bool alltoall = cp > 1 && method == CpComm::alltoall;
  double params = 0, matmul = 0;
  for (const ParamSpec& spec : build_param_specs(c)) {
    params += static_cast<double>(spec.numel());
    if (spec.matmul_weight) matmul += static_cast<double>(spec.numel());
  }
  const bool mixed = precision != Precision::fp32;  // bf16 or fp16: 2-byte compute copies
  const double e = mixed ? 2 : 4;
  MemoryBreakdown m;
  m.params = 4 * params + (mixed ? 2 * matmul : 0);
  m.grads = 4 * params;
  m.optimizer = 8 * params;  // AdamW exp_avg and exp_avg_sq, f32

  // model_impl.h: residuals f32 (L + 1), per block BlockActs, final norm.
  // This rank's tokens; the keys each one attends to: the whole sequence.
  const double whole = static_cast<double>(seq);
  const double n = static_cast<double>(micro_batch * seq / cp), d = static_cast<double>(c.dim);
  const double q = static_cast<double>(c.attention_width());
  const double kv = static_cast<double>(c.n_kv_heads * c.head_dim());
  const double f = static_cast<double>(c.hidden_dim);
  const ModelConfig::QkNormSizes qk = c.qk_norm_sizes(q, kv);
  const double qk_row = qk.row_values, qk_weights = qk.weights;
  const double ff_in = static_cast<double>(c.recipe().ff_in_factor()) * f;
  const double stats = 4 * static_cast<double>(c.recipe().norm_stats()) * n;  // rstd (+ mean) f32
  // The all-gather keeps probabilities against every key and the whole
  // sequence's k and v; the ring keeps none, its own k/v block and the LSE.
  const double heads = static_cast<double>(micro_batch * c.n_heads);
  const double probs = ring ? 0 : heads * static_cast<double>(seq / cp) * whole;
  const double qkv_kept = ring       ? e * n * (q + 2 * kv) + 4 * heads * static_cast<double>(seq / cp)
                          : alltoall ? e * n * (q + 2 * kv)
                                     : e * (n * q + 2 * static_cast<double>(micro_batch) * whole * kv);
  // What selective recomputation drops (model/recompute.cpp): norm outputs
  // and stats, the MLP activation output and the probabilities.
  const double recomputed = 2 * (e * n * d + stats)  // xn1, xn2
                            + e * n * f;             // ff_act
  const double block = recomputed                  //
                       + qkv_kept                  // q, k, v (ring: + LSE)
                       + 4 * n * qk_row            // QK-norm's input and stats
                       + e * probs                 // softmax probabilities
                       + e * n * q                 // attention output
                       + 4 * n * d                 // mid residual
                       + 4 * n * ff_in;            // ff_pre
  const double layers = static_cast<double>(c.n_layers);
  // Kept per layer, plus the one shared set a recomputing block works in.
  double kept = layers * block, shared = 0;
  if (recompute.mode == Recompute::selective) {
    kept = layers * (block - recomputed - e * probs);
    shared = recomputed;
  } else if (recompute.mode == Recompute::full) {
    const double full = recompute.layers == 0 ? layers
                                              : std::min<double>(layers, recompute.layers);
    kept = (layers - full) * block;
    shared = full > 0 ? block : 0;
  }
  m.activations = 4 * n * d * (layers + 1) + kept + shared + e * n * d + stats;
  // Workspace (model_impl.h Workspace): qkv, dres, dres_c, dx, dff, dff_c, dqkv.
  const double qkv = q + 2 * kv;
  m.workspace = 4 * n * qkv + 4 * n * d + (mixed ? e * n * d : 0) + 4 * n * std::max(d, q) +
                4 * n * std::max(f, qkv) + e * n * ff_in + e * n * qkv + 4 * qk_weights;
  // The CPU backend's fused classifier: its logits chunk (256 rows), in fp32
  // the output layer's gradient accumulated transposed ([dim, vocab]); and
  // RoPE's cos/sin tables.
  if (cp > 1) {
    // The exchange buffers: all-gather: this rank's k/v and the group's (e),
    // their gradients (f32); ring: two blocks of each in flight. Per-token
    // positions; the ring's running softmax and dQ.
    m.comm = alltoall ? (e + 4) * 2 * n * (q + 2 * kv)
                      : (e + 4) * 2 * n * kv * (ring ? 2 : static_cast<double>(1 + cp));
    m.workspace += 4 * n;
    if (ring) m.workspace += 4 * (2 * heads * static_cast<double>(seq / cp) + 2 * n * q);
    if (alltoall) m.workspace += (4 + e) * n * (q + 2 * kv) + 2 * 4 * static_cast<double>(cp) * n;
  }
  const double chunk = std::min(n, 256.0), vocab = static_cast<double>(c.vocab_size);
  m.workspace += chunk * vocab * (4 + (mixed ? 2 : 0)) + (mixed ? 0 : 4 * d * vocab);
  if (c.recipe().positions == Positions::rope) {
    m.workspace += 4 * static_cast<double>(c.max_seq_len * c.head_dim());
  }
  return m;
}

}  // namespace meshtrain::plan
