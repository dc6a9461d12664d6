#include "meshtrain/cli/plan_command.h"

#include <fmt/format.h>

#include <cstdio>
#include <sstream>

#include "meshtrain/plan/inputs.h"
#include "meshtrain/plan/models.h"
#include "meshtrain/plan/planner.h"
#include "meshtrain/plan/report.h"
#include "meshtrain/train/config.h"
#include "meshtrain/train/memory_check.h"
#include "meshtrain/train/memory_plan.h"
#include "meshtrain/util/error.h"

namespace meshtrain {

void add_plan_options(CLI::App& p, PlanArgs& a) {
  p.add_option("--model", a.model, "Preset: gpt2-124m ... llama3-405b (see docs/plan.md)");
  p.add_option("--config", a.config,
               "A meshtrain TOML run config: prints the engine's predicted memory of every rank "
               "for the run's [parallel] layout on --dp x cp x tp x pp ranks (--json: as JSON), and "
               "plans that model on GPUs when --gpus is given");
  p.add_option("--layers", a.layers, "Dense model: layers (with --hidden --heads --vocab)");
  p.add_option("--hidden", a.hidden, "Dense model: hidden size");
  p.add_option("--heads", a.heads, "Dense model: attention heads");
  p.add_option("--vocab", a.vocab, "Dense model: vocabulary");
  p.add_option("--kv-heads", a.kv_heads, "Dense model: kv heads (grouped-query families)");
  p.add_option("--ffn", a.ffn, "Dense model: MLP width (default 4 x hidden)");
  p.add_option("--family", a.family, "Dense model family")
      ->check(CLI::IsMember(family_names()))->capture_default_str();
  p.add_option("--gpu", a.gpu, "h100-sxm, h800, h200, a100-80gb, a100-40gb")->capture_default_str();
  p.add_option("--gpus", a.gpus,
               "GPU count, a comma list (256,512,1024) or a doubling range (256..16384)");
  p.add_option("--gpus-per-node", a.gpus_per_node)->capture_default_str();
  p.add_option("--peak-tflops", a.peak_tflops, "Override: dense bf16 TFLOP/s per GPU");
  p.add_option("--hbm-gib", a.hbm_gib, "Override: device memory per GPU, GiB");
  p.add_option("--intra-bw", a.intra_bw, "Override: bus bandwidth in a node, GB/s");
  p.add_option("--inter-bw", a.inter_bw, "Override: bus bandwidth between nodes per GPU, GB/s");
  p.add_option("--intra-latency-us", a.intra_latency_us, "Override: per-step latency in a node");
  p.add_option("--inter-latency-us", a.inter_latency_us, "Override: per-step latency between nodes");
  p.add_option("--pcie-bw", a.pcie_bw, "Override: host link GB/s (offload)");
  p.add_option("--price", a.price, "Override: USD per GPU-hour");
  p.add_option("--seq", a.seq, "Sequence length (default: the model's context)");
  p.add_option("--global-batch", a.global_batch, "Sequences per optimizer step");
  p.add_option("--global-batch-tokens", a.global_batch_tokens, "Tokens per optimizer step (16M)");
  p.add_option("--tokens", a.tokens, "Tokens to train on (default 20 x params, Chinchilla)");
  p.add_option("--precision", a.precision)->check(CLI::IsMember({"bf16", "fp32"}))
      ->capture_default_str();
  p.add_flag("--fp8", a.fp8,
             "The blocks' linear GEMMs in FP8 at the GPU's FP8 peak (DeepSeek-V3's recipe; "
             "attention, router, embedding and output stay bf16)");
  p.add_option("--mtp", a.mtp,
               "Multi-token-prediction modules trained with the model, on the last stage "
               "(DeepSeek-V3: 1)");
  p.add_option("--comm-sms", a.comm_sms,
               "SMs the dualpipe schedule's overlapped all-to-alls take from compute")
      ->capture_default_str();
  p.add_option("--optimizer", a.optimizer)->check(CLI::IsMember({"adamw", "sgd"}))
      ->capture_default_str();
  p.add_option("--dropout", a.dropout, "Dropout masks in activations (auto: gpt2 on, llama off)")
      ->check(CLI::IsMember({"auto", "on", "off"}))->capture_default_str();
  p.add_option("--efficiency", a.efficiency,
               "Override the GPU's calibrated GEMM efficiency (fraction of peak large GEMMs reach)");
  p.add_option("--fragmentation", a.fragmentation, "Allocator allowance, fraction of tracked bytes")
      ->capture_default_str();
  p.add_option("--reserve-gib", a.reserve_gib, "CUDA context and library workspaces per GPU")
      ->capture_default_str();
  p.add_option("--ckpt-every-min", a.ckpt_every_min,
               "Blocking checkpoint interval in minutes (0 = none, auto = Young/Daly optimum)")
      ->capture_default_str();
  p.add_option("--failures-per-gpu-hour", a.failures_per_gpu_hour,
               "Interruptions per GPU-hour (default: Llama 3's 419 in 54 days on 16,384 GPUs)");
  p.add_option("--restart-min", a.restart_min, "Minutes to restart after a failure")
      ->capture_default_str();
  p.add_option("--finetune", a.finetune, "Fine-tune instead of pre-train: full, lora, qlora")
      ->check(CLI::IsMember({"none", "full", "lora", "qlora"}))->capture_default_str();
  p.add_option("--lora-rank", a.lora_rank, "LoRA / QLoRA adapter rank")->capture_default_str();
  p.add_option("--lora-targets", a.lora_targets, "Adapted linears: all, or qv (W_q and W_v)")
      ->check(CLI::IsMember({"all", "qv"}))->capture_default_str();
  p.add_option("--attention", a.attention,
               "Attention kernel: flash, or unfused (Megatron-LM before FlashAttention)")
      ->check(CLI::IsMember({"flash", "unfused"}))->capture_default_str();
  p.add_option("--pp-split", a.pp_split,
               "Layers per pipeline stage: balanced (by cost), uniform, or a list (7,8,...,7)")
      ->capture_default_str();
  p.add_option("--ckpt-bw", a.ckpt_bw, "Aggregate checkpoint write bandwidth, GB/s")
      ->capture_default_str();
  p.add_option("--cpu-adam-rate", a.cpu_adam_rate, "Offload: parameters/s the host updates per GPU")
      ->capture_default_str();
  p.add_option("--tp", a.tp, "Fix tensor parallelism");
  p.add_option("--cp", a.cp, "Fix context parallelism (sequence split, all-gathered K/V)");
  p.add_option("--ep", a.ep, "Fix expert parallelism (MoE models: experts split over ep of the dp ranks)");
  p.add_flag("--ep-fold", a.ep_fold,
             "Megatron-Core's MoE parallel folding: ep drawn from tp x cp x dp (expert TP 1), "
             "an ep group spans ep GPUs; the engine draws ep from dp");
  p.add_option("--pp", a.pp, "Fix pipeline parallelism");
  p.add_option("--vpp", a.vpp, "Fix virtual pipeline stages (interleaved schedule)");
  p.add_option("--dp", a.dp, "Fix data parallelism (with --config: the run's dp size, default 1)");
  p.add_option("--zero", a.zero, "Fix the ZeRO stage (0..3; 3 = FSDP)");
  p.add_option("--shard", a.shard,
               "Fix ZeRO-3's shard group: g (hybrid sharding, replicated across groups) or dp "
               "(full sharding, what --zero 3 alone means)");
  p.add_option("--micro-batch", a.micro_batch, "Fix sequences per micro-batch");
  p.add_option("--recompute", a.recompute, "Fix activation recomputation")
      ->check(CLI::IsMember({"none", "selective", "full"}));
  p.add_option("--sp", a.sp, "Fix sequence parallelism")->check(CLI::IsMember({"on", "off"}));
  p.add_option("--offload", a.offload, "Optimizer state on the host")
      ->check(CLI::IsMember({"none", "optimizer"}));
  p.add_option("--schedule", a.schedule,
               "Pipeline schedule (default 1f1b / interleaved; dualpipe: DeepSeek-V3's, "
               "all-to-alls and sends behind the other direction's compute)")
      ->check(CLI::IsMember({"gpipe", "1f1b", "interleaved", "dualpipe"}));
  p.add_option("--rank-by", a.rank_by)->check(CLI::IsMember({"time", "cost"}))
      ->capture_default_str();
  p.add_option("--top", a.top, "Rows in the table")->capture_default_str();
  p.add_option("--max-days", a.max_days,
               "Keep layouts that train the tokens within this many days (with --rank-by cost: "
               "the cheapest cluster that meets the deadline)");
  p.add_option("--measured-step-s", a.measured_step_s,
               "A measured step time of the #1 layout (fix the layout you ran): prints the "
               "compute efficiency that reproduces it");
  p.add_flag("--json", a.json, "Machine-readable output");
  p.add_flag("--explain", a.explain, "Print the formulas of #1 with the numbers substituted");
}

namespace {

using namespace plan;

int64_t whole(const std::string& text, std::string_view option) {
  const double v = parse_count(text, option);
  MESHTRAIN_CHECK(v >= 1 && v == static_cast<double>(static_cast<int64_t>(v)),
                  "plan: {} '{}' is not a positive whole number", option, text);
  return static_cast<int64_t>(v);
}

// "1024", "256,512,1024", or "256..16384" (doubling).
std::vector<int64_t> gpu_counts(const std::string& text) {
  std::vector<int64_t> counts;
  if (const size_t dots = text.find(".."); dots != std::string::npos) {
    const int64_t from = whole(text.substr(0, dots), "--gpus");
    const int64_t to = whole(text.substr(dots + 2), "--gpus");
    MESHTRAIN_CHECK(from <= to, "plan: --gpus range '{}' runs backwards", text);
    for (int64_t n = from; n <= to; n *= 2) counts.push_back(n);
    return counts;
  }
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) counts.push_back(whole(item, "--gpus"));
  MESHTRAIN_CHECK(!counts.empty(), "plan: --gpus '{}' names no GPU count", text);
  return counts;
}

void override_value(const std::string& text, std::string_view option, double scale, double& out) {
  if (!text.empty()) out = parse_count(text, option) * scale;
}

PlanModel resolve_model(const PlanArgs& a, const TrainConfig* run) {
  const bool dense = a.layers || a.hidden || a.heads || a.vocab;
  const int sources = (a.model.empty() ? 0 : 1) + (dense ? 1 : 0) + (run ? 1 : 0);
  MESHTRAIN_CHECK(sources == 1,
                  "plan: give exactly one model: --model NAME, --config FILE, or --layers "
                  "--hidden --heads --vocab");
  if (run) return {a.config, run->model, 0, a.config};
  if (!a.model.empty()) return plan_model(a.model);
  MESHTRAIN_CHECK(a.layers > 0 && a.hidden > 0 && a.heads > 0 && a.vocab > 0,
                  "plan: a dense model needs all of --layers --hidden --heads --vocab > 0");
  ModelConfig c = gpt_dense(a.layers, a.hidden, a.heads, a.vocab, std::max<int64_t>(a.seq, 2048));
  c.family = parse_family(a.family, "plan: --family");
  const Recipe& rc = c.recipe();
  c.tie_embeddings = rc.always_tied;
  if (rc.grouped_query) {
    c.n_kv_heads = a.kv_heads ? a.kv_heads : a.heads;
  } else {
    MESHTRAIN_CHECK(a.kv_heads == 0 || a.kv_heads == a.heads,
                    "plan: --kv-heads needs a family with grouped-query attention ({} has none)",
                    a.family);
  }
  if (a.ffn) c.hidden_dim = a.ffn;
  return {fmt::format("dense-{}L-{}h", a.layers, a.hidden), c, 0, "--layers/--hidden/--heads/--vocab"};
}

}  // namespace

