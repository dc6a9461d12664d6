#include "meshtrain/cli/ranks.h"

#include <fmt/format.h>

#include <unistd.h>

#include <array>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <memory>

#include "meshtrain/util/cores.h"
#include "meshtrain/comm/abort.h"
#include "meshtrain/comm/bench.h"
#include "meshtrain/comm/mesh.h"
#ifdef MESHTRAIN_HAVE_NCCL
#include "meshtrain/comm/nccl/nccl.h"
#endif
#include "meshtrain/cli/rank_world.h"
#include "meshtrain/comm/watchdog.h"
#include "meshtrain/train/comm_deadlines.h"
#include "meshtrain/train/generate.h"
#include "meshtrain/train/preemption.h"
#include "meshtrain/train/trainer.h"
#include "meshtrain/util/error.h"

namespace meshtrain {
namespace {

// This process as a rank: MPI, the world communicator, the failure handler.
struct RankJob {
  MemoryTracker tracker;  // communication scratch
  MpiEnvironment env;
  RankFailureHandler failure{env, tracker};
  std::unique_ptr<MpiCommunicator> world = env.world(tracker);
};

// "4096", "4K", "64M", "1G" (powers of 1024).
int64_t parse_size(const std::string& text) {
  int64_t value = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  std::string_view unit(ptr, static_cast<size_t>(text.data() + text.size() - ptr));
  int shift = unit.empty()                 ? 0
              : unit == "K" || unit == "k" ? 10
              : unit == "M"                ? 20
              : unit == "G"                ? 30
                                           : -1;
  MESHTRAIN_CHECK(ec == std::errc() && value > 0 && shift >= 0,
                  "bench comm: size '{}' is not a positive byte count (e.g. 4096, 4K, 64M, 1G)",
                  text);
  return value << shift;
}

CommOp parse_op(const std::string& name) {
  for (CommOp op :
       {CommOp::all_reduce, CommOp::reduce_scatter, CommOp::all_gather, CommOp::broadcast}) {
    if (name == comm_op_name(op)) return op;
  }
  if (name == "sendrecv" || name == "send") return CommOp::send;
  fail("bench comm: unknown op '{}' (all_reduce, reduce_scatter, all_gather, broadcast, sendrecv)",
       name);
}

// The hang watchdog of a multi-rank run (comm/watchdog.h), or none: its
// flight directory is out_dir/flight/<job>, the job named by rank 0's start.
std::unique_ptr<Watchdog> start_watchdog(RankJob& job, const TrainConfig& config) {
  job.env.flight().set_capacity(static_cast<size_t>(config.comm.flight_records));
  std::array<int64_t, 2> id{static_cast<int64_t>(std::time(nullptr)),
                            static_cast<int64_t>(::getpid())};
  job.world->broadcast(id.data(), 2, CommDType::i64, 0);
  if (job.env.world_size() == 1 || config.comm.flight_records == 0) return nullptr;
  WatchdogOptions options;
  options.job = flight_job_name(id[0], id[1]);
  options.dir = config.train.out_dir + "/flight/" + options.job;
  options.world_rank = job.env.world_rank();
  options.world_size = job.env.world_size();
#ifdef MESHTRAIN_HAVE_NCCL
  options.abort_comms = [] { abort_nccl_communicators(); };
#endif
  return std::make_unique<Watchdog>(job.env.flight(), options,
                                    [&job](int code) { job.env.abort(code); });
}

// MESHTRAIN_LAUNCH_ATTEMPT / MESHTRAIN_LAUNCH_TIME, set by `meshtrain launch`.
void read_launch_env(TrainerOptions& options) {
  if (const char* attempt = std::getenv("MESHTRAIN_LAUNCH_ATTEMPT")) {
    options.launch_attempt = std::atoi(attempt);
  }
  if (const char* time = std::getenv("MESHTRAIN_LAUNCH_TIME")) options.launched_at = std::atof(time);
}

}  // namespace

int run_train_ranks(const std::string& config_path, const ConfigOverrides& overrides,
                    const TrainerOptions& base) {
  RankJob job;
  // SIGTERM/SIGINT from here on: a checkpoint and exit 75 at the next step boundary.
  PreemptionSignals signals;
  // Outlive the catch below: a failing rank reports while its pending
  // collectives still have their buffers (see comm/abort.h).
  std::unique_ptr<Watchdog> watchdog;
  std::unique_ptr<RankWorld> world;
  std::unique_ptr<DeviceMesh> mesh;
  std::unique_ptr<Trainer> trainer;
  try {
    TrainConfig config = load_config(config_path, overrides);
    watchdog = start_watchdog(job, config);
    auto deadlines = std::make_unique<CommDeadlines>(job.env.flight(), config.comm);
    const bool multi = job.env.world_size() > 1;
    if (multi && config.train.threads == 0) {
      config.train.threads = default_threads_per_rank(job.env.local_size(), available_cores());
    }
    world = make_rank_world(*job.world, config, job.env.local_size(), job.tracker,
                            job.env.flight());
    mesh = std::make_unique<DeviceMesh>(world->world(), config.parallel.tp, config.parallel.pp,
                                        config.parallel.ep, config.parallel.cp);
    TrainerOptions options = base;
    options.mesh = multi ? mesh.get() : nullptr;
    read_launch_env(options);
    trainer = std::make_unique<Trainer>(config, options);
    // The preemption vote before CommDeadlines' on_step: under the step's deadline.
    trainer->add_hook(std::make_unique<PreemptionHook>(
        *trainer, multi ? &mesh->world() : nullptr,
        [&job, long_timeout = config.comm.long_timeout_s] {
          job.env.flight().set_timeout(long_timeout);
        }));
    trainer->add_hook(std::move(deadlines));
    trainer->run();
    return 0;
  } catch (const std::exception& e) {
    if (job.env.world_size() == 1) throw;
    return job.failure.fail_rank(e);
  }
}

int run_eval_ranks(const EvalArgs& args) {
  RankJob job;
  try {
    EvalOptions options = args.options;
    DataSettings files;
    files.train = args.data;
    options.data = expand_train_files(files);
    const bool multi = job.env.world_size() > 1;
    if (multi && options.threads == 0) {
      options.threads = default_threads_per_rank(job.env.local_size(), available_cores());
    }
    const EvalResult r = evaluate_checkpoint(args.checkpoint, options, multi ? job.world.get() : nullptr);
    if (job.world->rank() == 0) {
      fmt::print("eval {}: loss {:.6f} perplexity {:.4f} ({} tokens: {} batches x {} x {})\n",
                 args.checkpoint, r.loss, r.perplexity, r.tokens, r.batches, r.batch_size,
                 r.seq_len);
      if (!args.logits_ids.empty()) {
        const std::vector<int32_t> ids = parse_token_ids(args.logits_ids);
        write_logits(args.checkpoint, ids, args.logits_out, options.threads);
        fmt::print("logits of {} ids written to {}\n", ids.size(), args.logits_out);
      }
    }
    return 0;
  } catch (const std::exception& e) {
    if (job.env.world_size() == 1) throw;
    return job.failure.fail_rank(e);
  }
}

int run_bench_comm(const BenchCommArgs& args) {
  RankJob job;
  try {
    CommBenchOptions options = args.quick ? quick_comm_bench() : CommBenchOptions{};
    if (!args.min_size.empty()) options.min_bytes = parse_size(args.min_size);
    if (!args.max_size.empty()) options.max_bytes = parse_size(args.max_size);
    if (!args.ops.empty()) {
      options.ops.clear();
      for (const std::string& op : args.ops) options.ops.push_back(parse_op(op));
    }
    const bool print = job.world->rank() == 0;
    if (print) {
      fmt::print(
          "bench comm: {} ranks ({} on this node), f32, sizes {} .. {} bytes; times are the "
          "slowest rank's mean per call\n{}\n",
          job.world->size(), job.env.local_size(), options.min_bytes, options.max_bytes,
          comm_bench_header());
      std::fflush(stdout);
    }
    run_comm_bench(*job.world, job.tracker, options, [&](const CommBenchRow& row) {
      if (!print) return;
      fmt::print("{}\n", format_comm_bench_row(row));
      std::fflush(stdout);
    });
    return 0;
  } catch (const std::exception& e) {
    if (job.env.world_size() == 1) throw;
    return job.failure.fail_rank(e);
  }
}

}  // namespace meshtrain
