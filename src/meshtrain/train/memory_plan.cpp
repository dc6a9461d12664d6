#include "meshtrain/train/memory_plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <optional>
#include <nlohmann/json.hpp>

#include "meshtrain/backend/registry.h"
#include "meshtrain/ckpt/distributed.h"
#include "meshtrain/model/model.h"
#include "meshtrain/model/params.h"
#include "meshtrain/parallel/pipeline/executor.h"
#include "meshtrain/parallel/pipeline/schedule.h"
#include "meshtrain/parallel/zero/flat_param.h"
#include "meshtrain/parallel/zero/memory.h"
#include "meshtrain/parallel/zero/sharded.h"
#include "meshtrain/train/checkpoint.h"
#include "meshtrain/train/data_parallel.h"
#include "meshtrain/train/evaluate.h"
#include "meshtrain/util/error.h"

namespace meshtrain {
namespace {

constexpr size_t idx(MemCategory c) { return static_cast<size_t>(c); }

// The shapes one rank's blocks run on (model_impl.h BlockActs, Workspace).
struct LocalShape {
  double n = 0;  // rows of a micro-batch: micro_batch * seq
  double r = 0;  // residual-stream rows on this rank (n / tp under sequence parallelism)
  double mb = 0, seq = 0, e = 4;  // e: bytes of the compute dtype; seq: this rank's tokens per row
  double whole = 0;  // the keys a query sees: the sequence (seq x cp under context parallelism)
  double cp = 1;
  bool ring = false;      // parallel.cp_comm = "ring"
  bool alltoall = false;  // parallel.cp_comm = "alltoall" (Ulysses)
  double d = 0, q = 0, kv = 0, heads = 0, f = 0, ff_in = 0, vocab = 0;
  double tp = 1;
  double norm_stats = 1;  // f32 values a norm saves per row
  // Mixture of experts (config.h MoeConfig; 0 experts: dense): experts,
  // top_k, routed slots n * k, an expert's and the shared experts' widths.
  double experts = 0, k = 0, slots = 0, moe_f = 0, shared_f = 0;
  // The expert side's rows (model/moe.cpp R): the slots at ep 1; under ep the
  // balanced load (= slots), or the most a micro-batch gave this rank (measured).
  double expert_rows = 0;
  bool shared_gate = false, capacity = false, aux = false;
  // Expert parallelism (parallel.ep > 1): the expert side's buffers, counted
  // at S rows: what a rank receives when the load is balanced (docs/moe.md).
  bool ep = false;
  // QK-norm (config.h QkNorm): the f32 values a row keeps (its q|k input and
  // stats) and its two weights' widths (0: none).
  double qk_row = 0, qk_weights = 0;
  double stats(double rows) const { return 4 * norm_stats * rows; }
  // Attention's saved state (ops::AttentionSaved): the probabilities [mb,
  // heads, seq, whole], and q (local) with k and v (the whole sequence's);
  // the ring: q, this rank's k and v and the f32 log-sum-exp, no probabilities.
  // A fused kernel (BackendKind::fused_attention) keeps its own state instead
  // of the probabilities, also under selective recomputation.
  std::optional<ops::FusedAttentionBytes> fused;
  double probs() const { return ring || fused ? 0 : e * mb * heads * seq * whole; }
  double qkv_saved() const {
    if (ring) return e * n * (q + 2 * kv) + 4 * mb * heads * seq;
    const double own = fused ? static_cast<double>(fused->saved) : 0;
    if (alltoall) return e * n * (q + 2 * kv) + own;  // the sequence's, for heads / cp
    return e * n * q + 2 * e * mb * whole * kv + own;
  }
  // Context parallelism's exchange buffers (model/block.cpp): all-gather:
  // this rank's k and v and the group's, in the compute dtype, and their f32
  // gradients; ring: two blocks in flight of each.
  double cp_buffers() const {
    if (cp <= 1) return 0;
    if (alltoall) return (e + 4) * 2 * n * (q + 2 * kv);  // send and receive, f32 and 16-bit
    const double block = 2 * n * kv;
    return (e + 4) * block * (ring ? 2 : 1 + cp);
  }
  // The ring's workspace: its running softmax (max, sum, output) and dQ.
  double ring_workspace() const { return ring ? 4 * (2 * mb * heads * seq + 2 * n * q) : 0; }
  // Ulysses' workspace: the sequence-order rows (f32 and the compute dtype)
  // and the gathered positions, in rank and in sequence order.
  double alltoall_workspace() const {
    return alltoall ? (4 + e) * n * (q + 2 * kv) + 2 * 4 * cp * n : 0;
  }
};

// Whether a pass carries each token's record position (packed SFT records;
// preference pairs, two conversations to a row).
bool record_positions(const TrainConfig& config) {
  return (config.data.sft() && config.data.sft_pack) || config.data.preference();
}

// The dims attention_forward runs with (model/block.cpp): this rank's heads
// over its tokens, or under Ulysses (cp_comm = "alltoall") heads / cp over
// the whole sequence; nullopt where context parallelism's own kernels run
// (all-gather, ring).
std::optional<ops::AttentionDims> one_rank_attention(const TrainConfig& config,
                                                     int64_t micro_batch) {
  const int64_t tp = config.parallel.tp, cp = config.parallel.cp;
  const ops::AttentionDims local{micro_batch, config.train.seq_len / cp,
                                 config.model.n_heads / tp, config.model.n_kv_heads / tp,
                                 config.model.head_dim()};
  if (cp == 1) return local;
  if (parse_cp_comm(config.parallel.cp_comm) != CpComm::alltoall) return std::nullopt;
  return ops::AttentionDims{micro_batch, config.train.seq_len, local.n_heads / cp,
                            local.n_kv_heads / cp, local.head_dim};
}

LocalShape local_shape(const TrainConfig& config, int64_t micro_batch, int64_t expert_rows = 0) {
  const ModelConfig& c = config.model;
  const auto tp = static_cast<double>(config.parallel.tp);
  LocalShape s;
  s.mb = static_cast<double>(micro_batch);
  s.cp = static_cast<double>(config.parallel.cp);
  const CpComm method = parse_cp_comm(config.parallel.cp_comm);
  s.ring = config.parallel.cp > 1 && method == CpComm::ring;
  s.alltoall = config.parallel.cp > 1 && method == CpComm::alltoall;
  s.whole = static_cast<double>(config.train.seq_len);
  s.seq = s.whole / s.cp;
  s.n = s.mb * s.seq;
  s.tp = tp;
  s.r = config.parallel.sequence_parallel && tp > 1 ? s.n / tp : s.n;
  s.e = static_cast<double>(dtype_size(compute_dtype(config.train.precision)));
  s.d = static_cast<double>(c.dim);
  s.heads = static_cast<double>(c.n_heads) / tp;
  s.q = s.heads * static_cast<double>(c.head_dim());
  s.kv = static_cast<double>(c.n_kv_heads) / tp * static_cast<double>(c.head_dim());
  s.f = static_cast<double>(c.hidden_dim) / tp;
  s.ff_in = static_cast<double>(c.recipe().ff_in_factor()) * s.f;
  s.vocab = static_cast<double>(c.vocab_size) / tp;  // (padded: within a row per rank)
  s.norm_stats = static_cast<double>(c.recipe().norm_stats());
  const ModelConfig::QkNormSizes qk = c.qk_norm_sizes(s.q, s.kv);
  s.qk_row = qk.row_values;
  s.qk_weights = qk.weights;
  if (const MoeConfig& m = c.moe; m.enabled()) {
    s.experts = static_cast<double>(m.experts);
    s.k = static_cast<double>(m.top_k);
    s.slots = s.n * s.k;
    s.moe_f = static_cast<double>(m.hidden_dim);
    s.shared_f = static_cast<double>(m.shared_hidden) / tp;  // a tensor-parallel MLP
    s.shared_gate = m.shared_gate;
    s.capacity = m.capacity_factor > 0;
    s.aux = m.aux_loss > 0;
    s.ep = config.parallel.ep > 1;
    s.expert_rows = s.ep && expert_rows > 0 ? static_cast<double>(expert_rows) : s.slots;
  }
  const BackendKind& kind = backend_kind(config.train.device);
  if (const auto dims = one_rank_attention(config, micro_batch);
      dims && kind.fused_attention != nullptr && !record_positions(config)) {
    s.fused = kind.fused_attention(*dims, compute_dtype(config.train.precision));
  }
  return s;
}

// What a MoE feed-forward keeps for its backward (model_impl.h MoeActs): the
// same bytes whatever the routing, as every buffer has all n * k slots' rows.
double moe_block_bytes(const LocalShape& s) {
  const double n = s.n, S = s.slots, R = s.expert_rows, E = s.experts;
  const bool sp = s.r != s.n;
  double b = (s.e == 4 && !sp ? 0 : 4 * n * s.d)          // x32 (mixed precision, or SP)
             + 4 * n * E + 4 * n                            // probs, lse
             + 2 * 4 * n * s.k + 2 * 4 * S + 4 * E          // indices, weights; slots, rows; counts
             + (s.capacity ? 4 * E : 0)                     // kept
             + s.e * S * s.d + 4 * R * 2 * s.moe_f          // xp, pre
             + s.e * R * s.moe_f + 4 * S * s.d              // act, y
             + (s.ep ? s.e * R * s.d : 0);                  // xe: the rows received
  if (s.shared_f > 0) b += 4 * n * 2 * s.shared_f + s.e * n * s.shared_f + 4 * n * s.d;
  if (s.shared_gate) b += 3 * 4 * n;                        // gate prob, index, weight
  return b;
}

// The Workspace buffers only MoE blocks use (model/moe.cpp).
double moe_workspace_bytes(const LocalShape& s) {
  const double n = s.n, S = s.slots, R = s.expert_rows, E = s.experts;
  double w = 4 * n * E + 4 * n * s.d + 4 * E                // router logits, moe_out, prob sums
             + s.e * S * s.d + 4 * n * s.k                  // d(y), d(weights)
             + 4 * R * s.moe_f + s.e * R * 2 * s.moe_f      // d(act), d(pre)
             + 4 * S * s.d                                  // d(xp)
             + (s.aux ? 4 * E : 0)                          // the load-balancing score gradient
             + (s.ep ? (3 * 4 + s.e) * R * s.d : 0);        // staging, ye, d(xe); d(ye)
  if (s.shared_f > 0) w += 4 * n * s.d;                     // moe_dx
  if (s.shared_gate) w += 4 * n * s.d + 3 * 4 * n;         // shared d; gate d, logits; iota
  if (s.shared_f > 0 && s.tp > 1) w += 4 * n * s.d;         // moe_acc
  return w;
}

// BlockActs: what one block keeps under `mode`, and what its recomputation
// needs in the one shared set (model/recompute.cpp swap_unkept), by field
// group: the parts every block has, a dense feed-forward's (ff_pre, ff_act)
// and a MoE one's (MoeActs): a shared set holds each group's largest.
struct BlockBytes {
  double kept = 0, shared_common = 0, shared_dense = 0, shared_moe = 0;
};

BlockBytes block_bytes(const LocalShape& s, Recompute mode, bool moe) {
  const double norms = 2 * (s.e * s.r * s.d + s.stats(s.r));  // xn1, xn2 and their stats
  const double act = moe ? 0 : s.e * s.n * s.f;                // ff_act
  const double pre = moe ? 0 : 4 * s.n * s.ff_in;              // ff_pre
  const double routed = moe ? moe_block_bytes(s) : 0;         // MoeActs
  const double probs = s.probs();
  const double common = norms + probs                          //
                        + s.qkv_saved()                        // q, k, v
                        + 4 * s.n * s.qk_row                   // QK-norm's input and stats
                        + s.e * s.n * s.q                      // attention output
                        + 4 * s.r * s.d;                       // mid residual
  switch (mode) {
    case Recompute::none: return {common + act + pre + routed, 0, 0, 0};
    case Recompute::selective: return {common - norms - probs + pre + routed, norms, act, 0};
    case Recompute::full: return {0, common, act + pre, routed};
  }
  return {common + act + pre + routed, 0, 0, 0};
}

// One (chunk, micro-batch) in flight: its residuals, blocks and (head) the
// final norm's output; and the shared set its recomputing blocks need.
struct ChunkBytes {
  double held = 0, shared = 0;
};

ChunkBytes chunk_bytes(const LocalShape& s, const RecomputePolicy& policy, const MoeConfig& moe,
                       int64_t first, int64_t end, bool head) {
  ChunkBytes c;
  c.held = 4 * s.r * s.d * static_cast<double>(end - first + 1);
  BlockBytes shared;
  for (int64_t l = first; l < end; ++l) {
    Recompute mode = policy.mode;
    if (mode == Recompute::full && policy.layers > 0 && l - first >= policy.layers) {
      mode = Recompute::none;
    }
    const BlockBytes b = block_bytes(s, mode, moe.is_moe_layer(l));
    c.held += b.kept;
    shared.shared_common = std::max(shared.shared_common, b.shared_common);
    shared.shared_dense = std::max(shared.shared_dense, b.shared_dense);
    shared.shared_moe = std::max(shared.shared_moe, b.shared_moe);
  }
  c.shared = shared.shared_common + shared.shared_dense + shared.shared_moe;
  if (head) c.held += s.e * s.r * s.d + s.stats(s.r);
  return c;
}

// Whether layers [first, end) of the chunks hold a dense / a MoE block.
struct BlockKinds {
  bool dense = false, moe = false;
};
BlockKinds block_kinds(const MoeConfig& moe, const StageLayers& stage, int64_t layers) {
  BlockKinds k;
  auto add = [&](int64_t first, int64_t end) {
    for (int64_t l = first; l < end; ++l) (moe.is_moe_layer(l) ? k.moe : k.dense) = true;
  };
  if (stage.chunks.empty()) add(0, layers);
  for (const auto& [first, end] : stage.chunks) add(first, end);
  return k;
}

// RoPE's cos and sin tables (Llama), allocated with the model.
double rope_table_bytes(const ModelConfig& model) {
  if (model.recipe().positions != Positions::rope) return 0;
  return 4 * static_cast<double>(model.max_seq_len * model.head_dim());
}

int run_threads(const TrainConfig& config) {
  return backend_kind(config.train.device).threads(config.train.threads);
}

// A block's GEMM (model/block.cpp Linear) on this rank, as the engine builds
// it from the registry: its widths, whether tp splits its inputs (row
// parallel), whether its weight trains (LoRA's frozen base: no dW GEMM) and
// its LoRA adapters (the output columns each one's B writes, whether its A
// is split by input columns under tp).
struct BlockGemm {
  int64_t in = 0, out = 0;
  bool row_parallel = false, trains = true;
  struct Adapter {
    int64_t out = 0;
    bool row_parallel = false;
  };
  std::vector<Adapter> lora;
  bool nf4 = false;  // QLoRA: its weights are dequantised into ws.dequant first
};

const ParamSpec* find_spec(const StageParams& held, const std::string& name) {
  for (const ParamSpec& spec : held.specs) {
    if (spec.name == name) return &spec;
  }
  return nullptr;
}

// The first dense block of the stage (every dense block has the same GEMMs;
// a MoE block's attention GEMMs are the same and its experts are not counted
// yet); none without blocks.
std::vector<BlockGemm> block_gemms(const TrainConfig& config, const LocalShape& s,
                                   const StageParams& held, const StageLayers& stage) {
  if (stage.chunks.empty() || stage.chunks.front().second <= stage.chunks.front().first) return {};
  int64_t layer = stage.chunks.front().first;
  for (const auto& [first, end] : stage.chunks) {
    for (layer = first; layer < end && config.model.moe.is_moe_layer(layer); ++layer) {
    }
    if (layer < end) break;
  }
  const std::string prefix = block_param_prefix(config.model.family, layer);
  const auto d = static_cast<int64_t>(s.d), q = static_cast<int64_t>(s.q);
  const auto qkv = static_cast<int64_t>(s.q + 2 * s.kv), f = static_cast<int64_t>(s.f);
  std::vector<BlockGemm> gemms{{d, qkv, false, true, {}},
                               {q, d, true, true, {}},
                               {d, static_cast<int64_t>(s.ff_in), false, true, {}},
                               {f, d, true, true, {}}};
  const auto modules = block_gemm_modules(config.model.family);
  for (size_t g = 0; g < gemms.size(); ++g) {
    for (const std::string& module : modules[g]) {
      const ParamSpec* w = find_spec(held, prefix + module + ".weight");
      if (w == nullptr && config.model.moe.is_moe_layer(layer)) continue;  // only MoE blocks held
      MESHTRAIN_CHECK(w != nullptr, "plan: registry has no '{}{}.weight'", prefix, module);
      gemms[g].trains = w->trainable;
      gemms[g].nf4 = w->nf4;
      const ParamSpec* a = find_spec(held, prefix + module + ".lora_A.weight");
      const ParamSpec* b = find_spec(held, prefix + module + ".lora_B.weight");
      if (a != nullptr && b != nullptr) gemms[g].lora.push_back({b->shape[0], a->split.split()});
    }
  }
  if (config.model.moe.is_moe_layer(layer)) {
    // Only MoE blocks: no dense feed-forward GEMMs; the shared experts'. The
    // router's and routed experts' GEMMs are not counted: their rows per
    // expert depend on the routing (their oneDNN scratchpad was none in every
    // run measured here; tests/moe_mpi).
    gemms.resize(2);
    if (s.shared_f > 0) {
      gemms.push_back({d, static_cast<int64_t>(2 * s.shared_f), false, true, {}});
      gemms.push_back({static_cast<int64_t>(s.shared_f), d, true, true, {}});
    }
  }
  return gemms;
}

// The Workspace buffers a block call reuses and RoPE's tables (plan/memory.cpp
// engine_memory, by this rank's widths).
double workspace_bytes(const TrainConfig& config, const LocalShape& s,
                       const std::vector<BlockGemm>& gemms, const StageParams& held,
                       BlockKinds kinds) {
  const bool bf16 = s.e == 2;
  const double qkv = s.q + 2 * s.kv;
  // dff_c: a dense feed-forward's d(ff_in output), or the shared experts' (its largest).
  const double dff_c = std::max(kinds.dense ? s.ff_in : 0, kinds.moe ? 2 * s.shared_f : 0);
  double w = 4 * s.n * qkv + 4 * s.r * s.d + (bf16 ? s.e * s.n * s.d : 0) + 4 * s.n * std::max(s.d, s.q) +
             4 * s.n * std::max({s.f, qkv, s.shared_f}) + s.e * s.n * dff_c + s.e * s.n * qkv;
  if (kinds.moe) w += moe_workspace_bytes(s);
  w += s.ring_workspace() + s.alltoall_workspace();
  w += 4 * s.qk_weights;  // QK-norm's weight gradients
  if (config.parallel.tp > 1) {
    w += 4 * s.n * s.d;  // partial (row-parallel sums)
    if (config.parallel.sequence_parallel) {
      // dres_full, shards, column_input.
      w += 4 * s.n * s.d + 2 * 4 * s.r * s.d + s.e * s.n * s.d;
    }
  }
  // Norm gradients (model/tensor_parallel.cpp norm_grad): a frozen norm's go
  // to a discarded [2, d]; trained ones under sequence parallelism to the
  // slots of their tp all-reduce (4 norm params of d).
  bool frozen_norm = false, trained_norm = false;
  for (const ParamSpec& spec : held.specs) {
    if (spec.name.find("norm") == std::string::npos && spec.name.find("ln_") == std::string::npos) {
      continue;
    }
    (spec.trainable ? trained_norm : frozen_norm) = true;
  }
  if (frozen_norm) w += 4 * 2 * s.d;
  if (trained_norm && config.parallel.tp > 1 && config.parallel.sequence_parallel) w += 4 * 4 * s.d;
  // LoRA (model/block.cpp lora_*): x A^T (and a row-parallel one's f32 sum),
  // d(x A^T) of up to 3 adapters and one in the compute dtype; with dropout
  // the mask, the dropped input in f32 (and the compute dtype) of the widest
  // adapted input.
  const double r = static_cast<double>(config.model.lora.rank);
  double lora_in = 0;
  bool any = false, row_parallel = false;
  for (const BlockGemm& g : gemms) {
    for (const BlockGemm::Adapter& a : g.lora) {
      any = true;
      row_parallel = row_parallel || a.row_parallel;
      lora_in = std::max(lora_in, static_cast<double>(g.in));
    }
  }
  if (any) {
    w += s.e * s.n * r + (row_parallel ? 4 * s.n * r : 0) + 3 * 4 * s.n * r + (bf16 ? s.e * s.n * r : 0);
    if (config.model.lora.dropout > 0) w += (8 + (bf16 ? s.e : 0)) * s.n * lora_in;
  }
  // QLoRA: the widest GEMM's weights dequantised (ws.dequant).
  double dequant = 0;
  for (const BlockGemm& g : gemms) {
    if (g.nf4) dequant = std::max(dequant, s.e * static_cast<double>(g.in * g.out));
  }
  return w + dequant + rope_table_bytes(config.model);
}

// The ids a pass uploads to the device (model_impl.h Workspace tokens,
// targets, positions, position_ids; i32): tokens on the stage that embeds,
// targets on the one with the head, record positions (packed SFT rows) on
// every stage, and under tp the embedding stage's learned-position row ids.
double id_bytes(const TrainConfig& config, const LocalShape& s, const StageLayers& stage) {
  double ids = (stage.first ? 4 * s.n : 0) + (stage.last ? 4 * s.n : 0);
  // Per-token positions: packed records, or every context-parallel pass.
  // (Preference rows always: a pair's two conversations are segments of one row.)
  if (record_positions(config) || s.cp > 1) {
    ids += 4 * s.n;
  }
  // Preference optimisation: the head's f32 token weights and token losses.
  if (config.data.preference() && stage.last) ids += 8 * s.n;
  if (stage.first && config.parallel.tp > 1 &&
      config.model.recipe().positions == Positions::learned) {
    ids += 4 * s.r;
  }
  return ids;
}

// The backend's reused scratch slots (the CPU backend's Scratch: each one
// grown to its largest request, the old buffer freed first, never shrunk), at
// their size once every call of the step has run (a kind whose attention and
// classifier buffers live for one call only holds the larger of the two): oneDNN's scratchpad and
// the f16 staging over every GEMM through matmul() (model/block.cpp,
// model/tensor_parallel.cpp, the fused classifier),
// the attention kernels' per-thread buffer, the classifier's buffers (its
// logits chunk, 16-bit d_logits and d(W)^T); and the start-up FLOP/s probe's GEMMs
// (train.peak_flops = 0). Sizes come from the backend kind's queries, which build
// the primitive descriptors matmul() builds, for the run's thread count.
double scratch_slot_bytes(const TrainConfig& config, const LocalShape& s, const StageLayers& stage,
                          const std::vector<BlockGemm>& gemms, const ParamSpec* output, int tp_rank,
                          int cp_rank) {
  const DType dt = compute_dtype(config.train.precision);
  const BackendKind& kind = backend_kind(config.train.device);
  const int threads = run_threads(config);
  // Weights stored [out, in] (nn.Linear) or [in, out] (Conv1D); biases or not.
  const bool out_in = !config.model.recipe().conv1d, biased = config.model.recipe().linear_bias;
  const bool tp = config.parallel.tp > 1;
  const auto n = static_cast<int64_t>(s.n), d = static_cast<int64_t>(s.d);
  size_t onednn = 0, staging = 0, attention = 0, classifier = 0;
  auto gemm = [&](const ops::MatmulDims& dims, bool accumulate = false, bool bias = false,
                  float alpha = 1.0f, DType c = DType::f32) {
    const ops::MatmulWorkspace w =
        kind.matmul_workspace(dims, dt, c, threads, alpha, accumulate, bias);
    onednn = std::max(onednn, w.scratchpad);
    staging = std::max(staging, w.f16_staging);
  };
  if (!gemms.empty()) {
    // A block's linear layers: row-parallel ones (proj, ff_out) add into the
    // residual at tp 1, else write a partial.
    const int64_t r = config.model.lora.rank;
    const float scale = config.model.lora.scale();
    const bool dropping = config.model.lora.dropout > 0;
    for (const BlockGemm& l : gemms) {
      const bool adds = l.row_parallel && !tp;
      gemm({.m = n, .n = l.out, .k = l.in, .trans_b = out_in}, adds, biased && (adds || !l.row_parallel));
      // Backward: dW += dY^T X ([out, in]) or X^T dY ([in, out]), unless frozen; then dX.
      if (l.trains) {
        gemm({.m = out_in ? l.out : l.in, .n = out_in ? l.in : l.out, .k = n, .trans_a = true}, true);
      }
      gemm({.m = n, .n = l.in, .k = l.out, .trans_b = !out_in});
      // Each adapter: u = x A^T (a row-parallel A's partial in f32), y +=
      // scale u B^T (tp rank 0 only for a row-parallel one); backward du =
      // scale dY B, dx (+)= du A, dB += scale dY^T u, dA += du^T x.
      for (const BlockGemm::Adapter& a : l.lora) {
        gemm({.m = n, .n = r, .k = l.in, .trans_b = true}, false, false, 1.0f,
             a.row_parallel ? DType::f32 : dt);
        if (!a.row_parallel || tp_rank == 0) {
          gemm({.m = n, .n = a.out, .k = r, .trans_b = true, .ldc = l.out}, true, false, scale);
        }
        gemm({.m = n, .n = r, .k = a.out, .lda = l.out}, false, false, scale);
        gemm({.m = n, .n = l.in, .k = r}, !dropping);
        gemm({.m = a.out, .n = r, .k = n, .trans_a = true, .lda = l.out}, true, false, scale);
        gemm({.m = r, .n = l.in, .k = n, .trans_a = true}, true);
      }
    }
    const int64_t tp_size = config.parallel.tp;
    const ops::ContextDims context{static_cast<int64_t>(s.mb), static_cast<int64_t>(s.seq),
                                   config.model.n_heads / tp_size, config.model.n_kv_heads / tp_size,
                                   config.model.head_dim(), ContextSplit{cp_rank, config.parallel.cp}};
    const auto one_rank = one_rank_attention(config, context.batch);
    auto bytes = [&](bool recompute, bool backward) {
      if (s.fused) return backward ? s.fused->backward_workspace : s.fused->forward_workspace;
      if (one_rank) {
        return kind.attention_workspace_bytes(*one_rank, dt, recompute, backward, threads);
      }
      return s.ring ? kind.ring_attention_workspace_bytes(context, dt, backward, threads)
                    : kind.context_attention_workspace_bytes(context, dt, recompute, backward,
                                                             threads);
    };
    // Training's forward and backward (selective: the probabilities
    // recomputed; full keeps them while a block recomputes) and evaluation's
    // forward, which keeps them.
    const bool selective = config.train.recompute == Recompute::selective;
    for (bool backward : {false, true}) attention = std::max(attention, bytes(selective, backward));
    attention = std::max(attention, bytes(false, false));
  }
  if (config.train.peak_flops <= 0) {
    const ops::MatmulWorkspace probe = kind.peak_probe_workspace(dt, threads).slots;
    onednn = std::max(onednn, probe.scratchpad);
    staging = std::max(staging, probe.f16_staging);
  }
  if (stage.last) {
    // The fused classifier over all rows.
    MESHTRAIN_CHECK(output != nullptr, "plan: the last stage holds no output layer");
    const ops::ClassifierWorkspace w =
        kind.classifier_workspace(n, d, output->shape[0], dt, output->trainable, threads);
    onednn = std::max(onednn, w.gemms.scratchpad);
    staging = std::max(staging, w.gemms.f16_staging);
    classifier = w.buffers;
  }
  const size_t buffers =
      kind.per_call_buffers ? std::max(attention, classifier) : attention + classifier;
  return static_cast<double>(onednn + staging + buffers);
}

// The backend's grouped-GEMM slot (Scratch::grouped): the routed experts'
// six grouped GEMMs (model/moe.cpp), each sized by the expert side's rows R.
double grouped_slot_bytes(const TrainConfig& config, const LocalShape& s) {
  const DType dt = compute_dtype(config.train.precision);
  const BackendKind& kind = backend_kind(config.train.device);
  const int threads = run_threads(config);
  const auto d = static_cast<int64_t>(s.d), I = static_cast<int64_t>(s.moe_f),
             R = static_cast<int64_t>(s.expert_rows);
  const float g_scale = 1.0f / static_cast<float>(config.parallel.ep);
  size_t bytes = 0;
  auto grouped = [&](const ops::GroupedMatmulDims& dims, float alpha = 1.0f, bool accumulate = false) {
    bytes = std::max(bytes, kind.grouped_matmul_workspace(dims, dt, DType::f32, threads, alpha,
                                                          accumulate));
  };
  grouped({.n = 2 * I, .k = d, .trans_b = true, .max_rows = R});
  grouped({.n = d, .k = I, .trans_b = true, .max_rows = R});
  grouped({.along_k = true, .m = d, .n = I, .max_rows = R}, g_scale, true);
  grouped({.n = I, .k = d, .max_rows = R});
  grouped({.along_k = true, .m = 2 * I, .n = d, .max_rows = R}, g_scale, true);
  grouped({.n = d, .k = 2 * I, .max_rows = R});
  return static_cast<double>(bytes);
}

// Evaluation without a pipeline (Model::forward_loss): its activations keep
// nothing for a backward, so they are workspace while one micro-batch runs:
// two residuals, one block's tensors (the attention kernel's saved q, k, v
// and probabilities excepted: those are activations) and the final norm's.
double evaluation_workspace_bytes(const LocalShape& s, BlockKinds kinds) {
  const double norm = s.e * s.r * s.d + s.stats(s.r);
  return 2 * 4 * s.r * s.d                                   // residuals
         + 2 * norm + s.e * s.n * s.q                        // xn1, xn2; attention output
         + 4 * s.n * s.qk_row                                // QK-norm's input and stats
         + 4 * s.r * s.d                                     // mid
         + (kinds.dense ? 4 * s.n * s.ff_in + s.e * s.n * s.f : 0)  // ff_pre, ff_act
         + (kinds.moe ? moe_block_bytes(s) : 0)              // a MoE block's MoeActs
         + norm;                                             // hn
}

// Elements this rank writes to a checkpoint, over the states each tensor has
// (a frozen one: master only): the replica-0 pieces of its shard map, narrowed as the engine narrows it (Model::shard_map
// by params_shard_map, then DataParallel::shard_map: ZeRO's shards or DDP's
// split of the writing).
// ZeRO's expert_dp (flat_param.h): the expert-data-parallel size under
// expert parallelism, else 0 (experts flattened with the rest).
int expert_dp_size(const TrainConfig& config, int dp) {
  return config.parallel.ep > 1 ? dp / config.parallel.ep : 0;
}

int64_t checkpoint_owned_elems(const TrainConfig& config, const StageParams& held,
                               const StageLayers& stage, int tp_rank, int replica, int dp) {
  const ModelConfig& model = config.model;
  size_t duplicate = static_cast<size_t>(-1);  // a tied output layer's copy on a later stage
  std::vector<int64_t> offsets;
  int64_t offset = 0;
  for (size_t i = 0; i < held.specs.size(); ++i) {
    if (!stage.first && model.tie_embeddings &&
        held.specs[i].split.global_shape == Shape{model.vocab_size, model.dim}) {
      duplicate = i;
    }
    offsets.push_back(offset);
    offset += held.specs[i].numel();
  }
  layout::ShardMap map = params_shard_map(held.specs, tp_rank, duplicate);
  if (config.parallel.zero > 0) {
    const zero::ZeroLayout layout = zero::make_zero_layout(
        held.specs, held.units, config.train.precision, dp, expert_dp_size(config, dp));
    map = zero::narrow_to_shard(layout, offsets, map, replica);
  } else if (dp > 1) {
    map = split_replica_writes(map, replica_groups(held.specs, dp, replica, config.parallel.ep));
  }
  return map.owned_state_numel();
}

int64_t micro_batch_rows(const TrainConfig& config, int dp) {
  const TrainSettings& t = config.train;
  const int64_t mb = t.micro_batch_size > 0 ? t.micro_batch_size : t.batch_size;
  return rank_loader_options(t.batch_size, mb, 0, dp).micro_batch;
}

int64_t micro_batches_per_step(const TrainConfig& config, int dp) {
  const int64_t rows = config.train.batch_size / dp, mb = micro_batch_rows(config, dp);
  return std::max<int64_t>(1, (rows + mb - 1) / mb);
}

std::string layer_range(int64_t first, int64_t end) {
  return end - first == 1 ? fmt::format("{}", first) : fmt::format("{}-{}", first, end - 1);
}

// The ZeRO-3 units gathered at once (ShardedDataParallel::before / after /
// prefetch_target): in forward the unit in use and the next one prefetched;
// the head stays gathered into backward, where a tied output layer (the
// token embedding) stays gathered from the head's backward to the
// embedding's, with the unit in use and the one prefetched. Pipelines keep
// every unit gathered until its last backward.
double zero3_gathered_bound(const zero::ZeroLayout& layout, const TrainConfig& config,
                            bool pipelined, bool forwards_in_a_row) {
  std::vector<double> unit(layout.unit_flats.size(), 0);
  for (size_t u = 0; u < unit.size(); ++u) {
    for (size_t i : layout.unit_flats[u]) {
      unit[u] += static_cast<double>(layout.flats[i].padded) *
                 static_cast<double>(dtype_size(layout.flats[i].dtype));
    }
  }
  double total = 0;
  for (double b : unit) total += b;
  if (pipelined || !config.parallel.reshard_after_forward || unit.size() < 3) return total;
  const size_t head = unit.size() - 1;
  const bool prefetch = config.parallel.prefetch;
  const bool tied = config.model.tie_embeddings;
  const double embed = tied ? unit[0] : 0;
  double most = 0;
  for (size_t u = 0; u < head; ++u) most = std::max(most, unit[u] + (prefetch ? unit[u + 1] : 0));
  most = std::max(most, unit[head] + (config.model.tied_output() ? unit[0] : 0));
  // Backward: the head, the tied embedding, the last layer prefetched.
  most = std::max(most, unit[head] + embed + (prefetch ? unit[head - 1] : 0));
  for (size_t u = head - 1; u >= 1; --u) {  // layers; unit 0 (the embedding) is counted once
    const double next = prefetch && (u > 1 || !tied) ? unit[u - 1] : 0;
    most = std::max(most, embed + unit[u] + next);
  }
  // Evaluation (and the routing pass) runs forwards only: the head stays
  // gathered from one micro-batch's forward into the next one's.
  if (forwards_in_a_row) {
    for (size_t u = 0; u + 1 < head; ++u) {
      most = std::max(most, unit[head] + unit[u] + (prefetch ? unit[u + 1] : 0));
    }
  }
  return most;
}

// The gradient transients of a stage-1/2/3 step without pipelining
// (ShardedDataParallel::before / after / reduce_scatter_grads, model.cpp's
// backward): per micro-batch, backward allocates a unit's [padded] f32
// gradients in before(u) (the head's, then with a tied embedding the
// embedding's), and after(u) issues one reduce-scatter per flat, whose
// receive shard is new unless it is the flat's first contribution of the step
// (stage 1: once, on the last micro-batch, always a new receive shard; the
// full gradients are resident). Issuing with K alive retires the oldest
// first. Returns the peak of what is alive above the resident floor.
double zero_reduce_peak(const zero::ZeroLayout& layout, const TrainConfig& config,
                        int64_t micro_batches) {
  const int stage = config.parallel.zero;
  const auto limit = static_cast<size_t>(config.parallel.max_inflight_reduces);
  const size_t head = layout.unit_flats.size() - 1;
  const bool tied = config.model.tied_output();
  struct Call {
    double bytes = 0;  // the send buffer (stages 2/3) and the receive shard
  };
  std::vector<Call> alive;  // in issue order
  std::vector<bool> written(layout.flats.size(), false);
  double live = 0, most = 0;
  auto padded = [&](size_t i) {
    return 4 * static_cast<double>(layout.flats[i].padded);
  };
  auto alloc = [&](size_t u) {
    if (stage == 1) return;
    for (size_t i : layout.unit_flats[u]) live += layout.flats[i].trainable ? padded(i) : 0;
    most = std::max(most, live);
  };
  auto issue = [&](size_t u) {
    for (size_t i : layout.unit_flats[u]) {
      if (!layout.flats[i].trainable) continue;  // frozen: no gradients
      while (alive.size() >= limit) {
        live -= alive.front().bytes;
        alive.erase(alive.begin());
      }
      const double recv =
          stage == 1 || written[i] ? 4 * static_cast<double>(layout.flats[i].shard) : 0;
      written[i] = true;
      live += recv;
      most = std::max(most, live);
      alive.push_back({(stage >= 2 ? padded(i) : 0) + recv});
    }
  };
  for (int64_t k = 0; k < micro_batches; ++k) {
    if (stage == 1 && k + 1 < micro_batches) continue;
    if (head == 0) {  // (a single unit)
      alloc(0);
      issue(0);
      continue;
    }
    alloc(head);
    if (tied) alloc(0);
    issue(head);
    for (size_t u = head - 1; u >= 1; --u) {
      alloc(u);
      issue(u);
    }
    if (!tied) alloc(0);
    issue(0);
  }
  return most;
}
}  // namespace

std::string_view prediction_basis_name(PredictionBasis basis) {
  switch (basis) {
    case PredictionBasis::exact: return "exact";
    case PredictionBasis::bound: return "bound";
    case PredictionBasis::balanced: return "balanced load";
    case PredictionBasis::routed: return "measured routing";
  }
  return "?";
}

double RankMemory::total() const {
  double sum = 0;
  for (size_t c = 0; c < kMemCategories; ++c) {
    if (c != idx(MemCategory::offloaded)) sum += peak[c];
  }
  return sum;
}

RankMemory predict_rank_memory(const TrainConfig& config, const MeshLayout& mesh,
                               MeshCoord coord, int64_t expert_rows) {
  const ParallelSettings& p = config.parallel;
  const ModelConfig& model = config.model;
  // dp: the data rows' split; replicas (dp x cp): gradients' and ZeRO's group.
  const int dp = mesh.dp(), tp = mesh.tp(), pp = mesh.pp(), replicas = mesh.replicas();
  const int replica = mesh.replica(coord);
  MESHTRAIN_CHECK(tp == p.tp && pp == p.pp,
                  "memory plan: the mesh (tp {}, pp {}) is not the config's (parallel.tp {}, "
                  "parallel.pp {})",
                  tp, pp, p.tp, p.pp);
  RankMemory out;
  out.coord = coord;
  out.rank = mesh.rank(coord);
  out.basis.fill(PredictionBasis::exact);

  // The stage: the executor's split of the layers over (virtual) stages.
  const int64_t m = micro_batches_per_step(config, dp), rows = micro_batch_rows(config, dp);
  // The run's validation (train.eval_interval with data.val), in micro-batches of the same rows.
  // A forward-only pass: evaluation, the step's routing pass (moe.aux_scope =
  // "step"), or preference optimisation's reference pass (its adapters off;
  // a precomputed reference runs before the first step, below its peak).
  const bool validates = !config.data.val.empty() && config.train.eval_interval > 0;
  const bool preference = config.data.preference() && !config.dpo.precompute_reference;
  const bool evaluates = validates || config.model.moe.aux_per_step || preference;
  // Whether a forward-only pass runs several micro-batches back to back (the
  // validation set's eval_batches x m, the routing pass's m, the reference
  // pass and the training forward after it): ZeRO-3 keeps the head gathered
  // from one's forward into the next one's.
  const bool forwards_in_a_row = (validates && config.train.eval_batches * m > 1) ||
                                 (config.model.moe.aux_per_step && m > 1) || preference;
  const pipeline::ScheduleKind kind = pipeline::parse_schedule_kind(p.schedule);
  const pipeline::PipelineShape shape{pp, static_cast<int>(m), p.virtual_stages};
  StageLayers stage;
  if (pp > 1) {
    pipeline::check_shape(kind, shape);
    stage = pipeline::stage_layers(model.n_layers, shape, coord.pp, pp_split_layers(config));
  }
  check_tensor_parallel_split(model, tp);
  const StageParams held =
      select_stage_params(model, stage,
                          build_param_specs(model, coord.tp, tp, replica % p.ep, p.ep));
  if (stage.whole()) {
    stage.chunks = {{0, model.n_layers}};
    stage.first = stage.last = true;
  }

  // Model state: the flat buffers (Model, AdamW) or ZeRO's padded shards.
  const Precision precision = config.train.precision;
  // elements: trainable (LoRA: the adapters), with an f32 master; bytes of
  // the 16-bit compute copies and of QLoRA's packed NF4 weights (under ZeRO
  // in packed flats, zero/flat_param.h: the layout counts them).
  double trainable = 0, masters = 0, compute_copies = 0, packed = 0;
  for (const ParamSpec& spec : held.specs) {
    if (spec.trainable) trainable += static_cast<double>(spec.numel());
    if (param_has_master(spec, precision)) masters += static_cast<double>(spec.numel());
    const DType dtype = param_compute_dtype(spec, precision);
    if (spec.nf4) {
      packed += static_cast<double>(nf4_layout(spec).bytes);
    } else if (dtype != DType::f32) {
      compute_copies += static_cast<double>(spec.numel()) * static_cast<double>(dtype_size(dtype));
    }
  }
  double& params = out.peak[idx(MemCategory::params)];
  double& grads = out.peak[idx(MemCategory::grads)];
  double& optimizer = out.peak[idx(MemCategory::optimizer)];
  if (p.zero == 0) {
    params = 4 * masters + compute_copies + packed;
    grads = 4 * trainable;
    optimizer = 8 * trainable;
  } else {
    const zero::ZeroLayout layout = zero::make_zero_layout(
        held.specs, held.units, precision, replicas, expert_dp_size(config, replicas));
    const zero::ModelStateBytes state = zero::layout_model_state_bytes(layout, p.zero);
    params = static_cast<double>(state.params);
    grads = static_cast<double>(state.grads);
    optimizer = static_cast<double>(state.optimizer);
    // Transients: stage 3's gathered units; stage 2/3's unit gradients while
    // they are reduce-scattered (the next unit's backward overlaps the call);
    // the receive shards of later contributions.
    double all_padded = 0, all_shard = 0;
    for (size_t u = 0; u < layout.unit_flats.size(); ++u) {
      double padded = 0, shard = 0;
      for (size_t i : layout.unit_flats[u]) {
        if (!layout.flats[i].trainable) continue;
        padded += 4 * static_cast<double>(layout.flats[i].padded);
        shard += 4 * static_cast<double>(layout.flats[i].shard);
      }
      all_padded += padded;
      all_shard += shard;
    }
    // Stage 3 with offload: the parameter shards live in the store too (each
    // streamed in before its unit's gather), so only gathered units stay.
    const zero::OffloadTier tier = zero::parse_offload_tier(p.offload);
    const bool params_in_store = p.zero == 3 && tier != zero::OffloadTier::none;
    if (params_in_store) params = 0;
    if (p.zero == 3) {
      out.floor[idx(MemCategory::params)] = params;
      params += zero3_gathered_bound(layout, config, pp > 1, forwards_in_a_row);
      out.basis[idx(MemCategory::params)] = PredictionBasis::bound;
    }
    // Gradient reduce-scatters: the rate limiter (parallel.max_inflight_reduces,
    // parallel/zero/sharded.h) keeps at most K calls alive and retires them
    // only when the (K+1)-th is issued or at the sync, so the peak follows
    // from the issue order alone.
    out.floor[idx(MemCategory::grads)] = grads;
    if (pp == 1) {
      grads += zero_reduce_peak(layout, config, m);
    } else if (p.zero >= 2 && m >= 2 && shape.virtual_stages == 1) {
      // A stage allocates each unit's gradients at its first backward (the
      // first micro-batch) and reduces them after its last (the last
      // micro-batch's): all are alive together, the first contributions need
      // no receive shard.
      grads += all_padded;
    } else {
      grads += p.zero >= 2 ? all_padded : all_shard;
      out.basis[idx(MemCategory::grads)] = PredictionBasis::bound;
    }
    // The offload store: the optimizer state (at stage 3 with the parameter
    // shards) streams through the budget.
    if (tier != zero::OffloadTier::none) {
      const int64_t piece = zero::ZeroOptions{}.piece_elems;
      // A piece: exp_avg, exp_avg_sq (and a 2-byte flat's f32 master; at stage
      // 3 its 2-byte values) of up to piece_elems shard elements, acquired
      // together by the update.
      double piece_bytes = 0;
      for (const zero::FlatParam& f : layout.flats) {
        if (!f.trainable) continue;  // frozen: not in the store
        const double elems = static_cast<double>(std::min(f.shard, piece));
        const bool narrow = f.dtype != DType::f32;
        const double bytes = 4 * (narrow ? 3 : 2) * elems +
                             (params_in_store && narrow ? dtype_size(f.dtype) * elems : 0);
        piece_bytes = std::max(piece_bytes, bytes);
      }
      const auto store = static_cast<double>(zero::layout_offloaded_bytes(layout, p.zero));
      optimizer = store;
      out.offload_tier = p.offload;
      out.offload_state = store;
      out.offload_piece = piece_bytes;
      out.offload_budget = p.offload_budget_mb * 1024.0 * 1024.0;
      out.peak[idx(MemCategory::offloaded)] = store;
      // Resident: what the passes hold and read ahead, within the budget (0:
      // up to all of it); at least the two pieces an update holds.
      if (out.offload_budget > 0) optimizer = std::min(optimizer, out.offload_budget);
      out.floor[idx(MemCategory::optimizer)] = std::min(optimizer, 2 * out.offload_piece);
      out.basis[idx(MemCategory::optimizer)] = PredictionBasis::bound;
      if (tier == zero::OffloadTier::disk) {
        out.offload_dir = p.offload_dir.empty() ? config.train.out_dir + "/offload" : p.offload_dir;
      }
    }
  }

  // Activations: each (chunk, micro-batch) the schedule holds, at the
  // schedule's fullest point, plus the one shared set recomputation uses.
  const LocalShape s = local_shape(config, rows, expert_rows);
  const RecomputePolicy policy{config.train.recompute, config.train.recompute_layers};
  std::vector<ChunkBytes> chunks;
  for (size_t c = 0; c < stage.chunks.size(); ++c) {
    const auto [first, end] = stage.chunks[c];
    chunks.push_back(chunk_bytes(s, policy, model.moe, first, end,
                                 stage.last && c + 1 == stage.chunks.size()));
  }
  double shared = 0, held_most = 0;
  for (const ChunkBytes& c : chunks) shared = std::max(shared, c.shared);
  double comm = 0;
  if (pp == 1) {
    held_most = chunks.front().held;  // one micro-batch at a time
  } else {
    // Walk the rank's actions: forwards add their chunk's tensors, backwards
    // free them; pipeline messages are [stage rows, dim] f32 buffers: a
    // receive from its post to its use, an output from its production until
    // the compute that waits for the batch that sent it, else the step's end
    // (pipeline/executor.cpp frees sent buffers only there).
    const pipeline::RankSchedule actions =
        pipeline::make_schedule(kind, shape)[static_cast<size_t>(coord.pp)];
    const double message = 4 * s.r * s.d;
    double in_flight = 0, live = 0, most_live = 0;
    std::vector<double> sent(actions.size(), 0);  // by send_recv: bytes still held
    const int last_vs = shape.total_stages() - 1;
    auto add = [&](double bytes) {
      live += bytes;
      most_live = std::max(most_live, live);
    };
    for (size_t k = 0; k < actions.size(); ++k) {
      const pipeline::Action& a = actions[k];
      if (a.kind == pipeline::ActionKind::send_recv) {
        for (const pipeline::Transfer& t : a.transfers) {
          if (t.send) {
            sent[k] += message;  // (counted since its production)
          } else {
            add(message);
          }
        }
        continue;
      }
      if (a.receive >= 0) {
        live -= sent[static_cast<size_t>(a.receive)];
        sent[static_cast<size_t>(a.receive)] = 0;
      }
      const int vs = a.chunk * shape.stages + coord.pp;
      const bool backward = a.kind == pipeline::ActionKind::backward;
      // The output buffer is allocated before the input is freed.
      if (backward ? vs > 0 : vs < last_vs) add(message);
      if ((backward && vs < last_vs) || (!backward && vs > 0)) add(-message);  // consumed
      const double bytes = chunks[static_cast<size_t>(a.chunk)].held;
      if (backward) {
        in_flight -= bytes;
      } else {
        in_flight += bytes;
        held_most = std::max(held_most, in_flight);
      }
    }
    comm = most_live;
  }
  double activations = held_most + shared;
  if (evaluates && pp == 1) {
    // Evaluation's forward (keep nothing: scratch is workspace) next to the
    // training set, which stays allocated, except the attention kernel's saved
    // q, k, v and probabilities (ops::AttentionSaved), counted as
    // activations: one block's, of one micro-batch.
    activations += s.qkv_saved() + s.probs();
  } else if (evaluates) {
    // Through the pipeline: every chunk of one micro-batch held, then dropped.
    double eval = shared;
    for (const ChunkBytes& c : chunks) eval += c.held;
    activations = std::max(activations, eval);
  }
  out.peak[idx(MemCategory::activations)] = activations;
  out.peak[idx(MemCategory::comm)] = comm + s.cp_buffers();
  const ParamSpec* output = nullptr;  // the output layer (tp: this rank's padded rows)
  for (const ParamSpec& spec : held.specs) {
    if (spec.split.global_shape == Shape{model.vocab_size, model.dim}) output = &spec;
  }
  const std::vector<BlockGemm> gemms = block_gemms(config, s, held, stage);
  const BlockKinds kinds = block_kinds(model.moe, stage, model.n_layers);
  out.peak[idx(MemCategory::workspace)] =
      workspace_bytes(config, s, gemms, held, kinds) + id_bytes(config, s, stage) +
      scratch_slot_bytes(config, s, stage, gemms, output, coord.tp, coord.cp) +
      (kinds.moe ? grouped_slot_bytes(config, s) : 0);
  // On top of those: evaluation's forward and a checkpoint's buffers
  // (ckpt/distributed.h: a sync save's file buffer, or an async save's staging
  // copy of what this rank writes). The trainer evaluates, then saves, at the
  // end of a step; an async save keeps its copy for the next one, so an
  // evaluation after a periodic save runs next to it.
  const TrainSettings& t = config.train;
  const double eval = evaluates && pp == 1 ? evaluation_workspace_bytes(s, kinds) : 0;
  double save = 0;
  if (t.checkpoint_interval >= 0) {
    const int64_t owned = checkpoint_owned_elems(config, held, stage, coord.tp, replica, replicas);
    save = static_cast<double>(dist_ckpt::save_workspace_bytes(
        owned, static_cast<int64_t>(config.ckpt.buffer_mb * 1024 * 1024), config.ckpt.async));
  }
  const bool kept_copy_under_eval = config.ckpt.async && t.checkpoint_interval > 0 &&
                                    t.checkpoint_interval < t.steps;
  double& workspace = out.peak[idx(MemCategory::workspace)];
  workspace += kept_copy_under_eval ? eval + save : std::max(eval, save);
  if (!t.init_from.empty() && !is_training_checkpoint(t.init_from)) {
    // init_from an HF directory (Checkpointer::load_weights): one whole tensor
    // at a time, read by hf_tensors into its f32 copy and permuted into the
    // loader's, next to the RoPE tables; the block buffers do not exist yet.
    int64_t largest = 0;
    for (const ParamSpec& spec : build_param_specs(model)) {
      if (!spec.lora_adapter) largest = std::max(largest, shape_numel(spec.split.global_shape));
    }
    workspace = std::max(workspace, rope_table_bytes(model) + 2.0 * 4.0 * static_cast<double>(largest));
  }
  if (t.peak_flops <= 0) {
    // The FLOP/s probe at start (Trainer): the RoPE tables exist, the block
    // buffers not yet; its operands next to what its GEMMs grow the slots to.
    const ops::PeakProbeWorkspace probe = backend_kind(t.device).peak_probe_workspace(
        compute_dtype(t.precision), run_threads(config));
    workspace = std::max(workspace, rope_table_bytes(model) + static_cast<double>(probe.operands) +
                                        static_cast<double>(probe.slots.scratchpad +
                                                            probe.slots.f16_staging));
  }

  if (p.ep > 1) {  // the expert side's rows follow the routing
    const PredictionBasis basis = expert_rows > 0 ? PredictionBasis::routed : PredictionBasis::balanced;
    out.basis[idx(MemCategory::activations)] = basis;
    out.basis[idx(MemCategory::workspace)] = basis;
  }
  for (size_t c = 0; c < kMemCategories; ++c) {
    if (out.basis[c] != PredictionBasis::bound) out.floor[c] = out.peak[c];
  }
  out.host_bytes = out.total() + (p.offload == "cpu" ? out.at(MemCategory::offloaded) : 0);
  std::string layers;
  for (const auto& [first, end] : stage.chunks) {
    layers += fmt::format("{}{}", layers.empty() ? "" : ",", layer_range(first, end));
  }
  out.role = fmt::format("layers {}{}{}", layers, stage.first ? ", embed" : "",
                         stage.last ? ", head" : "");
  if (pp > 1) out.role = fmt::format("pp stage {} ({})", coord.pp, out.role);
  if (tp > 1) out.role += fmt::format(", tp {} of {}", coord.tp, tp);
  return out;
}

std::vector<RankMemory> predict_run_memory(const TrainConfig& config, int world_size,
                                           int64_t expert_rows) {
  const MeshLayout mesh(world_size, config.parallel.tp, config.parallel.pp, config.parallel.cp);
  std::vector<RankMemory> ranks;
  for (int r = 0; r < world_size; ++r) {
    ranks.push_back(predict_rank_memory(config, mesh, mesh.coord(r), expert_rows));
  }
  return ranks;
}

std::vector<std::pair<const RankMemory*, std::vector<int>>> distinct_ranks(
    const std::vector<RankMemory>& ranks) {
  std::vector<std::pair<const RankMemory*, std::vector<int>>> rows;
  for (const RankMemory& r : ranks) {
    auto same = std::find_if(rows.begin(), rows.end(), [&](const auto& row) {
      return row.first->peak == r.peak && row.first->coord.tp == r.coord.tp &&
             row.first->coord.pp == r.coord.pp;
    });
    if (same == rows.end()) {
      rows.push_back({&r, {r.rank}});
    } else {
      same->second.push_back(r.rank);
    }
  }
  return rows;
}

namespace {

std::string rank_list(const std::vector<int>& ranks) {
  if (ranks.size() == 1) return fmt::format("rank {}", ranks[0]);
  return fmt::format("ranks {}", fmt::join(ranks, ","));
}

std::string layout_line(const TrainConfig& config, size_t world) {
  const ParallelSettings& p = config.parallel;
  const TrainSettings& t = config.train;
  const MeshLayout mesh(static_cast<int>(world), p.tp, p.pp, p.cp);
  std::string text = fmt::format("{} ranks: dp {}{} x tp {} x pp {}", world, mesh.dp(),
                                 p.cp > 1 ? fmt::format(" x cp {}", p.cp) : "", p.tp, p.pp);
  if (p.zero > 0) text += fmt::format(", ZeRO-{}", p.zero);
  if (p.tp > 1 && p.sequence_parallel) text += ", sequence parallel";
  if (p.pp > 1) text += fmt::format(", schedule {}", p.schedule);
  if (p.offload != "none") text += fmt::format(", offload {}", p.offload);
  text += fmt::format(", {}, micro-batch {} x seq {}, recompute {}", precision_name(t.precision),
                      micro_batch_rows(config, mesh.dp()), t.seq_len, recompute_name(t.recompute));
  if (p.cp > 1) text += fmt::format(" ({} tokens per rank)", t.seq_len / p.cp);
  if (t.recompute_layers > 0) text += fmt::format(" ({} layers)", t.recompute_layers);
  return text;
}

}  // namespace

std::string format_run_memory(const std::string& source, const TrainConfig& config,
                              const std::vector<RankMemory>& ranks) {
  std::string out = fmt::format("predicted memory per rank for {} (meshtrain CPU engine; {}):\n",
                                source, layout_line(config, ranks.size()));
  for (const auto& [r, same] : distinct_ranks(ranks)) {
    out += fmt::format("{} ({}):\n", rank_list(same), r->role);
    for (size_t c = 0; c < kMemCategories; ++c) {
      const auto cat = static_cast<MemCategory>(c);
      if (cat == MemCategory::offloaded && r->peak[c] == 0) continue;
      out += fmt::format("  {:<12} {:>12}  ({})\n", mem_category_name(cat),
                         format_bytes(static_cast<size_t>(r->peak[c])),
                         cat == MemCategory::offloaded
                             ? fmt::format("{} tier, not in the total", r->offload_tier)
                             : std::string(prediction_basis_name(r->basis[c])));
    }
    out += fmt::format("  {:<12} {:>12}  (sum of the category peaks)\n", "total",
                       format_bytes(static_cast<size_t>(r->total())));
  }
  out += "compare with the run's memory report (predicted next to measured, per rank)\n";
  return out;
}

std::string run_memory_json(const std::string& source, const TrainConfig& config,
                            const std::vector<RankMemory>& ranks) {
  nlohmann::json j;
  j["source"] = source;
  j["layout"] = layout_line(config, ranks.size());
  j["ranks"] = nlohmann::json::array();
  for (const RankMemory& r : ranks) {
    nlohmann::json row;
    row["rank"] = r.rank;
    row["dp"] = r.coord.dp;
    row["cp"] = r.coord.cp;
    row["tp"] = r.coord.tp;
    row["pp"] = r.coord.pp;
    row["role"] = r.role;
    for (size_t c = 0; c < kMemCategories; ++c) {
      const std::string name(mem_category_name(static_cast<MemCategory>(c)));
      row["bytes"][name] = static_cast<uint64_t>(r.peak[c]);
      row["basis"][name] = std::string(prediction_basis_name(r.basis[c]));
    }
    row["bytes"]["total"] = static_cast<uint64_t>(r.total());
    row["host_bytes"] = static_cast<uint64_t>(r.host_bytes);
    j["ranks"].push_back(std::move(row));
  }
  return j.dump(2) + "\n";
}

}  // namespace meshtrain
