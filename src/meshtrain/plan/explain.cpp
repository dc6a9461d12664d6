// --explain: the arithmetic behind one estimate, each formula with its numbers.
#include <fmt/format.h>

#include <algorithm>

#include "meshtrain/plan/collectives.h"
#include "meshtrain/plan/compute.h"
#include "meshtrain/plan/pipeline_split.h"
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

  const ActivationShape shape = activation_shape(ctx, j, l);
  const double per_layer = layer_activation_bytes(shape);
  const double s = static_cast<double>(j.seq), b = static_cast<double>(l.micro_batch);
  const double h = static_cast<double>(m.dim);
  const AttentionShape at = attention_shape(m);
  const double f_width = static_cast<double>(shape.model.hidden_dim);
  o += "Activations (Korthikanti et al. 2022, section 4, generalised to GQA / MLA / SwiGLU):\n";
  o += fmt::format("  s {} b {} h {} a {} q|k|v|o widths {}|{}|{}|{} MLP {} tp {}{}, recompute {}, "
                   "dropout {}\n",
                   j.seq, l.micro_batch, m.dim, m.n_heads, at.qk, at.k, at.v, at.values(), f_width,
                   l.tp, l.sequence_parallel ? " (sequence parallel)" : "",
                   recompute_name(l.recompute), j.dropout ? "on" : "off");
  if (l.recompute == Recompute::full) {
    o += fmt::format("  per layer = {} s b h{} = {}\n", e_bytes, l.sequence_parallel ? " / t" : "",
                     gib(per_layer));
  } else {
    // Bytes per sbh: e (q + k + v) and q_lin (o + MLP values x f), split by tp;
    // the norm inputs (2e) and the attention and MLP inputs (2 q_lin) whole;
    // MLA's latents never split.
    const double lin = shape.linear_input_bytes > 0 ? shape.linear_input_bytes : e_bytes;
    const double qkv = at.qk + at.k + at.v -
                       (l.recompute == Recompute::selective ? at.from_latent : 0);
    const double mlp = m.recipe().feed_forward == FeedForward::swiglu
                           ? (l.recompute == Recompute::selective ? 2 : 3)
                           : 2;
    o += fmt::format(
        "  per layer = sbh x [({}{}){} + ({:.4g} + {:.4g} + {}x{}x{:.3g}) / t{}{}] = {} x {:.4g} "
        "= {}\n",
        2 * e_bytes + 2 * lin, j.dropout ? " + 2 masks" : "", l.sequence_parallel ? " / t" : "",
        e_bytes * qkv / h, lin * at.values() / h, lin, mlp, f_width / h,
        at.latent > 0 ? fmt::format(" + {:.3g}", e_bytes * at.latent / h) : "",
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
  const std::string rematerialised =
      l.recompute == Recompute::full ? " + one rematerialised layer" : "";
  if (sched == Schedule::dualpipe) {
    const int64_t mirror = stage_layers(e.split, l.pp)[static_cast<size_t>(l.pp - 1 - stage)];
    o += fmt::format(
        "  activations = ({} x {} layers of stage {} + {} x {} of its mirror stage {}) x {} + "
        "embedding / logits ends{} = {}\n\n",
        std::min(l.pp - stage, e.microbatches), e.memory_stage_layers, stage,
        std::min(stage + 1, e.microbatches), mirror, l.pp - 1 - stage, gib(per_layer),
        rematerialised, gib(e.memory.activations));
  } else {
    o += fmt::format("  activations = {:.4g} x {} layers x {} + embedding / logits ends{} = {}\n\n",
                     inflight, e.memory_stage_layers, gib(per_layer), rematerialised,
                     gib(e.memory.activations));
  }
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
  const GpuSpec gpu = layout_gpu(c, j, l);
  const ComputeShape ops_shape = compute_shape(j, l);
  o += fmt::format(
      "\nCompute (roofline per op, one micro-batch of {} tokens{} on one rank; {}: GEMMs at {:.2f} "
      "of {:.4g} FLOP/s or HBM {:.0f} GB/s x {:.2f}, + {:.0f} us per kernel; flash attention at "
      "{:.2f} of peak{}{}):\n",
      j.seq * l.micro_batch, l.cp > 1 ? fmt::format(" / cp {}", l.cp) : "", gpu.name,
      gpu.gemm_efficiency, gpu.peak_flops, gpu.hbm_bandwidth / 1e9, gpu.memory_efficiency,
      gpu.kernel_overhead_seconds * 1e6, gpu.attention_efficiency,
      j.fp8 ? fmt::format("; the blocks' GEMMs in FP8 at {:.4g} FLOP/s (their 'of peak' is "
                          "against the 16-bit peak)",
                          gpu.fp8_peak_flops)
            : "",
      gpu.peak_flops < c.gpu.peak_flops
          ? fmt::format("; peaks of the {} of {} SMs the overlapped all-to-alls leave",
                        gpu.sms - j.comm_sms, gpu.sms)
          : "");
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
  const bool dual = sched == Schedule::dualpipe;
  o += fmt::format(
      "  pipeline = {} = {} x {:.3f} + ... = {:.3f} s: compute {:.3f} + recompute {:.3f} + bubble "
      "and imbalance {:.3f}{}\n\n",
      dual ? "m x t + (p/2 - 1)(F + 2B - 3W), t the slower rank's mean of its two stages "
             "(DeepSeek-V3 table 2)"
           : "m x max(t) + (sum(t) - max(t)) / v",
      e.microbatches, dual ? dualpipe_pace(e.stage_seconds)
                           : *std::max_element(e.stage_seconds.begin(), e.stage_seconds.end()),
      e.time.compute + e.time.recompute + e.time.bubble, e.time.compute, e.time.recompute,
      e.time.bubble,
      dual ? "" : fmt::format(" (uniform-stage fraction (p-1)/(v m) = {:.4f})",
                              bubble_fraction(l.pp, l.vpp, e.microbatches)));
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
        "{} B / {:.0f} GB/s){}: exposed {:.3f} s\n",
        e_bytes, e.microbatches, l.vpp, l.pp, link.latency * 1e6, human_count(message),
        link.bus_bandwidth / 1e9,
        dual ? ", each behind a forward chunk of the other direction" : ", not overlapped",
        e.time.pp);
  }
  if (l.ep > 1) {
    o += fmt::format(
        "  EP: per MoE layer and micro-batch, dispatch + combine forward and their gradients{} "
        "(docs/plan.md): {} per rank per step in {:.3f} s{}; exposed {:.3f} s\n",
        l.recompute == Recompute::full ? " (+ the forward pair again)" : "",
        gib(e.ep_bytes_per_step), e.ep_comm_raw,
        l.schedule == Schedule::dualpipe && l.pp > 1
            ? " (DualPipe: behind the other direction's compute)"
            : " (not overlapped)",
        e.time.ep);
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
