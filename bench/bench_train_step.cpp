// meshtrain side of the training benchmark (bench/train_vs_torch.sh runs it
// next to bench/torch_train.py): the same Llama shape, batch, sequence and
// threads; random tokens; AdamW step included. Prints one JSON line.
// --recompute (bench/recompute.sh): activation checkpointing, with the
// tracker's activation peak and the planner's prediction of it.
// --experts (bench/moe_vs_dense.sh): mixture-of-experts feed-forwards (every
// layer, top --top-k of --experts of width --moe-hidden); MFU counts the
// active parameters.
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cctype>
#include <map>
#include <chrono>
#include <ctime>
#include <random>
#include <vector>

#include "meshtrain/backend/cpu/cpu_backend.h"
#include "meshtrain/model/model.h"
#include "meshtrain/optim/adamw.h"
#include "meshtrain/optim/clip.h"
#include "meshtrain/plan/memory.h"
#include "meshtrain/util/trace.h"

namespace {

// Mean milliseconds per step of each traced span name (a layer's index
// dropped), inclusive of the spans nested in it, largest first.
void print_breakdown(int steps) {
  using namespace meshtrain;
  trace::stop();
  std::map<std::string, double> ms;
  for (const auto& thread : trace::take())
    for (const auto& event : thread.events) {
      if (event.ph != 'X') continue;
      std::string name = event.name;
      while (!name.empty() && (std::isdigit(static_cast<unsigned char>(name.back())) || name.back() == ' '))
        name.pop_back();
      ms[fmt::format("{}: {}", event.cat, name)] += static_cast<double>(event.dur_ns) / 1e6 / steps;
    }
  std::vector<std::pair<std::string, double>> rows(ms.begin(), ms.end());
  std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
  for (const auto& [name, value] : rows) fmt::print(stderr, "{:>10.1f} ms  {}\n", value, name);
}

}  // namespace

