#include "meshtrain/plan/report.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>

#include "meshtrain/plan/collectives.h"
#include "meshtrain/plan/pipeline_split.h"

namespace meshtrain::plan {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

std::string duration(double seconds) {
  if (seconds >= 86400) return fmt::format("{:.1f} d", seconds / 86400);
  if (seconds >= 3600) return fmt::format("{:.1f} h", seconds / 3600);
  return fmt::format("{:.0f} s", seconds);
}

std::string limit(const Estimate& e) {
  std::string s = e.bottleneck == "compute"
                      ? "compute"
                      : fmt::format("{} {:.0f}%", e.bottleneck, 100 * e.bottleneck_share);
  if (e.hbm_fraction >= 0.9) s += fmt::format(", HBM {:.0f}%", 100 * e.hbm_fraction);
  return s;
}

// "params 131.5 GiB, activations 16.3 GiB": the two biggest device categories.
std::string largest_categories(const MemoryBreakdown& m) {
  std::vector<std::pair<std::string, double>> cats = categories(m);
  std::erase_if(cats, [](const auto& c) { return c.first == "offloaded"; });
  std::sort(cats.begin(), cats.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
  return fmt::format("{} {}, {} {}", cats[0].first, gib(cats[0].second), cats[1].first,
                     gib(cats[1].second));
}

std::string model_line(const PlanInputs& in) {
  const ModelConfig& m = in.ctx.model;
  return fmt::format(
      "model    {}: {} params, {} layers, hidden {}, {} heads / {} kv, MLP {}, vocab {}, {}",
      in.model_name, human_count(in.ctx.counts.total_params), m.n_layers, m.dim, m.n_heads,
      m.n_kv_heads, m.hidden_dim, m.vocab_size, m.tie_embeddings ? "tied output" : "untied output");
}

std::string cluster_line(const PlanInputs& in, int64_t gpus) {
  const Cluster& c = in.cluster;
  return fmt::format(
      "cluster  {} x {} ({} per node): {:.1f} TFLOP/s bf16 dense, HBM {:.1f} GiB; bus bandwidth "
      "{:.0f} GB/s in a node, {:.0f} GB/s per GPU between nodes; ${:.2f}/GPU-hour",
      gpus, c.gpu.name, c.gpus_per_node, c.gpu.peak_flops / 1e12, c.gpu.hbm_bytes / kGiB,
      c.intra.bus_bandwidth / 1e9, c.inter.bus_bandwidth / 1e9, c.price_per_gpu_hour);
}

std::string job_line(const PlanInputs& in) {
  const Job& j = in.job;
  return fmt::format(
      "job      seq {}, global batch {} sequences = {} tokens{}, {} tokens = {} steps, {} + {}{}, "
      "GEMM efficiency {:.2f} ({}){}",
      j.seq, grouped(static_cast<double>(j.global_batch)),
      grouped(static_cast<double>(j.tokens_per_step())),
      in.batch_note.empty() ? "" : " (" + in.batch_note + ")", human_count(j.tokens),
      grouped(std::ceil(j.tokens / static_cast<double>(j.tokens_per_step()))),
      std::string(precision_name(j.precision)) + (j.fp8 ? " (FP8 GEMMs)" : "") +
          (j.mtp > 0 ? fmt::format(" + {} MTP", j.mtp) : std::string()),
      optimizer_name(j.optimizer),
      j.finetune.method == FinetuneMethod::none
          ? ""
          : j.finetune.adapters()
              ? fmt::format(", fine-tune {} rank {} on {} linears", finetune_name(j.finetune.method),
                            j.finetune.rank, lora_targets_name(j.finetune.targets))
              : ", full fine-tune",
      effective_gpu(in.cluster, j).gemm_efficiency,
      j.compute_efficiency > 0 ? "--efficiency" : in.cluster.gpu.compute_source,
      j.checkpoint_interval_seconds > 0
          ? fmt::format(", checkpoint every {:.0f} min at {:.0f} GB/s",
                        j.checkpoint_interval_seconds / 60, j.checkpoint_write_bandwidth / 1e9)
      : j.checkpoint_interval_seconds < 0
          ? fmt::format(", checkpoint at the Young/Daly interval at {:.0f} GB/s",
                        j.checkpoint_write_bandwidth / 1e9)
          : "");
}

}  // namespace

std::string human_count(double n) {
  const double a = std::fabs(n);
  if (a >= 1e12) return fmt::format("{:.3g}T", n / 1e12);
  if (a >= 1e9) return fmt::format("{:.3g}B", n / 1e9);
  if (a >= 1e6) return fmt::format("{:.3g}M", n / 1e6);
  if (a >= 1e3) return fmt::format("{:.3g}K", n / 1e3);
  return fmt::format("{:.3g}", n);
}

std::string money(double usd) {
  if (usd >= 1e6) return fmt::format("${:.2f}M", usd / 1e6);
  if (usd >= 1e3) return fmt::format("${:.1f}K", usd / 1e3);
  return fmt::format("${:.0f}", usd);
}

std::string grouped(double n) {
  std::string digits = fmt::format("{:.0f}", n), out;
  const size_t lead = digits.size() % 3 == 0 ? 3 : digits.size() % 3;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && i >= lead && (i - lead) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

std::string gib(double bytes) { return fmt::format("{:.2f} GiB", bytes / kGiB); }

std::string format_table(const PlanInputs& in, const SearchResult& r) {
  std::string out;
  out += model_line(in) + "\n";
  out += cluster_line(in, in.options.gpu_counts.front()) + "\n";
  out += job_line(in) + "\n";
  out += fmt::format(
      "search   {} layouts in {:.3f} s: {} can run, {} fit in HBM{}{}; ranked by {}, best per "
      "(gpus, tp, cp{}, pp, v, zero)\n\n",
      r.evaluated, r.seconds, r.valid, r.fits,
      in.options.max_train_seconds > 0
          ? fmt::format(", {} of them train within {:.0f} days", r.fits - r.too_slow,
                        in.options.max_train_seconds / 86400)
          : "",
      r.offload_retried ? " (nothing fit on the GPU alone: optimizer offload searched too)" : "",
      in.options.rank_by == RankBy::time ? "step time" : "cost",
      in.ctx.model.moe.enabled() ? ", ep" : "");
  if (r.ranked.empty()) {
    out += r.fits > 0 ? "nothing trains within the deadline: see the families below (more GPUs, "
                        "a later --max-days)\n"
                      : "nothing fits, not even with the optimizer state on the host: see the "
                        "families below (more GPUs, a bigger GPU, --fragmentation, --reserve-gib)\n";
  } else {
    const bool many_counts = in.options.gpu_counts.size() > 1;
    // MoE models: an ep column after cp.
    const bool moe = in.ctx.model.moe.enabled();
    const std::string ep_head = moe ? fmt::format(" {:>3}", "ep") : "";
    const std::string ep_blank = moe ? std::string(4, ' ') : "";
    out += fmt::format(
        "{:>2} {}{:>3} {:>3} {:>3} {:>2} {:>5} {:>5} {:>2} {:<4}|{:>6} {:>4} {:>5} {:>5} {:>5} {:>5} "
        "{:>5} |{:>7} {:>9} {:>5} {:>8} {:>9}  {}\n",
        "#", many_counts ? fmt::format("{:>6} ", "gpus") : "", "tp", fmt::format("{:>3}", "cp") + ep_head, "pp", "v", "dp", "zero", "mb",
        "rc", "GiB", "HBM", "param", "grad", "optim", "act", "other", "step s", "tok/s/GPU",
        "MFU", "train", "cost", "limit");
    out += fmt::format(
        "{:>2} {}{:>3} {:>3} {:>3} {:>2} {:>5} {:>5} {:>2} {:<4}|{:>6} {:>4} {:>5} {:>5} {:>5} {:>5} "
        "{:>5} |{:>7} {:>9} {:>5} {:>8} {:>9}\n",
        "", many_counts ? std::string(7, ' ') : "", "", "   " + ep_blank, "", "", "", "", "", "", "", "", "GiB",
        "GiB", "GiB", "GiB", "GiB", "", "", "", "", "");
    int rank = 0;
    for (const Estimate& e : r.ranked) {
      const Layout& l = e.layout;
      const MemoryBreakdown& m = e.memory;
      const double other = m.workspace + m.comm + m.fragmentation;
      const char* rc = l.recompute == Recompute::none        ? "none"
                       : l.recompute == Recompute::selective ? "sel"
                                                             : "full";
      out += fmt::format(
          "{:>2} {}{:>3} {:>3} {:>3} {:>2} {:>5} {:>5} {:>2} {:<4}|{:>6.1f} {:>3.0f}% {:>5.1f} {:>5.1f} "
          "{:>5.1f} {:>5.1f} {:>5.1f} |{:>7.2f} {:>9.0f} {:>4.1f}% {:>8} {:>9}  {}\n",
          ++rank, many_counts ? fmt::format("{:>6} ", e.gpus) : "", l.tp,
          fmt::format("{:>3}", l.cp) + (moe ? fmt::format(" {:>3}", l.ep) : ""), l.pp, l.vpp, l.dp,
          zero_label(l), l.micro_batch, rc, m.device_total() / kGiB, 100 * e.hbm_fraction,
          m.params / kGiB, m.grads / kGiB, m.optimizer / kGiB, m.activations / kGiB,
          other / kGiB, e.step_seconds, e.tokens_per_second / static_cast<double>(e.gpus),
          100 * e.mfu, duration(e.train_seconds), money(e.cost), limit(e));
    }
    const Estimate& b = r.ranked.front();
    const StepTime& t = b.time;
    const double s = b.step_seconds;
    out += fmt::format(
        "\n#1 step {:.2f} s = compute {:.2f} + recompute {:.2f} + bubble {:.2f} + TP {:.2f}{} + DP "
        "{:.2f} (of {:.2f}, rest overlapped) + PP {:.2f} + optimizer {:.2f}{}{}  ({:.0f}% compute); "
        "{} GPU-hours\n",
        s, t.compute, t.recompute, t.bubble, t.tp,
        (b.layout.cp > 1 ? fmt::format(" + CP {:.2f} (of {:.2f})", t.cp, b.cp_comm_raw)
                         : std::string()) +
            (b.layout.ep > 1 ? fmt::format(" + EP all-to-all {:.2f} (of {:.2f}; {} sent per rank)",
                                           t.ep, b.ep_comm_raw, gib(b.ep_bytes_per_step))
                             : std::string()),
        t.dp, b.dp_comm_raw, t.pp, t.optimizer,
        t.offload > 0 ? fmt::format(" + offload {:.2f}", t.offload) : "",
        t.checkpoint > 0 ? fmt::format(" + checkpoint {:.2f}", t.checkpoint) : "",
        100 * t.compute / s,
        human_count(b.gpu_hours));
    out += fmt::format(
        "#1 memory on the {} stage: params {} + grads {} + optimizer {} + activations {} + "
        "workspace {} + comm {} + fragmentation {} = {}{}\n",
        b.memory_stage, gib(b.memory.params), gib(b.memory.grads), gib(b.memory.optimizer),
        gib(b.memory.activations), gib(b.memory.workspace), gib(b.memory.comm),
        gib(b.memory.fragmentation), gib(b.memory.device_total()),
        b.memory.offloaded > 0 ? fmt::format(" (+ {} on the host)", gib(b.memory.offloaded)) : "");
    if (b.layout.pp > 1) {
      out += fmt::format("#1 pipeline: layers per stage {} ({})\n",
                         fmt::join(stage_layers(b.split, b.layout.pp), " "),
                         !in.job.pipeline_split.empty() ? "given by --pp-split"
                         : in.job.balance_pipeline      ? "balanced by cost: embedding, blocks, head + loss"
                                                        : "uniform");
    }
    const Goodput& g = b.goodput;
    if (g.mtbf_seconds > 0) {
      out += fmt::format(
          "#1 failures: MTBF {:.1f} h on {} GPUs; checkpoint {} in {:.0f} s every {:.0f} min{}; "
          "~{:.0f} interruptions losing {:.0f} min each; goodput {:.1f}%: {} wall, "
          "{} GPU-hours, {}\n",
          g.mtbf_seconds / 3600, b.gpus, gib(b.checkpoint_bytes), g.checkpoint_seconds,
          g.interval_seconds / 60, in.job.checkpoint_interval_seconds < 0 ? " (Young/Daly)" : "",
          g.failures, g.lost_per_failure / 60, 100 * g.goodput,
          duration(g.wall_seconds), human_count(b.wall_gpu_hours), money(b.wall_cost));
    }
  }

  out += "\nfamilies (rc: activation recomputation; zero 3/g: ZeRO-3 sharded in groups of g DP "
         "ranks, replicated across; other = workspace + comm + fragmentation):\n";
  const Estimate* top = r.ranked.empty() ? nullptr : &r.ranked.front();
  for (const FamilyReport& f : r.families) {
    std::string line;
    if (f.valid == 0) {
      line = fmt::format("cannot run: {}", f.reason);
    } else if (f.fits == 0) {
      const Estimate& s = *f.smallest;
      line = fmt::format("rejected: none of {} fits; the smallest ({}) needs {} on the {} stage "
                         "({}) > {:.1f} GiB HBM",
                         f.valid, describe(s.layout), gib(s.memory.device_total()),
                         s.memory_stage, largest_categories(s.memory),
                         in.cluster.gpu.hbm_bytes / kGiB);
    } else if (!f.best) {
      const Estimate& s = *f.fastest_too_slow;
      line = fmt::format("too slow: {} fit, but the fastest ({}) takes {} > the {:.0f}-day deadline",
                         f.fits, describe(s.layout), duration(s.train_seconds),
                         in.options.max_train_seconds / 86400);
    } else {
      const Estimate& best = *f.best;
      const bool is_top = top && describe(best.layout) == describe(top->layout) &&
                          best.gpus == top->gpus;
      line = is_top ? fmt::format("best overall ({} of {} fit)", f.fits, f.valid)
                    : fmt::format("{} of {} fit; best {} is {:.2f}x the #1 step time ({}: {})",
                                  f.fits, f.valid, describe(best.layout),
                                  best.step_seconds / top->step_seconds, limit(best),
                                  fmt::format("{:.1f}% MFU", 100 * best.mfu));
    }
    out += fmt::format("  {:<36} {}\n", f.family, line);
  }
  out += "\nassumptions: docs/plan.md (efficiency, link efficiency 0.8, fragmentation, reserve); "
         "--explain shows the arithmetic of #1\n";
  return out;
}

std::string format_json(const PlanInputs& in, const SearchResult& r) {
  using nlohmann::json;
  const ModelConfig& m = in.ctx.model;
  json out;
  out["model"] = {{"name", in.model_name},        {"params", in.ctx.counts.total_params},
                  {"layers", m.n_layers},         {"hidden", m.dim},
                  {"heads", m.n_heads},           {"kv_heads", m.n_kv_heads},
                  {"ffn", m.hidden_dim},          {"vocab", m.vocab_size},
                  {"tied", m.tie_embeddings},     {"family", std::string(family_name(m.family))},
                  {"flops_per_token", in.ctx.model_flops_per_token}};
  const Cluster& c = in.cluster;
  out["cluster"] = {{"gpu", c.gpu.name},
                    {"gpus", in.options.gpu_counts},
                    {"gpus_per_node", c.gpus_per_node},
                    {"peak_flops", c.gpu.peak_flops},
                    {"hbm_bytes", c.gpu.hbm_bytes},
                    {"intra_bus_bandwidth", c.intra.bus_bandwidth},
                    {"inter_bus_bandwidth", c.inter.bus_bandwidth},
                    {"intra_latency", c.intra.latency},
                    {"inter_latency", c.inter.latency},
                    {"price_per_gpu_hour", c.price_per_gpu_hour}};
  const Job& j = in.job;
  out["job"] = {{"seq", j.seq},
                {"global_batch", j.global_batch},
                {"tokens_per_step", j.tokens_per_step()},
                {"tokens", j.tokens},
                {"precision", std::string(precision_name(j.precision))},
                {"fp8_gemms", j.fp8},
                {"mtp", j.mtp},
                {"optimizer", std::string(optimizer_name(j.optimizer))},
                {"gemm_efficiency", effective_gpu(in.cluster, j).gemm_efficiency},
                {"finetune", std::string(finetune_name(j.finetune.method))},
                {"lora_rank", j.finetune.rank},
                {"failures_per_gpu_hour", j.failures.failures_per_gpu_hour},
                {"restart_seconds", j.failures.restart_seconds},
                {"fragmentation", j.fragmentation},
                {"checkpoint_interval_seconds", j.checkpoint_interval_seconds},
                {"checkpoint_write_bandwidth", j.checkpoint_write_bandwidth}};
  out["search"] = {{"evaluated", r.evaluated}, {"valid", r.valid}, {"fits", r.fits},
                   {"too_slow", r.too_slow}, {"max_train_seconds", in.options.max_train_seconds},
                   {"offload_retried", r.offload_retried}, {"seconds", r.seconds}};
  json ranked = json::array();
  for (const Estimate& e : r.ranked) {
    const Layout& l = e.layout;
    json mem = json::object();
    for (const auto& [name, bytes] : categories(e.memory)) mem[name] = bytes;
    mem["device_total"] = e.memory.device_total();
    mem["hbm_fraction"] = e.hbm_fraction;
    mem["stage"] = e.memory_stage;
    ranked.push_back(
        {{"gpus", e.gpus},
         {"layout",
          {{"tp", l.tp}, {"cp", l.cp}, {"ep", l.ep}, {"ep_fold", l.ep_fold}, {"pp", l.pp},
           {"vpp", l.vpp}, {"dp", l.dp},
           {"zero", l.zero},
           {"zero_shard_group", l.shards()},
           {"micro_batch", l.micro_batch}, {"microbatches", e.microbatches},
           {"recompute", std::string(recompute_name(l.recompute))},
           {"sequence_parallel", l.sequence_parallel},
           {"offload", std::string(offload_name(l.offload))},
           {"schedule", std::string(schedule_name(l.pp == 1 ? Schedule::one_f_one_b : l.schedule))}}},
         {"memory_bytes", mem},
         {"pipeline", {{"layers_per_chunk", e.split}, {"stage_seconds", e.stage_seconds}}},
         {"trainable_params", e.trainable_params},
         {"failures",
          {{"mtbf_seconds", e.goodput.mtbf_seconds},
           {"checkpoint_interval_seconds", e.goodput.interval_seconds},
           {"checkpoint_seconds", e.checkpoint_seconds},
           {"checkpoint_bytes", e.checkpoint_bytes},
           {"expected_failures", e.goodput.failures},
           {"lost_seconds_per_failure", e.goodput.lost_per_failure},
           {"goodput", e.goodput.goodput},
           {"wall_seconds", e.goodput.wall_seconds},
           {"wall_gpu_hours", e.wall_gpu_hours},
           {"wall_cost_usd", e.wall_cost}}},
         {"time_seconds",
          {{"compute", e.time.compute}, {"recompute", e.time.recompute},
           {"bubble", e.time.bubble}, {"tp", e.time.tp}, {"cp", e.time.cp},
           {"cp_raw", e.cp_comm_raw}, {"dp", e.time.dp},
           {"dp_raw", e.dp_comm_raw}, {"pp", e.time.pp}, {"ep", e.time.ep},
           {"ep_bytes", e.ep_bytes_per_step}, {"ep_raw", e.ep_comm_raw}, {"offload", e.time.offload},
           {"optimizer", e.time.optimizer}, {"checkpoint", e.time.checkpoint},
           {"step", e.step_seconds}}},
         {"tokens_per_second", e.tokens_per_second},
         {"mfu", e.mfu},
         {"hfu", e.hardware_flops_per_step / (e.step_seconds * static_cast<double>(e.gpus) *
                                              in.cluster.gpu.peak_flops)},
         {"train_seconds", e.train_seconds},
         {"gpu_hours", e.gpu_hours},
         {"cost_usd", e.cost},
         {"bottleneck", e.bottleneck},
         {"bottleneck_share", e.bottleneck_share}});
  }
  out["ranked"] = ranked;
  json families = json::array();
  for (const FamilyReport& f : r.families) {
    json fam = {{"family", f.family}, {"valid", f.valid}, {"fits", f.fits},
                {"too_slow", f.too_slow}};
    if (!f.reason.empty()) fam["reason"] = f.reason;
    if (f.best) {
      fam["best"] = describe(f.best->layout);
      fam["best_step_seconds"] = f.best->step_seconds;
    }
    if (f.fits == 0 && f.smallest) {
      fam["smallest"] = describe(f.smallest->layout);
      fam["smallest_bytes"] = f.smallest->memory.device_total();
    }
    families.push_back(fam);
  }
  out["families"] = families;
  return out.dump(2) + "\n";
}

}  // namespace meshtrain::plan