int run_plan(const PlanArgs& a) {
  std::unique_ptr<TrainConfig> run;
  if (!a.config.empty()) run = std::make_unique<TrainConfig>(load_config(a.config));
  PlanModel pm = resolve_model(a, run.get());
  ModelConfig& model = pm.config;

  std::string engine_json;  // --config --json
  if (run) {
    // The run's own layout on dp x cp x tp x pp ranks (--dp, default 1).
    const int dp = a.dp > 0 ? static_cast<int>(a.dp) : 1;
    const ParallelSettings& p = run->parallel;
    const std::vector<RankMemory> ranks = predict_run_memory(*run, dp * p.cp * p.tp * p.pp);
    if (a.json) {
      // With --gpus: {"engine": this, "search": the GPU plan} below.
      engine_json = run_memory_json(a.config, *run, ranks);
      if (a.gpus.empty()) {
        std::fputs(engine_json.c_str(), stdout);
        return 0;
      }
    } else {
      std::fputs(format_run_memory(a.config, *run, ranks).c_str(), stdout);
      for (const RankMemory& r : ranks) {  // what the run would refuse at start
        if (std::optional<std::string> why = offload_budget_refusal(r)) {
          std::fputs(fmt::format("the run would refuse at start: {}\n", *why).c_str(), stdout);
          break;
        }
      }
    }
    if (a.gpus.empty()) return 0;
    if (!a.json) std::fputs("\n", stdout);
  }
  MESHTRAIN_CHECK(!a.gpus.empty(), "plan: --gpus is required (a count, or a comma list)");

  PlanInputs in;
  in.model_name = pm.name;
  Job& job = in.job;
  job.seq = a.seq > 0 ? a.seq : run ? run->train.seq_len : model.max_seq_len;
  if (model.recipe().positions == Positions::learned) {
    MESHTRAIN_CHECK(job.seq <= model.max_seq_len,
                    "plan: --seq {} exceeds the model's {} learned positions", job.seq,
                    model.max_seq_len);
  } else {
    model.max_seq_len = std::max(model.max_seq_len, job.seq);  // RoPE has no table to outgrow
  }
  MESHTRAIN_CHECK(a.global_batch == 0 || a.global_batch_tokens.empty(),
                  "plan: give --global-batch or --global-batch-tokens, not both");
  if (!a.global_batch_tokens.empty()) {
    GlobalBatch gb = parse_global_batch_tokens(a.global_batch_tokens, job.seq);
    job.global_batch = gb.sequences;
    in.batch_note = gb.note;
  } else if (a.global_batch > 0) {
    job.global_batch = a.global_batch;
  } else if (run) {
    job.global_batch = run->train.batch_size;
  }
  MESHTRAIN_CHECK(job.global_batch > 0,
                  "plan: --global-batch (sequences) or --global-batch-tokens is required");
  job.precision = parse_precision(a.precision);
  job.fp8 = a.fp8;
  job.mtp = a.mtp;
  job.comm_sms = a.comm_sms;
  job.optimizer = parse_optimizer(a.optimizer);
  job.dropout = a.dropout == "auto" ? model.recipe().dropout : a.dropout == "on";
  job.compute_efficiency = a.efficiency;
  job.finetune.method = parse_finetune(a.finetune);
  job.finetune.rank = a.lora_rank;
  job.finetune.targets = parse_lora_targets(a.lora_targets);
  job.balance_pipeline = a.pp_split != "uniform";
  if (a.pp_split != "balanced" && a.pp_split != "uniform") {
    std::stringstream list(a.pp_split);
    std::string item;
    while (std::getline(list, item, ',')) job.pipeline_split.push_back(whole(item, "--pp-split"));
  }
  job.attention = parse_attention(a.attention);
  if (a.failures_per_gpu_hour >= 0) job.failures.failures_per_gpu_hour = a.failures_per_gpu_hour;
  job.failures.restart_seconds = a.restart_min * 60;
  job.fragmentation = a.fragmentation;
  job.reserve_bytes = a.reserve_gib * 1024.0 * 1024 * 1024;
  job.checkpoint_interval_seconds =
      a.ckpt_every_min == "auto" ? -1 : parse_count(a.ckpt_every_min, "--ckpt-every-min") * 60;
  job.checkpoint_write_bandwidth = a.ckpt_bw * 1e9;
  job.cpu_adam_params_per_second = a.cpu_adam_rate;
  in.ctx = make_context(model, job);
  job.tokens = a.tokens.empty() ? 20 * in.ctx.counts.total_params : parse_count(a.tokens, "--tokens");
  MESHTRAIN_CHECK(a.gpus_per_node > 0, "plan: --gpus-per-node must be > 0, got {}",
                  a.gpus_per_node);

  SearchOptions& opt = in.options;
  opt.gpu_counts = gpu_counts(a.gpus);
  GpuSpec gpu = gpu_spec(a.gpu);
  override_value(a.peak_tflops, "--peak-tflops", 1e12, gpu.peak_flops);
  override_value(a.hbm_gib, "--hbm-gib", 1024.0 * 1024 * 1024, gpu.hbm_bytes);
  override_value(a.pcie_bw, "--pcie-bw", 1e9, gpu.pcie_bandwidth);
  in.cluster = make_cluster(gpu, opt.gpu_counts.front(), a.gpus_per_node);
  override_value(a.intra_bw, "--intra-bw", 1e9, in.cluster.intra.bus_bandwidth);
  override_value(a.inter_bw, "--inter-bw", 1e9, in.cluster.inter.bus_bandwidth);
  override_value(a.intra_latency_us, "--intra-latency-us", 1e-6, in.cluster.intra.latency);
  override_value(a.inter_latency_us, "--inter-latency-us", 1e-6, in.cluster.inter.latency);
  override_value(a.price, "--price", 1, in.cluster.price_per_gpu_hour);

  FixedChoices& f = opt.fixed;
  if (a.tp) f.tp = a.tp;
  if (a.pp) f.pp = a.pp;
  if (a.vpp) f.vpp = a.vpp;
  if (a.dp) f.dp = a.dp;
  if (a.micro_batch) f.micro_batch = a.micro_batch;
  if (a.cp) f.cp = a.cp;
  if (a.ep) f.ep = a.ep;
  if (a.shard == "dp") {
    f.shard = 0;
  } else if (!a.shard.empty()) {
    f.shard = whole(a.shard, "--shard");
  }
  if (a.zero >= 0) f.zero = a.zero;
  if (!a.recompute.empty()) f.recompute = parse_recompute(a.recompute);
  if (!a.sp.empty()) f.sequence_parallel = a.sp == "on";
  if (!a.offload.empty()) f.offload = parse_offload(a.offload);
  if (!a.schedule.empty()) f.schedule = parse_schedule(a.schedule);
  f.ep_fold = a.ep_fold;
  opt.rank_by = parse_rank_by(a.rank_by);
  opt.top = a.top;
  opt.max_train_seconds = a.max_days * 86400;

  const SearchResult result = search(in.ctx, in.cluster, job, opt);
  std::string calibration;
  if (a.measured_step_s > 0 && !result.ranked.empty()) {
    const Estimate& top = result.ranked.front();
    Cluster cl = in.cluster;
    cl.gpus = top.gpus;
    const double eff = calibrate_efficiency(in.ctx, cl, job, top.layout, a.measured_step_s);
    const bool fixed = f.tp && f.pp && f.zero && f.micro_batch && f.recompute;
    const double was = job.compute_efficiency > 0 ? job.compute_efficiency : cl.gpu.gemm_efficiency;
    calibration = fmt::format(
        "calibration: {} on {} GPUs measured at {:.4g} s/step -> GEMM efficiency {:.3f} (was "
        "{:.3f}); rerun with --efficiency {:.3f}{}\n",
        describe(top.layout), top.gpus, a.measured_step_s, eff, was, eff,
        fixed ? "" : " (this is the search's #1: fix --tp --pp --zero --micro-batch --recompute "
                     "to the layout you measured)");
  }
  if (a.json && !engine_json.empty()) {
    std::fputs(fmt::format("{{\"engine\": {}, \"search\": {}}}\n", engine_json,
                           format_json(in, result))
                   .c_str(),
               stdout);
  } else if (a.json) {
    std::fputs(format_json(in, result).c_str(), stdout);
  } else {
    std::fputs(format_table(in, result).c_str(), stdout);
    if (a.explain && !result.ranked.empty()) {
      std::fputs(("\n" + format_explain(in, result.ranked.front())).c_str(), stdout);
    }
    if (!calibration.empty()) std::fputs(("\n" + calibration).c_str(), stdout);
  }
  MESHTRAIN_CHECK(!result.ranked.empty() || result.fits == 0,
                  "plan: no layout trains {} tokens within {} days (the families above say why)",
                  human_count(job.tokens), a.max_days);
  MESHTRAIN_CHECK(!result.ranked.empty(),
                  "plan: no layout fits in {:.1f} GiB of HBM (the families above say why)",
                  in.cluster.gpu.hbm_bytes / (1024.0 * 1024 * 1024));
  return 0;
}

}  // namespace meshtrain
