// evaluate(): one layout's memory per stage, step time and what the run costs.
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>

#include "meshtrain/plan/collectives.h"
#include "meshtrain/plan/compute.h"
#include "meshtrain/plan/pipeline_split.h"
#include "meshtrain/plan/planner.h"
#include "meshtrain/plan/transformer.h"
#include "meshtrain/util/error.h"

namespace meshtrain::plan {
namespace {

struct StageMemory {
  MemoryBreakdown memory;
  double psi = 0;  // trainable parameters on this rank before ZeRO sharding
  double psi_experts = 0;  // of them, routed experts' (sharded over dp / ep, not dp)
};

// The ranks a layout's expert state is sharded over (ZeRO) and its gradients
// reduced over: the expert-data-parallel group, the shard group / ep (folded:
// tp x the shard group / ep).
int64_t expert_shards(const Layout& l) {
  return std::max<int64_t>(1, l.ep_fold ? l.tp * l.shards() / l.ep : l.shards() / l.ep);
}

// Memory of the rank of pipeline stage `stage` holding `layers` blocks. Under
// DualPipe it also holds the mirrored stage p - 1 - stage (`mirror` blocks):
// its model states, not its micro-batches (the schedule's in-flight count
// covers both directions).
StageMemory stage_memory(const PlanContext& ctx, const Job& job, const Layout& l,
                         int64_t microbatches, int64_t layers, int64_t mirror, int64_t stage) {
  const TransformerCounts& n = ctx.counts;
  const bool dual = l.schedule == Schedule::dualpipe && l.pp > 1;
  const bool first = stage == 0 || (dual && stage == l.pp - 1);
  const bool last = stage == l.pp - 1 || (dual && stage == 0);
  const double t = static_cast<double>(l.tp);
  // The multi-token-prediction modules: a block each (counted with the
  // blocks) and a 2h -> h projection, on the last stage.
  const double mtp = last ? static_cast<double>(job.mtp) : 0.0;
  const double dim = static_cast<double>(ctx.model.dim);
  const double blocks = static_cast<double>(layers + (dual ? mirror : 0)) + mtp;
  double params = blocks * n.layer_params;
  if (first) params += n.embedding_params;
  if (last) {
    params += n.head_params + mtp * (2 * dim * dim + 3 * dim);
    if (!first && ctx.model.tie_embeddings) params += n.output_matmul_params;  // tied copy
  }
  StageMemory out;
  const StateBytes bytes = state_bytes(job.precision, job.optimizer);
  MemoryBreakdown& mem = out.memory;
  const Finetune& ft = job.finetune;
  if (ft.adapters()) {
    // Frozen base: weights only (GEMM weights of the blocks in bf16 or NF4, the
    // rest in bf16), sharded only by ZeRO-3; the adapters carry the states.
    const double gemm = blocks * n.layer_matmul_params;
    const double frozen = gemm * frozen_weight_bytes(ft, l.tp) + (params - gemm) * 2;
    out.psi = blocks * lora_layer_params(ctx.model, ft) / t;
    const ModelStates states = model_state_memory(out.psi, bytes, l.zero, l.shards());
    mem.params = frozen / t / (l.zero >= 3 ? static_cast<double>(l.shards()) : 1.0) + states.params;
    mem.grads = states.grads;
    mem.optimizer = states.optimizer;
  } else {
    // Routed experts: E / ep of them on this rank, whole (expert tp = 1).
    out.psi_experts = blocks * n.layer_expert_params / static_cast<double>(l.ep);
    out.psi = (params - blocks * n.layer_expert_params) / t + out.psi_experts;
    const ModelStates dense =
        model_state_memory(out.psi - out.psi_experts, bytes, l.zero, l.shards());
    const ModelStates experts =
        model_state_memory(out.psi_experts, bytes, l.zero, expert_shards(l));
    mem.params = dense.params + experts.params;
    mem.grads = dense.grads + experts.grads;
    mem.optimizer = dense.optimizer + experts.optimizer;
  }
  if (l.offload == Offload::optimizer) {
    mem.offloaded = mem.optimizer;
    mem.optimizer = 0;
  }

  const double e = job.precision == Precision::bf16 ? 2 : 4;
  const ActivationShape shape = activation_shape(ctx, job, l);
  // Under DualPipe each direction keeps what 1F1B keeps on its stage: p - r
  // micro-batches of stage r, r + 1 of the mirrored one (p + 1 in all).
  const Schedule schedule = l.pp == 1 || dual ? Schedule::one_f_one_b : l.schedule;
  auto kept = [&](int64_t r, int64_t blocks_r) {
    const double inflight = inflight_microbatches(schedule, l.pp, l.vpp, microbatches, r);
    double held = inflight * static_cast<double>(blocks_r) * layer_activation_bytes(shape);
    if (r == 0) held += inflight * first_stage_activation_bytes(shape);
    if (r == l.pp - 1) {
      held += inflight * (1 + static_cast<double>(job.mtp)) * last_stage_activation_bytes(shape) +
              inflight * static_cast<double>(job.mtp) * layer_activation_bytes(shape);
    }
    return held;
  };
  mem.activations = kept(stage, layers) + (dual ? kept(l.pp - 1 - stage, mirror) : 0.0);
  if (l.recompute == Recompute::full) {
    // Backward rematerialises one layer at a time (with unfused attention, its scores too).
    ActivationShape one = shape;
    one.recompute = job.attention == Attention::flash ? Recompute::selective : Recompute::none;
    mem.activations += layer_activation_bytes(one);
  }

  const double tokens = static_cast<double>(job.seq * l.micro_batch) / static_cast<double>(l.cp);
  const double sbh = tokens * static_cast<double>(ctx.model.dim);
  const double mlp_width = static_cast<double>(ctx.active.hidden_dim) *
                           static_cast<double>(ctx.model.recipe().ff_in_factor());
  mem.workspace = job.reserve_bytes + 2 * e * tokens * mlp_width / t +
                  (l.sequence_parallel ? e * sbh : 0);
  if (l.cp > 1) {  // one layer's K and V gathered over the whole sequence
    const AttentionShape at = attention_shape(ctx.model);
    mem.workspace += e * static_cast<double>(job.seq * l.micro_batch) * (at.k + at.v) / t;
  }
  if (ft.method == FinetuneMethod::qlora) {  // one dequantised MLP weight in bf16
    mem.workspace += 2 * static_cast<double>(ctx.model.dim) * mlp_width / t;
  }
  mem.comm = l.zero == 3 ? 2 * n.layer_params / t * bytes.weights : 2 * job.bucket_bytes;
  if (l.pp > 1) mem.comm += 2 * e * sbh / t;  // send and receive buffers
  mem.fragmentation = job.fragmentation * mem.tracked();
  return out;
}

using Collective = double (*)(double, int64_t, const Link&);

// `count` calls of `collective` over `total` bytes split evenly among them.
double calls(Collective collective, double total, double count, int64_t n, const Link& link) {
  return count * collective(total / count, n, link);
}

// One ZeRO-3 (FSDP) unit: the embedding, a block, or the head, as this rank
// holds it before sharding, and its compute per micro-batch.
struct ShardedUnit {
  double weight_bytes = 0, grad_bytes = 0;
  double forward = 0, backward = 0;  // backward includes recomputation
};

// ZeRO-3's exposed time per micro-batch over a shard group: each unit's
// gather is prefetched behind the previous unit's forward; in backward (last
// unit first) the next gather and this unit's reduce-scatter hide behind its
// backward; the first gather of each pass and the last reduce-scatter hide
// behind nothing. Returns (exposed, raw).
std::pair<double, double> zero3_seconds(const std::vector<ShardedUnit>& units, int64_t n,
                                        const Link& link) {
  std::vector<double> gather, scatter;
  double raw = 0;
  for (const ShardedUnit& u : units) {
    gather.push_back(all_gather_seconds(u.weight_bytes, n, link));
    scatter.push_back(u.grad_bytes > 0 ? reduce_scatter_seconds(u.grad_bytes, n, link) : 0.0);
    raw += 2 * gather.back() + scatter.back();
  }
  const size_t count = units.size();
  double exposed = gather.front() + gather.back() + scatter.front();
  for (size_t k = 1; k < count; ++k) {
    exposed += std::max(0.0, gather[k] - units[k - 1].forward);
    exposed += std::max(0.0, gather[k - 1] + scatter[k] - units[k].backward);
  }
  return {exposed, raw};
}

// DP communication per step (ZeRO's collectives over the rank's trainable
// parameters psi; ZeRO-3 unit by unit, frozen weights too), the group strided
// by tp x cp, and the compute it hides behind. t_mb: one micro-batch's forward
// and backward on the slowest stage.
void dp_time(const Cluster& cl, const Layout& l, const StateBytes& bytes, double psi,
             const std::vector<ShardedUnit>& units, double mb, double t_mb, Estimate& est) {
  const int64_t ranks = l.grad_ranks();
  if (ranks <= 1) return;
  const Link& link = l.tp * ranks <= cl.gpus_per_node ? cl.intra : cl.inter;
  const double grads = psi * bytes.grads, updated = psi * bytes.weights;  // trained weights
  const double bucket = std::max(40e6, 1e6 * static_cast<double>(ranks));
  const double buckets = std::max(1.0, std::ceil(psi / bucket));
  switch (l.zero) {
    case 0:  // all-reduce once per step, behind the last micro-batch's backward
      est.dp_comm_raw = calls(all_reduce_seconds, grads, buckets, ranks, link);
      est.dp_overlap_window = 2.0 / 3.0 * t_mb;
      break;
    case 1:  // reduce-scatter behind the last backward, all-gather behind the next forward
      est.dp_comm_raw = calls(reduce_scatter_seconds, grads, buckets, ranks, link) +
                        calls(all_gather_seconds, updated, buckets, ranks, link);
      est.dp_overlap_window = t_mb;
      break;
    case 2:  // reduce-scatter after every micro-batch's backward
      est.dp_comm_raw = mb * calls(reduce_scatter_seconds, grads, buckets, ranks, link) +
                        calls(all_gather_seconds, updated, buckets, ranks, link);
      est.dp_overlap_window = mb * 2.0 / 3.0 * t_mb + t_mb / 3.0;
      break;
    default: {  // every micro-batch, unit by unit, over the shard group; with hybrid
      // sharding each rank's gradient shard is then all-reduced across the replicas once.
      const int64_t n = l.shards();
      const Link& group = l.tp * n <= cl.gpus_per_node ? cl.intra : cl.inter;
      const auto [exposed, raw] = zero3_seconds(units, n, group);
      est.dp_comm_raw = mb * raw;
      double replicas = 0;
      if (n < ranks) {
        const double shard = psi / static_cast<double>(n);
        replicas = calls(all_reduce_seconds, shard * bytes.grads,
                         std::max(1.0, std::ceil(shard / bucket)), ranks / n, link);
        est.dp_comm_raw += replicas;
      }
      est.dp_overlap_window = mb * t_mb;
      const double last_backward = units.empty() ? 0 : units.front().backward;
      est.time.dp = mb * exposed + std::max(0.0, replicas - last_backward);
      return;
    }
  }
  est.time.dp = std::max(0.0, est.dp_comm_raw - est.dp_overlap_window);
}

// The ZeRO-3 units of the whole model (ZeRO-3 runs with pp = 1): embedding,
// blocks, head, with their weights and gradients on this tp rank. experts:
// the routed experts' part of each block instead (E / ep of them, gathered
// over their own group; the ends hold none), else the rest.
std::vector<ShardedUnit> sharded_units(const PlanContext& ctx, const Job& job, const Layout& l,
                                       const OpsTime& layer, const OpsTime& embedding,
                                       const OpsTime& head, bool experts) {
  const TransformerCounts& n = ctx.counts;
  const StateBytes bytes = state_bytes(job.precision, job.optimizer);
  const double t = static_cast<double>(l.tp);
  const Finetune& ft = job.finetune;
  const double held = experts ? n.layer_expert_params / static_cast<double>(l.ep)
                              : (n.layer_params - n.layer_expert_params) / t;
  ShardedUnit block{held * bytes.weights, held * bytes.grads, layer.forward,
                    layer.backward + layer.recompute};
  if (ft.adapters()) {
    const double lora = lora_layer_params(ctx.model, ft) / t;
    block.weight_bytes = (n.layer_matmul_params * frozen_weight_bytes(ft, l.tp) +
                          (n.layer_params - n.layer_matmul_params) * 2) / t +
                         lora * bytes.weights;
    block.grad_bytes = lora * bytes.grads;
  }
  const double trained_ends = ft.adapters() ? 0.0 : bytes.grads;
  const double ends = experts ? 0.0 : 1.0 / t;
  std::vector<ShardedUnit> units;
  units.push_back({n.embedding_params * ends * bytes.weights,
                   n.embedding_params * ends * trained_ends, embedding.forward,
                   embedding.backward});
  units.insert(units.end(), static_cast<size_t>(ctx.model.n_layers), block);
  units.push_back({n.head_params * ends * bytes.weights, n.head_params * ends * trained_ends,
                   head.forward, head.backward});
  return units;
}

struct EpTraffic {
  double bytes = 0;    // one rank's all-to-all bytes per MoE layer and micro-batch
  double seconds = 0;  // their time, not overlapped
};

// The expert all-to-alls of one MoE layer and micro-batch on one rank: each
// call moves the rank's tokens (/ tp with SP, / cp) x dim values:
// - inside a node (ep x tp x cp GPUs fit): top_k copies, a flat all-to-all
//   over the node's links;
// - over N nodes, with group-limited routing (DeepSeek-V3 section 2.1.2 and
//   3.2.2): a token reaches at most M = min(top_k, N, topk_groups x
//   max(1, N / n_groups)) nodes; it crosses the network once per remote target
//   node ((N - 1) / N of M copies) and is forwarded to its top_k experts over
//   NVLink; both run at once, so the slower sets the time;
// - over N nodes without it: top_k copies over the network.
// Values are 16-bit, but with FP8 GEMMs the dispatch and the gradient sent
// back before the experts' down-projection are FP8 with one f32 scale per 128
// values (DeepSeek-V3 3.3.3; combine and its gradient stay bf16).
EpTraffic ep_traffic(const PlanContext& ctx, const Cluster& cl, const Job& job, const Layout& l) {
  const MoeConfig& moe = ctx.model.moe;
  const double tokens = static_cast<double>(job.seq * l.micro_batch) /
                        static_cast<double>(l.cp) /
                        (l.sequence_parallel ? static_cast<double>(l.tp) : 1.0);
  const double values = tokens * static_cast<double>(ctx.model.dim);
  const double e = job.precision == Precision::bf16 ? 2 : 4;
  const double fp8 = 1 + 4.0 / 128;
  // forward dispatch, forward combine, their gradients; full recomputation
  // repeats the forward pair.
  std::vector<double> calls{job.fp8 ? fp8 : e, e, job.fp8 ? fp8 : e, e};
  if (l.recompute == Recompute::full) calls.insert(calls.end(), {calls[0], e});
  const double k = static_cast<double>(moe.top_k);
  const int64_t span = l.ep_span();
  EpTraffic out;
  for (double bytes : calls) {
    if (span <= cl.gpus_per_node) {
      out.bytes += k * values * bytes;
      out.seconds += all_to_all_seconds(k * values * bytes, l.ep, cl.intra);
      continue;
    }
    const int64_t nodes = span / cl.gpus_per_node;
    if (moe.topk_groups >= moe.n_groups) {  // no node limit
      out.bytes += k * values * bytes;
      out.seconds += all_to_all_seconds(k * values * bytes, l.ep, cl.inter);
      continue;
    }
    const double n = static_cast<double>(nodes);
    const double reach =
        std::min({k, n, static_cast<double>(moe.topk_groups) *
                            std::max(1.0, n / static_cast<double>(moe.n_groups))});
    const double network = reach * values * bytes, forward = k * values * bytes;
    out.bytes += network * (n - 1) / n + forward;
    const int64_t local = std::max<int64_t>(1, cl.gpus_per_node * l.ep / span);
    out.seconds += std::max(all_to_all_seconds(network, nodes, cl.inter),
                            all_to_all_seconds(forward, local, cl.intra));
  }
  return out;
}

void name_bottleneck(Estimate& est) {
  const std::array<std::pair<const char*, double>, 10> overheads{
      {{"bubble", est.time.bubble},
       {"EP comm", est.time.ep},
       {"optimizer step", est.time.optimizer},
       {"TP comm", est.time.tp},
       {"CP comm", est.time.cp},
       {"DP comm", est.time.dp},
       {"PP comm", est.time.pp},
       {"recompute", est.time.recompute},
       {"offload", est.time.offload},
       {"checkpoint I/O", est.time.checkpoint}}};
  est.bottleneck = "compute";
  est.bottleneck_share = est.time.compute / est.step_seconds;
  double largest = 0;
  for (const auto& [name, seconds] : overheads) {
    if (seconds > largest && seconds >= 0.05 * est.step_seconds) {
      largest = seconds;
      est.bottleneck = name;
      est.bottleneck_share = seconds / est.step_seconds;
    }
  }
}

}  // namespace

GpuSpec effective_gpu(const Cluster& cl, const Job& job) {
  GpuSpec gpu = cl.gpu;
  if (job.compute_efficiency > 0) gpu.gemm_efficiency = job.compute_efficiency;
  return gpu;
}

GpuSpec layout_gpu(const Cluster& cl, const Job& job, const Layout& l) {
  GpuSpec gpu = effective_gpu(cl, job);
  if (l.schedule == Schedule::dualpipe && l.pp > 1 && l.ep > 1) {
    MESHTRAIN_CHECK(job.comm_sms < gpu.sms, "plan: --comm-sms {} leaves none of the {}'s {} SMs",
                    job.comm_sms, gpu.name, gpu.sms);
    const double left = static_cast<double>(gpu.sms - job.comm_sms) / static_cast<double>(gpu.sms);
    gpu.peak_flops *= left;
    gpu.fp8_peak_flops *= left;
  }
  return gpu;
}

ComputeShape compute_shape(const Job& job, const Layout& l) {
  ComputeShape shape;
  shape.seq = job.seq;
  shape.micro_batch = l.micro_batch;
  shape.tp = l.tp;
  shape.cp = l.cp;
  shape.sequence_parallel = l.sequence_parallel;
  shape.recompute = l.recompute;
  shape.dropout = job.dropout;
  shape.value_bytes = job.precision == Precision::bf16 ? 2 : 4;
  shape.finetune = job.finetune;
  shape.attention = job.attention;
  shape.fp8 = job.fp8;
  shape.mtp = job.mtp;
  return shape;
}

ActivationShape activation_shape(const PlanContext& ctx, const Job& job, const Layout& l) {
  ActivationShape shape{ctx.active, job.seq, l.micro_batch, l.tp, l.sequence_parallel,
                        l.recompute};
  shape.dropout = job.dropout;
  shape.value_bytes = job.precision == Precision::bf16 ? 2 : 4;
  shape.cp = l.cp;
  shape.linear_input_bytes = job.fp8 ? 1 : 0;
  return shape;
}

Estimate evaluate(const PlanContext& ctx, const Cluster& cl, const Job& job, const Layout& l) {
  const ModelConfig& model = ctx.model;
  Estimate est;
  est.layout = l;
  est.gpus = cl.gpus;
  est.microbatches = job.global_batch / (l.dp * l.micro_batch);
  const int64_t m = est.microbatches;
  const GpuSpec gpu = layout_gpu(cl, job, l);
  const ComputeShape shape = compute_shape(job, l);

  // Per-layer costs, the split of layers over stages, each stage's time.
  const OpsTime layer = layer_time(model, gpu, shape);
  const LayerCosts costs{layer.total(), embedding_time(model, gpu, shape).total(),
                         head_time(model, gpu, shape).total()};
  if (l.pp == 1) {
    est.split = {model.n_layers};
  } else if (!job.pipeline_split.empty()) {
    est.split = chunks_from_stages(job.pipeline_split, l.vpp);
  } else {
    const bool dual = l.schedule == Schedule::dualpipe;
    est.split = !job.balance_pipeline ? uniform_pipeline_split(model.n_layers, l.pp, l.vpp)
                : dual                ? balanced_dualpipe_split(costs, model.n_layers, l.pp)
                                      : balanced_pipeline_split(costs, model.n_layers, l.pp, l.vpp);
  }
  const std::vector<int64_t> per_stage = stage_layers(est.split, l.pp);
  est.layers_per_stage = *std::max_element(per_stage.begin(), per_stage.end());
  est.stage_seconds = stage_costs(costs, est.split, l.pp);

  // Memory: the first and last stages hold the ends, the first the most
  // micro-batches; stage 1 is checked too (the first may hold fewer layers).
  std::vector<int64_t> stages{0};
  if (l.pp > 2) stages.push_back(1);
  if (l.pp > 1) stages.push_back(l.pp - 1);
  StageMemory worst;
  for (int64_t r : stages) {
    StageMemory mem = stage_memory(ctx, job, l, m, per_stage[static_cast<size_t>(r)],
                                   per_stage[static_cast<size_t>(l.pp - 1 - r)], r);
    if (r == 0 || mem.memory.device_total() > worst.memory.device_total()) {
      worst = mem;
      est.memory_stage_layers = per_stage[static_cast<size_t>(r)];
      est.memory_stage = l.pp == 1 ? "only" : r == 0 ? "first" : r == l.pp - 1 ? "last" : "second";
    }
  }
  est.memory = worst.memory;
  est.params_per_rank = worst.psi;
  est.hbm_fraction = est.memory.device_total() / cl.gpu.hbm_bytes;
  est.fits = est.hbm_fraction <= 1.0;

  // Compute: m micro-batches at the slowest stage's pace plus the fill and
  // drain (Narayanan et al.), split into work, recomputation and idle time.
  const double mb = static_cast<double>(m), p = static_cast<double>(l.pp);
  const bool interleaved = l.pp > 1 && l.schedule == Schedule::interleaved;
  const bool dual = l.pp > 1 && l.schedule == Schedule::dualpipe;
  // One micro-batch on the pacing rank (DualPipe: the mean of a rank's two stages).
  const double t_mb = dual ? dualpipe_pace(est.stage_seconds)
                           : *std::max_element(est.stage_seconds.begin(), est.stage_seconds.end());
  double pipe = pipeline_step(est.stage_seconds, m, interleaved ? l.vpp : 1);
  if (dual) {
    // DeepSeek-V3 table 2: bubble (p/2 - 1)(F&B + B - 3W) with the slowest
    // stage's forward F, backward B (with recomputation) and its weight
    // gradients W, F&B = F + B (overlap hides communication, not compute).
    const double share = t_mb / layer.total();
    const double f = share * layer.forward, w = share * layer.weight;
    const double b = t_mb - f;
    pipe = mb * t_mb + (p / 2 - 1) * std::max(0.0, f + 2 * b - 3 * w);
  }
  double stage_sum = 0;
  for (double s : est.stage_seconds) stage_sum += s;
  const double busy = mb * stage_sum / p;  // every stage's own work, averaged
  est.time.recompute = mb * static_cast<double>(model.n_layers) / p * layer.recompute;
  est.time.compute = busy - est.time.recompute;
  est.time.bubble = pipe - busy;  // fill, drain and the imbalance between stages
  const double layers = static_cast<double>(est.layers_per_stage);

  const double e = shape.value_bytes;
  const double sbh = static_cast<double>(job.seq * l.micro_batch) / static_cast<double>(l.cp) *
                     static_cast<double>(model.dim);
  const StateBytes bytes = state_bytes(job.precision, job.optimizer);
  // TP: 2 all-reduces (or reduce-scatter + all-gather with SP) forward, 2 backward,
  // 2 more in the recomputed forward of full recomputation; not overlapped.
  if (l.tp > 1) {
    const Link& link = l.tp <= cl.gpus_per_node ? cl.intra : cl.inter;
    const double per_layer = l.recompute == Recompute::full ? 6 : 4;
    est.time.tp = mb * layers * per_layer * all_reduce_seconds(e * sbh, l.tp, link);
  }
  // CP (all-gather KV, Llama 3 section 3.3.2): per layer, gather K and V
  // forward, again in backward, reduce-scatter their gradients (and gather once
  // more in full recomputation), hidden behind the layer's attention.
  if (l.cp > 1) {
    const Link& link = l.tp * l.cp <= cl.gpus_per_node ? cl.intra : cl.inter;
    const AttentionShape at = attention_shape(model);
    const double kv_bytes = e * static_cast<double>(job.seq * l.micro_batch) * (at.k + at.v) /
                            static_cast<double>(l.tp);
    const double gathers = l.recompute == Recompute::full ? 3 : 2;
    const double per_layer = gathers * all_gather_seconds(kv_bytes, l.cp, link) +
                             reduce_scatter_seconds(kv_bytes, l.cp, link);
    double attention = 0;  // flash, or the unfused core's products and streams
    for (const OpTime& op : layer.ops) {
      if (op.name == "attention" || op.name.rfind("scores", 0) == 0 || op.name == "softmax") {
        attention += op.total();
      }
    }
    est.cp_comm_raw = mb * layers * per_layer;
    est.time.cp = mb * layers * std::max(0.0, per_layer - attention);
  }
  {
    std::vector<ShardedUnit> units, expert_units;
    if (l.zero == 3) {
      const OpsTime embed = embedding_time(model, gpu, shape), head = head_time(model, gpu, shape);
      units = sharded_units(ctx, job, l, layer, embed, head, false);
      expert_units = sharded_units(ctx, job, l, layer, embed, head, true);
    }
    dp_time(cl, l, bytes, worst.psi - worst.psi_experts, units, mb, t_mb, est);
    if (worst.psi_experts > 0) {
      // The routed experts' gradients (and ZeRO state) over the
      // expert-data-parallel group: dp / ep ranks (x cp), ep x tp x cp apart;
      // folded, tp x cp x dp / ep ranks, ep apart (the link of a group that
      // wide).
      Layout group = l;
      group.dp = l.expert_dp();
      group.shard = l.shard > 0 ? l.shard / l.ep : 0;
      group.tp = l.ep_fold ? l.ep : l.tp * l.ep;
      if (l.ep_fold) group.cp = 1;
      Estimate experts;
      dp_time(cl, group, bytes, worst.psi_experts, expert_units, mb, t_mb, experts);
      est.dp_comm_raw += experts.dp_comm_raw;
      est.time.dp = l.zero == 3 ? est.time.dp + experts.time.dp
                                : std::max(0.0, est.dp_comm_raw - est.dp_overlap_window);
    }
  }
  // EP: per MoE layer and micro-batch, the dispatch and combine all-to-alls
  // forward, their gradients backward (and the forward's again under full
  // recomputation): ep_traffic. DualPipe hides them behind the other
  // direction's chunk: only what exceeds the layer's compute is exposed.
  if (l.ep > 1) {
    const EpTraffic ep = ep_traffic(ctx, cl, job, l);
    const double moe_layers =
        layers * ctx.counts.moe_layers / static_cast<double>(model.n_layers);
    est.ep_bytes_per_step = mb * moe_layers * ep.bytes;
    est.ep_comm_raw = mb * moe_layers * ep.seconds;
    est.time.ep = dual ? mb * moe_layers * std::max(0.0, ep.seconds - layer.total())
                       : est.ep_comm_raw;
  }
  // PP: one activation forward and one gradient backward per micro-batch and
  // stage boundary on the critical path (scatter-gather: 1/tp of it each);
  // under DualPipe each behind a forward chunk of the other direction.
  if (l.pp > 1) {
    const Link& link = l.tp * l.cp * l.dp >= cl.gpus_per_node ? cl.inter : cl.intra;
    const double v = static_cast<double>(l.vpp);
    const double send = send_recv_seconds(e * sbh / static_cast<double>(l.tp), link);
    est.time.pp = 2 * (mb * v + p - 1) *
                  (dual ? std::max(0.0, send - layers * layer.forward) : send);
  }
  // The optimizer step streams its shard of the states through HBM once: read
  // the gradient, read and write the optimizer state (incl. the fp32 master),
  // write the 16-bit weights (fp32: read and write the weights).
  const double shard =
      l.zero >= 1 ? (worst.psi - worst.psi_experts) / static_cast<double>(l.shards()) +
                        worst.psi_experts / static_cast<double>(expert_shards(l))
                  : worst.psi;
  if (l.offload == Offload::none) {
    const double touched = bytes.grads + 2 * bytes.optimizer +
                           (job.precision == Precision::bf16 ? 1 : 2) * bytes.weights;
    est.time.optimizer = shard * touched / cl.gpu.hbm_bandwidth;
  } else {
    est.time.offload = shard * (bytes.grads + bytes.weights) / cl.gpu.pcie_bandwidth +
                       shard / job.cpu_adam_params_per_second;
  }

  // Checkpoints: weights and optimizer state (not gradients; adapters only when
  // fine-tuning them) written at the storage's aggregate bandwidth while
  // training waits, once per interval (Daly's optimum when < 0).
  const double gpus = static_cast<double>(cl.gpus);
  est.trainable_params = job.finetune.adapters()
                             ? static_cast<double>(model.n_layers) *
                                   lora_layer_params(model, job.finetune)
                             : ctx.counts.total_params;
  est.checkpoint_bytes = est.trainable_params * (bytes.weights + bytes.optimizer);
  est.checkpoint_seconds = est.checkpoint_bytes / job.checkpoint_write_bandwidth;
  double interval = job.checkpoint_interval_seconds;
  if (interval < 0) {
    const double rate = job.failures.failures_per_gpu_hour * gpus / 3600.0;
    interval = rate > 0 ? daly_interval(est.checkpoint_seconds, 1 / rate) : 3600;
  }
  const double solve_step = est.time.total();
  if (interval > 0) est.time.checkpoint = est.checkpoint_seconds * solve_step / interval;

  est.step_seconds = est.time.total();
  const double tokens_step = static_cast<double>(job.tokens_per_step());
  double model_flops = ctx.model_flops_per_token;
  if (job.finetune.adapters()) {  // no weight gradients of the frozen GEMMs
    model_flops -= 2 * (static_cast<double>(model.n_layers) * ctx.counts.layer_matmul_params +
                        ctx.counts.output_matmul_params);
  }
  est.model_flops_per_step = model_flops * tokens_step;
  const AttentionShape at = attention_shape(model);
  const double seq = static_cast<double>(job.seq);
  // Selective: the core's forward again (2 seq (qk + values) FLOPs per token).
  const double recompute_per_layer = l.recompute == Recompute::selective
                                         ? 2.0 * model.attention_seq(seq) * (at.qk + at.values())
                                     : l.recompute == Recompute::full
                                         ? ctx.layer_flops_per_token / 3.0
                                         : 0.0;
  est.hardware_flops_per_step =
      est.model_flops_per_step +
      static_cast<double>(model.n_layers) * recompute_per_layer * tokens_step;
  est.tokens_per_second = tokens_step / est.step_seconds;
  est.mfu = est.model_flops_per_step / (est.step_seconds * gpus * cl.gpu.peak_flops);
  est.steps = job.tokens / tokens_step;
  est.train_seconds = est.steps * est.step_seconds;
  est.gpu_hours = est.train_seconds * gpus / 3600.0;
  est.cost = est.gpu_hours * cl.price_per_gpu_hour;
  if (interval > 0) {
    est.goodput = plan_goodput(est.steps * solve_step, cl.gpus, est.checkpoint_seconds, interval,
                               job.failures);
  } else {  // no checkpoints: failures are not modelled (each would restart the run)
    est.goodput.wall_seconds = est.train_seconds;
  }
  est.wall_gpu_hours = est.goodput.wall_seconds * gpus / 3600.0;
  est.wall_cost = est.wall_gpu_hours * cl.price_per_gpu_hour;
  name_bottleneck(est);
  return est;
}

}  // namespace meshtrain::plan