int main(int argc, char** argv) {
  using namespace meshtrain;
  CLI::App app{"meshtrain training-step benchmark"};
  std::string precision_name = "fp32", recompute_name = "none";
  int64_t recompute_layers = 0;
  int threads = 2, steps = 6;
  int64_t batch = 8, seq = 256;
  double peak = 0;
  ModelConfig config;
  config.family = Family::llama;
  config.dim = 512, config.n_layers = 8, config.n_heads = 8, config.n_kv_heads = 8;
  config.hidden_dim = 1536, config.vocab_size = 50257, config.max_seq_len = 256;
  bool tied = true;
  app.add_option("--precision", precision_name)->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  app.add_option("--threads", threads);
  app.add_option("--steps", steps);
  app.add_option("--dim", config.dim);
  app.add_option("--layers", config.n_layers);
  app.add_option("--heads", config.n_heads);
  app.add_option("--kv-heads", config.n_kv_heads);
  app.add_option("--hidden", config.hidden_dim);
  app.add_option("--vocab", config.vocab_size);
  app.add_option("--seq", seq);
  app.add_option("--batch", batch);
  app.add_option("--tied", tied);
  app.add_option("--peak-flops", peak, "matmul peak; 0 = measure");
  app.add_option("--recompute", recompute_name)->check(CLI::IsMember({"none", "selective", "full"}));
  app.add_option("--recompute-layers", recompute_layers);
  app.add_option("--experts", config.moe.experts, "MoE: routed experts per layer (0: dense)");
  app.add_option("--top-k", config.moe.top_k);
  app.add_option("--moe-hidden", config.moe.hidden_dim);
  app.add_option("--aux-loss", config.moe.aux_loss);
  bool breakdown = false;
  app.add_flag("--breakdown", breakdown,
               "print the timed steps' mean milliseconds per traced span name to stderr");
  CLI11_PARSE(app, argc, argv);
  config.max_seq_len = seq;
  config.tie_embeddings = tied;
  config.validate();

  Precision precision = parse_precision(precision_name);
  MemoryTracker tracker;
  cpu::CpuBackend ctx(threads, tracker);
  if (peak <= 0) peak = ctx.measure_matmul_peak_flops(compute_dtype(precision), 2.0);
  Model model(config, precision, ctx);
  const RecomputePolicy recompute{parse_recompute(recompute_name), recompute_layers};
  model.set_recompute(recompute);
  model.init_weights(1);
  AdamW optimizer(model, AdamWConfig{});

  std::mt19937 rng(0);
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(config.vocab_size - 1));
  std::vector<int32_t> data(static_cast<size_t>(batch * (seq + 1)));
  for (auto& t : data) t = token(rng);
  std::vector<int32_t> inputs, targets;
  for (int64_t b = 0; b < batch; ++b) {
    auto row = data.begin() + b * (seq + 1);
    inputs.insert(inputs.end(), row, row + seq);
    targets.insert(targets.end(), row + 1, row + seq + 1);
  }

  // Process CPU time too: on a shared machine other jobs stretch the wall
  // time but not (much) the CPU time this process spends (bench/recompute.sh).
  auto cpu_ms = [] {
    timespec t{};
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return static_cast<double>(t.tv_sec) * 1e3 + static_cast<double>(t.tv_nsec) / 1e6;
  };
  std::vector<double> times, cpu_times;
  double loss = 0;
  const int64_t tokens = batch * seq;
  for (int s = 0; s <= steps; ++s) {
    if (breakdown && s == 1) trace::start(trace::Clock::now());
    auto t0 = std::chrono::steady_clock::now();
    const double c0 = cpu_ms();
    if (s == 0) model.zero_grads();  // then each update leaves them cleared, as in training
    loss = model.forward_backward(inputs.data(), targets.data(), batch, seq,
                                  1.0f / static_cast<float>(tokens)) / static_cast<double>(tokens);
    float scale = 1;
    {
      trace::Span span("optimizer", "gradient norm");
      scale = clip_factor(global_grad_norm(model), 1.0f);
    }
    {
      trace::Span span("optimizer", "adamw");
      optimizer.step(3e-4f, scale, /*clear_grads=*/true);
    }
    times.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    cpu_times.push_back(cpu_ms() - c0);
  }
  if (breakdown) print_breakdown(steps);
  std::vector<double> timed(times.begin() + 1, times.end());
  std::sort(timed.begin(), timed.end());
  double median = timed[timed.size() / 2];
  double flops = config.train_flops_per_token(seq) * static_cast<double>(tokens);
  // Recomputation's extra FLOPs over the step's (PaLM convention, as
  // train_flops_per_token): full = one more forward of every block (2 x its
  // matmul weights + 4 T d of attention per token), selective = QK^T (2 T d).
  const double d = static_cast<double>(config.dim), f = static_cast<double>(config.hidden_dim);
  const double kv = static_cast<double>(config.n_kv_heads * config.head_dim());
  const double T = static_cast<double>(seq), L = static_cast<double>(config.n_layers);
  const double block_forward = 2 * (d * (d + 2 * kv) + d * d + 3 * d * f) + 4 * T * d;
  const double recomputed_layers =
      recompute.mode == Recompute::full && recompute.layers > 0
          ? std::min<double>(L, static_cast<double>(recompute.layers))
          : L;
  const double extra = recompute.mode == Recompute::full        ? recomputed_layers * block_forward
                       : recompute.mode == Recompute::selective ? L * 2 * T * d
                                                                : 0;
  const double theory_overhead = extra / config.train_flops_per_token(seq);
  fmt::print(
      "{{\"side\": \"meshtrain\", \"precision\": \"{}\", \"threads\": {}, \"step_ms\": [{:.1f}], "
      "\"median_ms\": {:.1f}, \"tokens_per_s\": {:.1f}, \"mfu\": {:.3f}, \"peak_gflops\": {:.1f}, "
      "\"loss\": {:.5f}, \"peak_memory_mib\": {:.1f}, \"recompute\": \"{}\", "
      "\"recompute_layers\": {}, \"activation_peak_mib\": {:.2f}, "
      "\"activation_planned_mib\": {:.2f}, \"flops_overhead_theory\": {:.4f}, "
      "\"step_cpu_ms\": [{:.1f}], \"params\": {}, \"active_flops_per_token\": {:.4g}, "
      "\"experts\": {}}}\n",
      precision_name, ctx.threads(), fmt::join(std::vector<double>(times.begin() + 1, times.end()), ", "),
      median, static_cast<double>(tokens) / median * 1000.0, flops / (median / 1000.0) / peak,
      peak / 1e9, loss, static_cast<double>(tracker.peak_total()) / (1 << 20), recompute_name,
      recompute_layers, static_cast<double>(tracker.peak(MemCategory::activations)) / (1 << 20),
      config.moe.enabled()  // the planner's formula is the dense block's
          ? 0.0
          : plan::engine_memory(config, precision, batch, seq, recompute).activations / (1 << 20),
      theory_overhead, fmt::join(std::vector<double>(cpu_times.begin() + 1, cpu_times.end()), ", "),
      config.num_params(), config.train_flops_per_token(seq), config.moe.experts);
  return 0;
}
