// --explain: the arithmetic behind one estimate, each formula with its numbers.
#include <fmt/format.h>

#include "meshtrain/plan/collectives.h"
#include "meshtrain/plan/compute.h"
#include "meshtrain/plan/report.h"
#include "meshtrain/plan/transformer.h"

namespace meshtrain::plan {

std::string format_explain(const PlanInputs& in, const Estimate& e) {
  const PlanContext& ctx = in.ctx;
  const ModelConfig& m = ctx.model;
  const Job& j = in.job;
  const Cluster& c = in.cluster;
  const Layout& l = e.layout;
  const TransformerCounts& n = ctx.counts;
  const StateBytes sb = state_bytes(j.precision, j.optimizer);
  const double psi = e.params_per_rank;
  const double e_bytes = j.precision == Precision::bf16 ? 2 : 4;
  std::string o = fmt::format("explain: {} on {} x {}\n\n", describe(l), e.gpus, c.gpu.name);

  o += "Parameters (closed form, = the registry's count):\n";
  o += fmt::format("  per layer {} (GEMM weights {}), embedding {}, head {}; total {}\n",
                   human_count(n.layer_params), human_count(n.layer_matmul_params),
                   human_count(n.embedding_params), human_count(n.head_params),
                   human_count(n.total_params));
  o += fmt::format(
      "  on one rank of the {} stage: Psi = ({} layers x {}{}) / tp {} = {}\n\n", e.memory_stage,
      e.memory_stage_layers, human_count(n.layer_params),
      e.memory_stage == "last"    ? " + head (+ tied output copy)"
      : e.memory_stage == "first"  ? " + embedding"
      : e.memory_stage == "second" ? ""
                                  : " + embedding + head",
      l.tp, human_count(psi));

  o += fmt::format("Model states (ZeRO, Rajbhandari et al. 2020; {} + {}: {}+{}+{} bytes/param):\n",
                   precision_name(j.precision), optimizer_name(j.optimizer), sb.weights, sb.grads,
                   sb.optimizer);
  const std::string over = l.shard > 0 ? fmt::format(" / shard group {}", l.shard)
                                       : fmt::format(" / dp {}", l.dp);
  o += fmt::format("  params    = {} Psi{} = {}\n", sb.weights, l.zero >= 3 ? over : "",
                   gib(e.memory.params));
  o += fmt::format("  grads     = {} Psi{} = {}\n", sb.grads, l.zero >= 2 ? over : "",
                   gib(e.memory.grads));
  o += fmt::format("  optimizer = {} Psi{} = {}{}\n\n", sb.optimizer, l.zero >= 1 ? over : "",
                   gib(e.memory.optimizer + e.memory.offloaded),
                   l.offload == Offload::optimizer ? " (on the host: offload)" : "");

  ActivationShape shape{m, j.seq, l.micro_batch, l.tp, l.sequence_parallel, l.recompute,
                        j.dropout, e_bytes, l.cp};
  const double per_layer = layer_activation_bytes(shape);
  const double s = static_cast<double>(j.seq), b = static_cast<double>(l.micro_batch);
  const double h = static_cast<double>(m.dim);
  const AttentionShape at = attention_shape(m);
  o += "Activations (Korthikanti et al. 2022, section 4, generalised to GQA / MLA / SwiGLU):\n";
  o += fmt::format("  s {} b {} h {} a {} q|k|v|o widths {}|{}|{}|{} MLP {} tp {}{}, recompute {}, "
                   "dropout {}\n",
                   j.seq, l.micro_batch, m.dim, m.n_heads, at.qk, at.k, at.v, at.values(),
                   m.hidden_dim, l.tp, l.sequence_parallel ? " (sequence parallel)" : "",
                   recompute_name(l.recompute), j.dropout ? "on" : "off");
  if (l.recompute == Recompute::full) {
    o += fmt::format("  per layer = {} s b h{} = {}\n", e_bytes, l.sequence_parallel ? " / t" : "",
                     gib(per_layer));
  } else {
    // 2 (q + k + v + o inputs) / h; MLA's latents are never split.
    const double attention = 2 * (at.qk + at.k + at.v + at.values()) / h;
    const double f = static_cast<double>(m.hidden_dim) / h;
    const double mlp = m.recipe().feed_forward == FeedForward::swiglu
                           ? (l.recompute == Recompute::selective ? 4 : 6)
                           : 4;
    o += fmt::format(
        "  per layer = sbh x [({}{}){} + ({:.4g} + {}x{:.3g}) / t{}{}] = {} x {:.4g} = {}\n",
        8, j.dropout ? " + 2 masks" : "", l.sequence_parallel ? " / t" : "", attention, mlp, f,
        at.latent > 0 ? fmt::format(" + {:.3g}", 2 * at.latent / h) : "",
        l.recompute == Recompute::none
            ? fmt::format(" + {} a s / (h t)", j.dropout ? 5 : 2)
            : "",
        fmt::format("{:.4g}", s * b * h), per_layer / (s * b * h), gib(per_layer));
  }
  const Schedule sched = l.pp == 1 ? Schedule::one_f_one_b : l.schedule;
  const int64_t stage = e.memory_stage == "last" ? l.pp - 1 : e.memory_stage == "second" ? 1 : 0;
  const double inflight = inflight_microbatches(sched, l.pp, l.vpp, e.microbatches, stage);
  o += fmt::format("  in flight on the {} stage ({}, p {} v {} m {}): {:.4g} micro-batches\n",
                   e.memory_stage, schedule_name(sched), l.pp, l.vpp, e.microbatches, inflight);
  o += fmt::format("  activations = {:.4g} x {} layers x {} + embedding / logits ends{} = {}\n\n",
                   inflight, e.memory_stage_layers, gib(per_layer),
                   l.recompute == Recompute::full ? " + one rematerialised layer" : "",
                   gib(e.memory.activations));
  o += fmt::format(
      "Other memory: workspace {} (reserve {} + GEMM temporaries), comm {}, fragmentation "
      "{:.0f}% of {} = {}\n",
      gib(e.memory.workspace), gib(j.reserve_bytes), gib(e.memory.comm), 100 * j.fragmentation,
      gib(e.memory.tracked()), gib(e.memory.fragmentation));
  o += fmt::format("  total {} of {} HBM ({:.0f}%)\n\n", gib(e.memory.device_total()),
                   gib(c.gpu.hbm_bytes), 100 * e.hbm_fraction);

  o += "FLOPs (PaLM appendix B: 6 N_gemm + 6 L s (qk + values) per token; 12 L s h for MHA):\n";
  o += fmt::format("  per token 6 x {} + 6 x {} x {} x ({} + {}) = {:.4g}\n",
                   human_count(static_cast<double>(m.n_layers) * n.layer_matmul_params +
                               n.output_matmul_params),
                   m.n_layers, j.seq, at.qk, at.values(), ctx.model_flops_per_token);
  o += fmt::format("  per step x {} tokens = {:.4g} model FLOPs; with recomputation {:.4g}\n",
                   j.tokens_per_step(), e.model_flops_per_step, e.hardware_flops_per_step);
  const GpuSpec gpu = effective_gpu(c, j);
  const ComputeShape ops_shape = compute_shape(j, l);
  o += fmt::format(
      "\nCompute (roofline per op, one micro-batch of {} tokens{} on one rank; {}: GEMMs at {:.2f} "
      "of {:.4g} FLOP/s or HBM {:.0f} GB/s x {:.2f}, + {:.0f} us per kernel; flash attention at "
      "{:.2f} of peak):\n",
      j.seq * l.micro_batch, l.cp > 1 ? fmt::format(" / cp {}", l.cp) : "", gpu.name,
      gpu.gemm_efficiency, gpu.peak_flops, gpu.hbm_bandwidth / 1e9, gpu.memory_efficiency,
      gpu.kernel_overhead_seconds * 1e6, gpu.attention_efficiency);
  o += fmt::format("  {:<16} {:>10} {:>9} {:>9} {:>9} {:>7}\n", "op", "GFLOP fwd", "fwd ms",
                   "bwd ms", "recomp ms", "of peak");
  auto print_ops = [&](const char* title, const OpsTime& ops) {
    o += fmt::format("  {}:\n", title);
    for (const OpTime& op : ops.ops) {
      o += fmt::format("  {:<16} {:>10.2f} {:>9.3f} {:>9.3f} {:>9.3f} {:>6.0f}%\n", op.name,
                       op.flops / 1e9, op.forward * 1e3, op.backward * 1e3, op.recompute * 1e3,
                       op.flops > 0 ? 100 * op.flops * (3 + (op.recompute > 0 ? 1 : 0)) /
                                          (op.total() * gpu.peak_flops)
                                    : 0.0);
    }
    o += fmt::format("  {:<16} {:>10} {:>9.3f} {:>9.3f} {:>9.3f}\n", "total", "",
                     ops.forward * 1e3, ops.backward * 1e3, ops.recompute * 1e3);
  };
  print_ops("one block", layer_time(m, gpu, ops_shape));
  print_ops("embedding", embedding_time(m, gpu, ops_shape));
  print_ops("head + loss", head_time(m, gpu, ops_shape));
  std::string stage_times;
  for (double t : e.stage_seconds) stage_times += fmt::format(" {:.3f}", t);
  o += fmt::format("  stages (layers per chunk {}): seconds per micro-batch{}\n",
                   fmt::join(e.split, " "), stage_times);
  o += fmt::format(
      "  pipeline = m x max(t) + (sum(t) - max(t)) / v = {} x max + ... = {:.3f} s: compute {:.3f} "
      "+ recompute {:.3f} + bubble and imbalance {:.3f} (uniform-stage fraction (p-1)/(v m) = "
      "{:.4f})\n\n",
      e.microbatches, e.time.compute + e.time.recompute + e.time.bubble, e.time.compute,
      e.time.recompute, e.time.bubble, bubble_fraction(l.pp, l.vpp, e.microbatches));
  o += "Communication (alpha-beta, nccl-tests bus bandwidth factors):\n";
  if (l.tp > 1) {
    const Link& link = l.tp <= c.gpus_per_node ? c.intra : c.inter;
    o += fmt::format(
        "  TP: m {} x {} layers x {} collectives x [2(t-1)/t x {} B / {:.0f} GB/s + latency] = "
        "{:.3f} s (not overlapped)\n",
        e.microbatches, e.layers_per_stage, l.recompute == Recompute::full ? 6 : 4,
        fmt::format("{:.4g}", e_bytes * s * b * h / static_cast<double>(l.cp)), link.bus_bandwidth / 1e9, e.time.tp);
  }
  if (l.grad_ranks() > 1) {
    const Link& link = l.tp * l.grad_ranks() <= c.gpus_per_node ? c.intra : c.inter;
    const char* what = l.zero == 0   ? "all-reduce 2(n-1)/n x grads once"
                       : l.zero == 1 ? "reduce-scatter grads + all-gather weights, (n-1)/n each, once"
                       : l.zero == 2 ? "reduce-scatter grads every micro-batch + all-gather weights"
                       : l.shard > 0
                           ? "in each shard group 2 all-gathers of weights + reduce-scatter of "
                             "grads per layer and micro-batch, then an all-reduce of the grad "
                             "shard across the replicas once"
                           : "2 all-gathers of weights + reduce-scatter of grads per layer, every "
                             "micro-batch";
    o += fmt::format("  DP (n = {}, {:.0f} GB/s): {}: grads {} = {:.3f} s; overlapped with {:.3f} s "
                     "of backward/forward; exposed {:.3f} s\n",
                     l.grad_ranks(), link.bus_bandwidth / 1e9, what, gib(psi * sb.grads), e.dp_comm_raw,
                     e.dp_overlap_window, e.time.dp);
  }
  if (l.pp > 1) {
    const Link& link = l.tp * l.cp * l.dp >= c.gpus_per_node ? c.inter : c.intra;
    const double message = e_bytes * s * b * h / static_cast<double>(l.tp * l.cp);
    o += fmt::format(
        "  PP: 2 (m v + p - 1) x (alpha + {} sbh / t / B) = 2 x ({} x {} + {} - 1) x ({:.0f} us + "
        "{} B / {:.0f} GB/s) = {:.3f} s (not overlapped)\n",
        e_bytes, e.microbatches, l.vpp, l.pp, link.latency * 1e6, human_count(message),
        link.bus_bandwidth / 1e9, e.time.pp);
  }
  if (e.time.optimizer > 0) {
    o += fmt::format("Optimizer step: {} params x {} bytes read and written / {:.0f} GB/s HBM = {:.3f} s\n",
                     human_count(psi / (l.zero >= 1 ? static_cast<double>(l.shards()) : 1.0)),
                     sb.grads + 2 * sb.optimizer +
                         (j.precision == Precision::bf16 ? 1 : 2) * sb.weights,
                     c.gpu.hbm_bandwidth / 1e9, e.time.optimizer);
  }
  if (l.offload == Offload::optimizer) {
    o += fmt::format("  offload: (grads down + weights up) over PCIe + CPU AdamW = {:.3f} s\n",
                     e.time.offload);
  }
  if (e.time.checkpoint > 0) {
    o += fmt::format(
        "  checkpoint: {} params x ({} + {}) bytes = {} at {:.0f} GB/s = {:.1f} s every {:.0f} "
        "min = {:.3f} s per step\n",
        human_count(n.total_params), sb.weights, sb.optimizer, gib(e.checkpoint_bytes),
        j.checkpoint_write_bandwidth / 1e9, e.checkpoint_seconds,
        (j.checkpoint_interval_seconds > 0 ? j.checkpoint_interval_seconds
                                           : e.goodput.interval_seconds) / 60,
        e.time.checkpoint);
  }
  if (l.cp > 1) {
    o += fmt::format("  CP: all-gather K, V forward and backward + reduce-scatter dK, dV per layer over "
                     "{} ranks = {:.3f} s, behind the attention: exposed {:.3f} s\n",
                     l.cp, e.cp_comm_raw, e.time.cp);
  }
  if (e.goodput.mtbf_seconds > 0) {
    const Goodput& g = e.goodput;
    o += fmt::format(
        "Failures: {:.3g} per GPU-hour x {} GPUs -> MTBF M = {:.0f} s; checkpoint delta = {:.1f} s; "
        "Daly tau = sqrt(2 delta M)(1 + sqrt(delta/2M)/3 + delta/18M) - delta = {:.0f} s (Young "
        "sqrt(2 delta M) = {:.0f} s); wall = M e^(R/M) (e^((tau+delta)/M) - 1) Ts / tau = {:.1f} "
        "days, goodput {:.1f}%\n",
        j.failures.failures_per_gpu_hour, e.gpus, g.mtbf_seconds, g.checkpoint_seconds,
        g.interval_seconds, young_interval(g.checkpoint_seconds, g.mtbf_seconds),
        g.wall_seconds / 86400, 100 * g.goodput);
  }
  o += fmt::format("\nStep = {:.3f} s; tokens/s = {} / {:.3f} = {}\n", e.step_seconds,
                   grouped(static_cast<double>(j.tokens_per_step())), e.step_seconds,
                   grouped(e.tokens_per_second));
  o += fmt::format("MFU (PaLM) = model FLOPs / (step x GPUs x peak) = {:.4g} / ({:.3f} x {} x {:.4g}) "
                   "= {:.1f}%\n",
                   e.model_flops_per_step, e.step_seconds, e.gpus, c.gpu.peak_flops, 100 * e.mfu);
  o += fmt::format("Train {} tokens = {} steps x {:.3f} s = {:.1f} days; {} GPU-hours x "
                   "${:.2f} = {}\n",
                   human_count(j.tokens), grouped(e.steps), e.step_seconds,
                   e.train_seconds / 86400, human_count(e.gpu_hours), c.price_per_gpu_hour,
                   money(e.cost));
  return o;
}

}  // namespace meshtrain::plan
