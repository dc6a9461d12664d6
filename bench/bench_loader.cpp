// The loader's cost per training step against a llama-60M step (issue 3's
// target: under 1%). Two measurements:
//   1. produce: a synchronous loader (no prefetch) making the step's
//      micro-batches, averaged over many steps (what the prefetch thread spends);
//   2. wait: a real Trainer on configs/bench-llama-60M.toml, where each step
//      records how long it waited for its micro-batches (data_ms).
// Prints both, the step time and their ratio, then one JSON line.
//   build/bench/bench_loader [--data 'data/kjv/gpt2/train_*.bin'] [--steps 3]
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <random>
#include <vector>

#include "meshtrain/data/loader.h"
#include "meshtrain/data/token_file.h"
#include "meshtrain/train/config.h"
#include "meshtrain/train/trainer.h"

namespace fs = std::filesystem;
using namespace meshtrain;

int main(int argc, char** argv) {
  CLI::App app{"meshtrain loader benchmark"};
  std::string data, config_path = "configs/bench-llama-60M.toml";  // run from the repository root
  int steps = 3, threads = 0;
  int64_t produce_steps = 2000;
  app.add_option("--data", data, "token files (glob); default: 4M random GPT-2 ids in a temp file");
  app.add_option("--config", config_path, "the training step to compare with");
  app.add_option("--steps", steps, "training steps (the first is a warm-up, not counted)");
  app.add_option("--produce-steps", produce_steps, "steps for the synchronous loader timing");
  app.add_option("--threads", threads, "0 = the cores available");
  CLI11_PARSE(app, argc, argv);

  fs::path scratch = fs::temp_directory_path() / fmt::format("meshtrain_bench_loader_{}", ::getpid());
  fs::create_directories(scratch);
  if (data.empty()) {
    std::mt19937 rng(1);
    std::uniform_int_distribution<int> id(0, 50256);
    std::vector<uint16_t> tokens(4'000'000);
    for (uint16_t& t : tokens) t = static_cast<uint16_t>(id(rng));
    data = (scratch / "train.bin").string();
    write_token_file(data, tokens);
  }
  TrainConfig config = load_config(
      config_path, {{"data.train", data},
                    {"train.steps", std::to_string(steps)},
                    {"train.threads", std::to_string(threads)},
                    {"train.peak_flops", "1e11"},  // MFU is not the point here
                    {"train.checkpoint_interval", "-1"},
                    {"train.out_dir", (scratch / "run").string()}});
  const TrainSettings& t = config.train;

  // 1. The producer's work per step, synchronously.
  TokenDataset dataset(expand_train_files(config.data), config.model.vocab_size, t.seq_len);
  LoaderOptions options;
  options.global_batch = t.batch_size;
  options.micro_batch = t.micro_batch_size;
  options.seed = t.seed;
  options.prefetch = 0;
  DataLoader sync(dataset, options);
  auto start = std::chrono::steady_clock::now();
  for (int64_t s = 0; s < produce_steps; ++s) {
    for (int64_t k = 0; k < sync.micro_batches_per_step(); ++k) sync.next();
  }
  double produce_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count() /
      static_cast<double>(produce_steps);

  // 2. The wait inside real training steps (prefetch on, as the trainer runs it).
  TrainerOptions trainer_options;
  trainer_options.console = false;
  Trainer trainer(config, trainer_options);
  std::vector<double> step_ms, data_ms;
  for (int s = 0; s < steps; ++s) {
    StepRecord r = trainer.train_step();
    if (s == 0 && steps > 1) continue;  // warm-up: first-touch allocations, primitive creation
    step_ms.push_back(r.step_ms);
    data_ms.push_back(r.data_ms);
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  double step = median(step_ms), wait = median(data_ms);
  double share = (produce_ms + wait) / step;
  fmt::print("data: {} ({} samples of {}+1 tokens); step: {} x {} tokens, {} micro-batch(es)\n",
             data, dataset.num_samples(), t.seq_len, t.batch_size, t.seq_len,
             sync.micro_batches_per_step());
  fmt::print("loader produce: {:.4f} ms/step (synchronous, mean of {} steps)\n", produce_ms,
             produce_steps);
  fmt::print("loader wait in training: {:.4f} ms/step (median; max {:.4f})\n", wait,
             *std::max_element(data_ms.begin(), data_ms.end()));
  fmt::print("training step ({}): {:.1f} ms (median of {})\n", config_path, step, step_ms.size());
  fmt::print("loader share of the step: {:.5f}%\n", share * 100);
  fmt::print("{{\"produce_ms\": {:.6f}, \"wait_ms\": {:.6f}, \"step_ms\": {:.3f}, \"share\": {:.8f}}}\n",
             produce_ms, wait, step, share);
  fs::remove_all(scratch);
  return 0;
}
