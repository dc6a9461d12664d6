// Tensor-parallel training step: per-rank step time, the tp group's
// communication (calls, bytes, time from submit to finish and busy time) and
// memory by category, for a model preset at a fixed global batch. Run under
// mpirun with tp x dp ranks (bench/tp_scaling.sh); rank 0 prints one JSON line.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <random>
#include <vector>

#include "meshtrain/backend/cpu/cpu_backend.h"
#include "meshtrain/comm/mesh.h"
#include "meshtrain/comm/mpi.h"
#include "meshtrain/model/model.h"
#include "meshtrain/optim/adamw.h"
#include "meshtrain/optim/clip.h"
#include "meshtrain/parallel/ddp/ddp.h"

namespace {

using namespace meshtrain;

double max_over(Communicator& world, double v) {
  world.all_reduce(&v, 1, CommDType::f64, ReduceOp::max);
  return v;
}

int run(MpiEnvironment& env, int argc, char** argv) {
  CLI::App app{"meshtrain tensor-parallel step benchmark"};
  std::string preset = "llama-60M", precision_name = "fp32";
  int tp_size = 1, threads = 1, steps = 3;
  bool sp = false;
  int64_t batch = 8, seq = 256;
  app.add_option("--model", preset);
  app.add_option("--precision", precision_name)->check(CLI::IsMember({"fp32", "bf16"}));
  app.add_option("--tp", tp_size);
  app.add_option("--sp", sp, "sequence parallel");
  app.add_option("--threads", threads, "per rank");
  app.add_option("--steps", steps, "timed steps (after one warm-up step)");
  app.add_option("--batch", batch, "global sequences per step");
  app.add_option("--seq", seq);
  CLI11_PARSE(app, argc, argv);

  MemoryTracker comm_tracker, tracker;
  std::unique_ptr<MpiCommunicator> world = env.world(comm_tracker);
  DeviceMesh mesh(*world, tp_size, 1);
  const int dp = mesh.layout().dp();
  ModelConfig config = model_preset(preset);
  config.max_seq_len = std::max(config.max_seq_len, seq);
  const Precision precision = parse_precision(precision_name);
  cpu::CpuBackend ctx(threads, tracker);
  TensorParallel tp{&mesh.tp(), sp};
  Model model(config, precision, ctx, ParamStorage::flat, tp);
  model.init_weights(1);
  AdamW optimizer(model, AdamWConfig{});
  std::unique_ptr<DistributedDataParallel> ddp;
  if (dp > 1) ddp = std::make_unique<DistributedDataParallel>(model, mesh.replicas(), DdpOptions{});

  const int64_t rows = batch / dp;
  std::mt19937 rng(static_cast<unsigned>(mesh.coord().dp));
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(config.vocab_size - 1));
  std::vector<int32_t> inputs(static_cast<size_t>(rows * seq)), targets(inputs.size());
  for (auto& t : inputs) t = token(rng);
  for (auto& t : targets) t = token(rng);

  std::vector<double> step_s;
  double tp_span = 0, tp_busy = 0;
  CommStats before;
  tracker.reset_peaks();
  for (int k = 0; k <= steps; ++k) {
    if (k == 1) before = mesh.tp().stats();  // after the warm-up step
    const uint64_t first_call = mesh.tp().calls_issued();
    const auto t0 = std::chrono::steady_clock::now();
    model.zero_grads();
    if (ddp) ddp->begin_micro_batch(true);
    model.forward_backward(inputs.data(), targets.data(), rows, seq,
                           static_cast<float>(1.0 / static_cast<double>(rows * seq)));
    if (ddp) ddp->finish_gradient_sync();
    optimizer.step(1e-4f, clip_factor(tensor_parallel_grad_norm(model), 1.0f));
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (k == 0) continue;
    step_s.push_back(s);
    // Submit to finish: what the training thread waits for a blocking call
    // (an upper bound for the two overlapped ones per block in backward).
    for (const CallRecord& c : mesh.tp().recent_calls()) {
      if (c.seq < first_call) continue;
      tp_span += std::chrono::duration<double>(c.finished - c.submitted).count();
      tp_busy += c.busy_seconds();
    }
  }
  const CommStats after = mesh.tp().stats();
  std::sort(step_s.begin(), step_s.end());
  const double step = max_over(*world, step_s[step_s.size() / 2]);
  const double wait = max_over(*world, tp_span / steps);
  const double busy = max_over(*world, tp_busy / steps);
  const double bytes = static_cast<double>(after.total().bytes - before.total().bytes) / steps;
  const double calls = static_cast<double>(after.total().calls - before.total().calls) / steps;
  auto mib = [&](MemCategory c) {
    return max_over(*world, static_cast<double>(tracker.peak(c)) / (1 << 20));
  };
  const double params = mib(MemCategory::params), grads = mib(MemCategory::grads),
               optim = mib(MemCategory::optimizer), acts = mib(MemCategory::activations),
               work = mib(MemCategory::workspace);
  const double total = max_over(*world, static_cast<double>(tracker.peak_total()) / (1 << 20));
  if (world->rank() == 0) {
    fmt::print(
        "{{\"model\": \"{}\", \"precision\": \"{}\", \"tp\": {}, \"dp\": {}, \"sp\": {}, "
        "\"threads_per_rank\": {}, \"global_batch\": {}, \"seq\": {}, \"step_s\": {:.3f}, "
        "\"tokens_per_s\": {:.0f}, \"tp_wait_s\": {:.3f}, \"tp_share\": {:.3f}, \"tp_busy_s\": {:.3f}, "
        "\"tp_calls_per_step\": {:.0f}, \"tp_mib_per_step\": {:.1f}, \"peak_mib\": {{\"params\": "
        "{:.1f}, \"grads\": {:.1f}, \"optimizer\": {:.1f}, \"activations\": {:.1f}, "
        "\"workspace\": {:.1f}, \"total\": {:.1f}}}}}\n",
        preset, precision_name, tp_size, dp, sp, threads, batch, seq, step,
        static_cast<double>(batch * seq) / step, wait, wait / step, busy, calls, bytes / (1 << 20),
        params, grads, optim, acts, work, total);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  meshtrain::MpiEnvironment env;
  try {
    return run(env, argc, argv);
  } catch (const std::exception& e) {
    fmt::print(stderr, "rank {}: {}\n", env.world_rank(), e.what());
    env.abort(1);
  }
}
