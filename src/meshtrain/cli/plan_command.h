// `meshtrain plan`: argument parsing for the planner (plan/), and the glue that
// reads a training run's TOML config (train/) for --config.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>

namespace meshtrain {

struct PlanArgs {
  std::string model, config, family = "gpt2";
  int64_t layers = 0, hidden = 0, heads = 0, kv_heads = 0, ffn = 0, vocab = 0;
  std::string gpu = "h100-sxm", gpus;
  int64_t gpus_per_node = 8;
  // Overrides of the catalog ("" = the catalog's value).
  std::string peak_tflops, hbm_gib, intra_bw, inter_bw, intra_latency_us, inter_latency_us,
      pcie_bw, price;
  int64_t seq = 0, global_batch = 0;
  std::string global_batch_tokens, tokens;
  std::string precision = "bf16", optimizer = "adamw", dropout = "auto";
  bool fp8 = false;
  int64_t mtp = 0, comm_sms = 20;
  double efficiency = 0, fragmentation = 0.10, reserve_gib = 1.0;  // 0 = the GPU's curve
  std::string ckpt_every_min = "auto";  // minutes, 0 = none, auto = Daly's optimum
  double ckpt_bw = 100, cpu_adam_rate = 1e9;
  double failures_per_gpu_hour = -1, restart_min = 10;  // -1 = Llama 3's rate
  std::string finetune = "none", lora_targets = "all", pp_split = "balanced", attention = "flash";
  int64_t lora_rank = 16;
  // Fixed choices (0 / -1 / "" = searched).
  int64_t tp = 0, cp = 0, ep = 0, pp = 0, vpp = 0, dp = 0, micro_batch = 0;
  std::string shard;  // a group size, or "dp" (full sharding)
  int zero = -1;
  std::string recompute, sp, offload, schedule;
  bool ep_fold = false;  // --ep-fold: Megatron's MoE parallel folding
  std::string rank_by = "time";
  double max_days = 0;
  double measured_step_s = 0;  // calibrate --efficiency from a measured step of #1
  int top = 10;
  bool json = false, explain = false;
};

void add_plan_options(CLI::App& plan, PlanArgs& args);
int run_plan(const PlanArgs& args);

}  // namespace meshtrain
