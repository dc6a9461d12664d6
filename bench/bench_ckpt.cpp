// Distributed checkpoint I/O on a real Trainer (one rank of an MPI job, or
// alone): the training stall of a save (sync, or async's staging copy) in
// steps, write throughput (all ranks' file bytes / the slowest rank's
// write-to-commit time), the peak memory above the resident state during
// the save, and (--resume) the load time. One JSON line from rank 0.
//   mpirun -np 2 build/bench/bench_ckpt --config run.toml [--resume DIR] [--set ckpt.async=true]
// bench/ckpt_io.sh runs it next to the disk's own sequential write speed.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <chrono>
#include <memory>

#include "meshtrain/ckpt/distributed.h"
#include "meshtrain/comm/mesh.h"
#include "meshtrain/comm/mpi.h"
#include "meshtrain/train/distributed.h"
#include "meshtrain/train/trainer.h"

using namespace meshtrain;

namespace {

double since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

double max_over(Communicator& world, double v) {
  world.all_reduce(&v, 1, CommDType::f64, ReduceOp::max);
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"meshtrain checkpoint benchmark"};
  std::string config_path, resume;
  std::vector<std::string> sets;
  int steps = 2;
  app.add_option("--config", config_path, "run TOML")->required();
  app.add_option("--resume", resume, "measure the load of this checkpoint (any layout)");
  app.add_option("--set", sets, "section.key=value overrides");
  app.add_option("--steps", steps, "training steps before the save (the last one is timed)");
  CLI11_PARSE(app, argc, argv);
  ConfigOverrides overrides;
  for (const std::string& s : sets) {
    const auto eq = s.find('=');
    overrides.emplace_back(s.substr(0, eq), s.substr(eq + 1));
  }
  MemoryTracker comm_tracker;
  MpiEnvironment env;
  {
    std::unique_ptr<MpiCommunicator> world = env.world(comm_tracker);
    TrainConfig config = load_config(config_path, overrides);
    DeviceMesh mesh(*world, config.parallel.tp, config.parallel.pp);
    TrainerOptions options;
    options.console = false;
    options.overwrite = true;
    options.allow_config_change = true;
    options.mesh = &mesh;
    options.resume_dir = resume;
    Trainer trainer(config, options);
    const double load_s = max_over(*world, trainer.checkpointer().last_load_seconds());
    double step_ms = 0;
    for (int i = 0; i < steps; ++i) step_ms = trainer.train_step().step_ms;

    MemoryTracker& tracker = trainer.tracker();
    const double resident = static_cast<double>(tracker.live_total());
    tracker.reset_peaks();
    // Async: a first save allocates the staging copy (kept for later saves);
    // the second one is the steady state the stall is measured on.
    double first_stall_s = 0;
    if (config.ckpt.async) {
      const auto first = std::chrono::steady_clock::now();
      trainer.save_checkpoint();
      first_stall_s = max_over(*world, since(first));
      trainer.wait_for_checkpoint();
    }
    world->barrier();
    const auto start = std::chrono::steady_clock::now();
    const std::string dir = trainer.save_checkpoint();
    const double stall_s = since(start);
    // Async: a step runs while the state is written in the background.
    const double overlapped_step_ms = config.ckpt.async ? trainer.train_step().step_ms : 0;
    trainer.wait_for_checkpoint();
    const double write_s = max_over(*world, since(start));
    const double peak_extra =
        max_over(*world, static_cast<double>(tracker.peak_total()) - resident);
    const double stall_max = max_over(*world, stall_s);
    const double step_max = max_over(*world, step_ms);
    const double state_bytes = static_cast<double>(trainer.shard_map().owned_numel()) * 12;
    if (world->rank() == 0) {
      const double bytes = static_cast<double>(dist_ckpt::read_manifest(dir).total_bytes());
      const double load_bytes =
          resume.empty() ? 0.0 : static_cast<double>(dist_ckpt::read_manifest(resume).total_bytes());
      fmt::print(
          "{{\"ranks\": {}, \"async\": {}, \"file_gb\": {:.3f}, \"write_s\": {:.3f}, "
          "\"write_gb_per_s\": {:.3f}, \"stall_s\": {:.3f}, \"step_s\": {:.3f}, "
          "\"stall_per_step\": {:.4f}, \"first_stall_s\": {:.3f}, \"overlapped_step_s\": {:.3f}, \"peak_above_resident_mb\": "
          "{:.1f}, \"rank0_owned_state_mb\": {:.1f}, \"load_s\": {:.3f}, \"load_gb_per_s\": {:.3f}}}\n",
          world->size(), config.ckpt.async, bytes / 1e9, write_s, bytes / 1e9 / write_s, stall_max,
          step_max / 1e3, stall_max / (step_max / 1e3), first_stall_s, overlapped_step_ms / 1e3,
          peak_extra / (1 << 20), state_bytes / (1 << 20), load_s,
          load_s > 0 ? load_bytes / 1e9 / load_s : 0.0);
    }
  }
  return 0;
}
