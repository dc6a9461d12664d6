#include "meshtrain/plan/planner.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>

#include "meshtrain/plan/collectives.h"
#include "meshtrain/util/error.h"

namespace meshtrain::plan {

void Job::validate() const {
  MESHTRAIN_CHECK(seq > 0, "plan: --seq must be > 0, got {}", seq);
  MESHTRAIN_CHECK(global_batch > 0, "plan: the global batch must be at least one sequence");
  MESHTRAIN_CHECK(tokens >= 0, "plan: --tokens must be >= 0");
  MESHTRAIN_CHECK(compute_efficiency > 0 && compute_efficiency <= 1,
                  "plan: --efficiency must be in (0, 1], got {}", compute_efficiency);
  MESHTRAIN_CHECK(fragmentation >= 0 && fragmentation < 1,
                  "plan: --fragmentation must be in [0, 1), got {}", fragmentation);
  MESHTRAIN_CHECK(reserve_bytes >= 0, "plan: --reserve-gib must be >= 0");
  MESHTRAIN_CHECK(checkpoint_interval_seconds >= 0, "plan: --ckpt-every-min must be >= 0");
  MESHTRAIN_CHECK(checkpoint_write_bandwidth > 0, "plan: --ckpt-bw must be > 0");
  MESHTRAIN_CHECK(cpu_adam_params_per_second > 0, "plan: --cpu-adam-rate must be > 0");
}

PlanContext make_context(const ModelConfig& model, const Job& job) {
  model.validate();
  PlanContext ctx;
  ctx.model = model;
  ctx.counts = count_transformer(model);
  ctx.layer_flops_per_token = layer_train_flops_per_token(model, job.seq);
  ctx.output_flops_per_token = output_train_flops_per_token(model);
  ctx.model_flops_per_token = static_cast<double>(model.n_layers) * ctx.layer_flops_per_token +
                              ctx.output_flops_per_token;
  return ctx;
}

std::string zero_label(const Layout& l) {
  return l.shard > 0 ? fmt::format("{}/{}", l.zero, l.shard) : fmt::format("{}", l.zero);
}

std::string describe(const Layout& l) {
  std::string s = fmt::format("tp {} pp {}", l.tp, l.pp);
  if (l.vpp > 1) s += fmt::format(" v {}", l.vpp);
  s += fmt::format(" dp {} zero {} mb {} {}", l.dp, zero_label(l), l.micro_batch,
                   recompute_name(l.recompute));
  if (l.sequence_parallel) s += " sp";
  if (l.offload != Offload::none) s += " offload";
  if (l.schedule == Schedule::gpipe) s += " gpipe";
  return s;
}

std::string check_layout(const PlanContext& ctx, const Cluster& cl, const Job& job,
                         const Layout& l) {
  const ModelConfig& m = ctx.model;
  if (l.tp < 1 || l.pp < 1 || l.vpp < 1 || l.dp < 1 || l.micro_batch < 1) {
    return "tp, pp, vpp, dp and micro-batch must be >= 1";
  }
  if (l.zero < 0 || l.zero > 3) return fmt::format("zero stage {} is not 0..3", l.zero);
  if (l.shard != 0) {
    if (l.zero != 3) return "a shard group (hybrid sharding) needs ZeRO-3";
    if (l.shard < 1 || l.shard >= l.dp || l.dp % l.shard != 0) {
      return fmt::format("shard group {} must divide dp {} and be smaller", l.shard, l.dp);
    }
  }
  if (l.tp * l.pp * l.dp != cl.gpus) {
    return fmt::format("tp {} x pp {} x dp {} != {} GPUs", l.tp, l.pp, l.dp, cl.gpus);
  }
  if (m.n_heads % l.tp != 0) return fmt::format("tp {} does not divide {} heads", l.tp, m.n_heads);
  if (m.n_kv_heads % l.tp != 0) {
    return fmt::format("tp {} does not divide {} kv heads", l.tp, m.n_kv_heads);
  }
  if (m.hidden_dim % l.tp != 0) {
    return fmt::format("tp {} does not divide the MLP width {}", l.tp, m.hidden_dim);
  }
  if (l.pp > m.n_layers) return fmt::format("pp {} > {} layers", l.pp, m.n_layers);
  if (l.sequence_parallel && l.tp == 1) return "sequence parallelism needs tp > 1";
  if (job.global_batch % (l.dp * l.micro_batch) != 0) {
    return fmt::format("global batch {} is not a multiple of dp {} x micro-batch {}",
                       job.global_batch, l.dp, l.micro_batch);
  }
  const int64_t m_count = job.global_batch / (l.dp * l.micro_batch);
  if (l.vpp > 1) {
    if (l.schedule != Schedule::interleaved || l.pp == 1) {
      return "virtual stages need the interleaved schedule and pp > 1";
    }
    // Stages hold ceil(L / pp) layers (a stage or two may hold one fewer, as
    // Llama 3's 126 layers on 16 stages), split into v equal chunks.
    const int64_t stage_layers = (m.n_layers + l.pp - 1) / l.pp;
    if (stage_layers % l.vpp != 0) {
      return fmt::format("v {} does not divide the {} layers of a stage", l.vpp, stage_layers);
    }
    if (m_count % l.pp != 0) {
      return fmt::format("interleaving needs micro-batches ({}) a multiple of pp {}", m_count,
                         l.pp);
    }
  }
  if (l.schedule == Schedule::interleaved && l.vpp == 1) return "interleaved needs v > 1";
  if (l.zero >= 2 && l.pp > 1) {
    return "ZeRO-2/3 with pp > 1 (gradients sharded every micro-batch; DeepSpeed refuses it)";
  }
  return "";
}

namespace {

struct StageMemory {
  MemoryBreakdown memory;
  double psi = 0;  // parameters on this rank before ZeRO sharding
};

StageMemory stage_memory(const PlanContext& ctx, const Job& job, const Layout& l,
                         int64_t microbatches, int64_t layers, bool first, bool last) {
  const TransformerCounts& n = ctx.counts;
  const double t = static_cast<double>(l.tp);
  double params = static_cast<double>(layers) * n.layer_params;
  if (first) params += n.embedding_params;
  if (last) {
    params += n.head_params;
    if (!first && ctx.model.tie_embeddings) params += n.output_matmul_params;  // tied copy
  }
  StageMemory out;
  out.psi = params / t;
  const StateBytes bytes = state_bytes(job.precision, job.optimizer);
  const ModelStates states = model_state_memory(out.psi, bytes, l.zero, l.shards());
  MemoryBreakdown& mem = out.memory;
  mem.params = states.params;
  mem.grads = states.grads;
  mem.optimizer = states.optimizer;
  if (l.offload == Offload::optimizer) {
    mem.offloaded = mem.optimizer;
    mem.optimizer = 0;
  }

  const double e = job.precision == Precision::bf16 ? 2 : 4;
  ActivationShape shape{ctx.model, job.seq, l.micro_batch, l.tp, l.sequence_parallel,
                        l.recompute, job.dropout, e};
  const Schedule schedule = l.pp == 1 ? Schedule::one_f_one_b : l.schedule;
  const int64_t stage = first ? 0 : l.pp - 1;
  const double inflight = inflight_microbatches(schedule, l.pp, l.vpp, microbatches, stage);
  mem.activations = inflight * static_cast<double>(layers) * layer_activation_bytes(shape);
  if (first) mem.activations += inflight * first_stage_activation_bytes(shape);
  if (last) mem.activations += inflight * last_stage_activation_bytes(shape);
  if (l.recompute == Recompute::full) {
    // Backward rematerialises one layer at a time (memory-efficient attention).
    ActivationShape one = shape;
    one.recompute = Recompute::selective;
    mem.activations += layer_activation_bytes(one);
  }

  const double sbh = static_cast<double>(job.seq * l.micro_batch * ctx.model.dim);
  const double mlp_width = static_cast<double>(ctx.model.hidden_dim) *
                           (ctx.model.family == Family::llama ? 2 : 1);
  mem.workspace = job.reserve_bytes +
                  2 * e * static_cast<double>(job.seq * l.micro_batch) * mlp_width / t +
                  (l.sequence_parallel ? e * sbh : 0);
  mem.comm = l.zero == 3 ? 2 * n.layer_params / t * bytes.weights : 2 * job.bucket_bytes;
  if (l.pp > 1) mem.comm += 2 * e * sbh / t;  // send and receive buffers
  mem.fragmentation = job.fragmentation * mem.tracked();
  return out;
}

}  // namespace

Estimate evaluate(const PlanContext& ctx, const Cluster& cl, const Job& job, const Layout& l) {
  const ModelConfig& model = ctx.model;
  Estimate est;
  est.layout = l;
  est.gpus = cl.gpus;
  est.microbatches = job.global_batch / (l.dp * l.micro_batch);
  const int64_t m = est.microbatches;
  est.layers_per_stage = (model.n_layers + l.pp - 1) / l.pp;
  const int64_t layers = est.layers_per_stage;

  // Memory: the first and the last stage differ (embedding, output layer, logits).
  const StageMemory first = stage_memory(ctx, job, l, m, layers, true, l.pp == 1);
  StageMemory worst = first;
  est.memory_stage = l.pp == 1 ? "only" : "first";
  if (l.pp > 1) {
    const StageMemory last = stage_memory(ctx, job, l, m, layers, false, true);
    if (last.memory.device_total() > first.memory.device_total()) {
      worst = last;
      est.memory_stage = "last";
    }
  }
  est.memory = worst.memory;
  est.params_per_rank = worst.psi;
  est.hbm_fraction = est.memory.device_total() / cl.gpu.hbm_bytes;
  est.fits = est.hbm_fraction <= 1.0;

  // Compute: the slowest stage's share of one micro-batch.
  const double t = static_cast<double>(l.tp), v = static_cast<double>(l.vpp);
  const double p = static_cast<double>(l.pp), mb = static_cast<double>(m);
  const double tokens_mb = static_cast<double>(job.seq * l.micro_batch);
  const double hd = static_cast<double>(model.n_heads * model.head_dim());
  double recompute_per_layer = 0;  // extra forward FLOPs per token
  if (l.recompute == Recompute::selective) {
    recompute_per_layer = 4.0 * static_cast<double>(job.seq) * hd;  // QK^T and AV again
  } else if (l.recompute == Recompute::full) {
    recompute_per_layer = ctx.layer_flops_per_token / 3.0;  // the whole forward again
  }
  // Every stage holds ceil(L / pp) layers, so the last one (with the output
  // layer) is the slowest.
  const double stage_model =
      tokens_mb * (static_cast<double>(layers) * ctx.layer_flops_per_token +
                   ctx.output_flops_per_token) / t;
  const double stage_extra = tokens_mb * static_cast<double>(layers) * recompute_per_layer / t;
  const double rate = cl.gpu.peak_flops * job.compute_efficiency;
  const double t_mb_model = stage_model / rate, t_mb = (stage_model + stage_extra) / rate;
  est.time.compute = mb * t_mb_model;
  est.time.recompute = mb * (t_mb - t_mb_model);
  const double bubble_stages = l.schedule == Schedule::gpipe || l.pp == 1 ? p - 1 : (p - 1) / v;
  est.time.bubble = bubble_stages * t_mb;

  const double e = job.precision == Precision::bf16 ? 2 : 4;
  const double sbh = tokens_mb * static_cast<double>(model.dim);
  const StateBytes bytes = state_bytes(job.precision, job.optimizer);
  // TP: 2 all-reduces (or reduce-scatter + all-gather with SP) forward, 2 backward,
  // 2 more in the recomputed forward of full recomputation; not overlapped.
  if (l.tp > 1) {
    const Link& link = l.tp <= cl.gpus_per_node ? cl.intra : cl.inter;
    const double per_layer = l.recompute == Recompute::full ? 6 : 4;
    est.time.tp = mb * static_cast<double>(layers) * per_layer *
                  all_reduce_seconds(e * sbh, l.tp, link);
  }
  // DP: ZeRO's collectives over the rank's parameters (the DP group is strided
  // by tp). They are issued per bucket (Megatron-Core's max(40M, 1M x dp)
  // parameters) or, for ZeRO-3, per layer, and each call pays the latency.
  if (l.dp > 1) {
    const Link& link = l.tp * l.dp <= cl.gpus_per_node ? cl.intra : cl.inter;
    const double grads = worst.psi * bytes.grads, weights = worst.psi * bytes.weights;
    const double dp = static_cast<double>(l.dp);
    auto calls = [&](double (*collective)(double, int64_t, const Link&), double total,
                     double count) { return count * collective(total / count, l.dp, link); };
    const double buckets = std::max(1.0, std::ceil(worst.psi / std::max(40e6, 1e6 * dp)));
    const double units = static_cast<double>(layers) + 1;  // + the embedding or head
    switch (l.zero) {
      case 0:  // all-reduce once per step, behind the last micro-batch's backward
        est.dp_comm_raw = calls(all_reduce_seconds, grads, buckets);
        est.dp_overlap_window = 2.0 / 3.0 * t_mb;
        break;
      case 1:  // reduce-scatter behind the last backward, all-gather behind the next forward
        est.dp_comm_raw = calls(reduce_scatter_seconds, grads, buckets) +
                          calls(all_gather_seconds, weights, buckets);
        est.dp_overlap_window = t_mb;
        break;
      case 2:  // reduce-scatter after every micro-batch's backward
        est.dp_comm_raw = mb * calls(reduce_scatter_seconds, grads, buckets) +
                          calls(all_gather_seconds, weights, buckets);
        est.dp_overlap_window = mb * 2.0 / 3.0 * t_mb + t_mb / 3.0;
        break;
      default: {  // gather weights for forward and backward, reduce-scatter, every micro-batch
        // Over the shard group; with hybrid sharding, each rank's gradient shard is then
        // all-reduced across the dp / shard replicas once per step.
        const int64_t n = l.shards();
        const Link& group = l.tp * n <= cl.gpus_per_node ? cl.intra : cl.inter;
        auto in_group = [&](double (*collective)(double, int64_t, const Link&), double total) {
          return units * collective(total / units, n, group);
        };
        est.dp_comm_raw = mb * (2 * in_group(all_gather_seconds, weights) +
                                in_group(reduce_scatter_seconds, grads));
        if (n < l.dp) {
          const double shard_grads = grads / static_cast<double>(n);
          const double shard_buckets =
              std::max(1.0, std::ceil(worst.psi / static_cast<double>(n) / std::max(40e6, 1e6 * dp)));
          est.dp_comm_raw += shard_buckets * all_reduce_seconds(shard_grads / shard_buckets,
                                                                l.dp / n, link);
        }
        est.dp_overlap_window = mb * t_mb;
        break;
      }
    }
    est.time.dp = std::max(0.0, est.dp_comm_raw - est.dp_overlap_window);
  }
  // PP: one activation forward and one gradient backward per micro-batch and
  // stage boundary on the critical path (scatter-gather: 1/tp of it each).
  if (l.pp > 1) {
    const Link& link = l.tp * l.dp >= cl.gpus_per_node ? cl.inter : cl.intra;
    est.time.pp = 2 * (mb * v + p - 1) * send_recv_seconds(e * sbh / t, link);
  }
  // The optimizer step streams its shard of the states through HBM once: read
  // the gradient, read and write the optimizer state (incl. the fp32 master),
  // write the 16-bit weights (fp32: read and write the weights).
  const double shard = worst.psi / (l.zero >= 1 ? static_cast<double>(l.shards()) : 1.0);
  if (l.offload == Offload::none) {
    const double touched = bytes.grads + 2 * bytes.optimizer +
                           (job.precision == Precision::bf16 ? 1 : 2) * bytes.weights;
    est.time.optimizer = shard * touched / cl.gpu.hbm_bandwidth;
  }
  if (l.offload == Offload::optimizer) {
    est.time.offload = shard * (bytes.grads + bytes.weights) / cl.gpu.pcie_bandwidth +
                       shard / job.cpu_adam_params_per_second;
  }

  // Checkpoints: weights and optimizer state (not gradients) written at the
  // storage's aggregate bandwidth while training waits, once per interval.
  if (job.checkpoint_interval_seconds > 0) {
    est.checkpoint_bytes = ctx.counts.total_params * (bytes.weights + bytes.optimizer);
    est.checkpoint_seconds = est.checkpoint_bytes / job.checkpoint_write_bandwidth;
    est.time.checkpoint =
        est.checkpoint_seconds * est.time.total() / job.checkpoint_interval_seconds;
  }

  est.step_seconds = est.time.total();
  const double tokens_step = static_cast<double>(job.tokens_per_step());
  est.model_flops_per_step = ctx.model_flops_per_token * tokens_step;
  est.hardware_flops_per_step =
      est.model_flops_per_step +
      static_cast<double>(model.n_layers) * recompute_per_layer * tokens_step;
  est.tokens_per_second = tokens_step / est.step_seconds;
  const double gpus = static_cast<double>(cl.gpus);
  est.mfu = est.model_flops_per_step / (est.step_seconds * gpus * cl.gpu.peak_flops);
  est.steps = job.tokens / tokens_step;
  est.train_seconds = est.steps * est.step_seconds;
  est.gpu_hours = est.train_seconds * gpus / 3600.0;
  est.cost = est.gpu_hours * cl.price_per_gpu_hour;

  const std::array<std::pair<const char*, double>, 8> overheads{
      {{"bubble", est.time.bubble},
       {"optimizer step", est.time.optimizer},
       {"TP comm", est.time.tp},
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
  return est;
}

double calibrate_efficiency(const PlanContext& ctx, const Cluster& cl, Job job, const Layout& l,
                            double measured) {
  MESHTRAIN_CHECK(measured > 0, "plan: --measured-step-s must be > 0, got {}", measured);
  job.compute_efficiency = 1.0;
  const double fastest = evaluate(ctx, cl, job, l).step_seconds;
  MESHTRAIN_CHECK(measured >= fastest,
                  "plan: a measured step of {:.4g} s is faster than {} can be even at peak "
                  "FLOP/s ({:.4g} s): check the layout, batch and GPU",
                  measured, describe(l), fastest);
  double lo = 1e-4, hi = 1.0;
  for (int i = 0; i < 100 && hi - lo > 1e-9; ++i) {
    job.compute_efficiency = 0.5 * (lo + hi);
    (evaluate(ctx, cl, job, l).step_seconds > measured ? lo : hi) = job.compute_efficiency;
  }
  return 0.5 * (lo + hi);
}

}  // namespace meshtrain::plan
