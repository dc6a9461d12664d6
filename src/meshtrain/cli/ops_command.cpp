#include "meshtrain/cli/ops_command.h"

#include <fmt/format.h>

#include <cstdio>
#include <memory>
#include <set>

#include "meshtrain/backend/ops_suite.h"
#include "meshtrain/backend/registry.h"
#include "meshtrain/util/error.h"
#ifdef MESHTRAIN_HAVE_NCCL
#include "meshtrain/comm/nccl/self_test.h"
#endif

namespace meshtrain {

OpsCommands add_ops_commands(CLI::App& app, OpsArgs& args) {
  CLI::App* ops = app.add_subcommand(
      "ops", "The backend's operations: test them (docs/ARCHITECTURE.md#how-to-add-a-backend)");
  ops->require_subcommand(1);
  CLI::App* test = ops->add_subcommand("test",
                                       "Every op of the ops layer on random inputs against float64 "
                                       "(cpu) or the cpu backend (others)");
  CLI::App* perf = ops->add_subcommand("perf",
                                       "Every op timed at a training step's shapes: ms, GFLOP/s or "
                                       "GB/s, fraction of the measured roofline");
  for (CLI::App* c : {test, perf}) {
    c->add_option("--backend", args.backend,
                  fmt::format("Backend: {} (default cpu)", fmt::join(backend_names(), ", ")));
    c->add_option("--op", args.op, "Only the ops whose name matches this regex");
    c->add_option("--threads", args.threads, "Host threads (default: every core)");
  }
  test->add_option("--seed", args.seed, "Seed of the random inputs (default 1)");
  test->add_flag("--verbose,-v", args.verbose, "One line per case, not only per op and failure");
  test->add_flag("--list", args.list, "Print the ops the suite covers and exit");
  OpsPerfShape& s = args.shape;
  perf->add_option("--seconds", args.seconds,
                   "Timed seconds per case (default 0.3; at least 3 calls)");
  perf->add_option("--batch", s.batch, "Sequences per step (default 8)");
  perf->add_option("--seq", s.seq, "Sequence length (default 256)");
  perf->add_option("--dim", s.dim, "Model width (default 512)");
  perf->add_option("--heads", s.heads, "Attention heads (default 8)");
  perf->add_option("--kv-heads", s.kv_heads, "Key/value heads (default 8)");
  perf->add_option("--hidden", s.hidden, "Feed-forward width (default 1536)");
  perf->add_option("--vocab", s.vocab, "Vocabulary (default 50257)");
  CLI::App* nccl = ops->add_subcommand(
      "nccl", "The NCCL communicator on one rank and one GPU: every call against known results");
  nccl->add_option("--device", args.device, "The GPU (default: the process's, docs/gpu.md)");
  return {test, perf, nccl};
}

int run_ops(const OpsCommands& commands, const OpsArgs& args) {
  if (commands.test->parsed()) return run_ops_test(args);
  if (commands.perf->parsed()) return run_ops_perf(args);
  return run_ops_nccl(args);
}

int run_ops_nccl([[maybe_unused]] const OpsArgs& args) {
#ifdef MESHTRAIN_HAVE_NCCL
  const NcclCheck check = nccl_self_test(args.device);
  MESHTRAIN_CHECK_AS(ErrorKind::resource, check.skipped.empty(), "ops nccl: SKIPPED: {}",
                     check.skipped);
  for (const std::string& line : check.lines) fmt::print("{}\n", line);
  fmt::print("ops nccl: {} of {} checks failed\n", check.failed, check.lines.size());
  return check.failed == 0 ? 0 : 1;
#else
  fail_as(ErrorKind::resource, "ops nccl: SKIPPED: this build has no NCCL (docs/gpu.md)");
#endif
}

int run_ops_perf(const OpsArgs& args) {
  MemoryTracker tracker;
  const std::unique_ptr<Backend> backend = make_backend(args.backend, args.threads, tracker);
  fmt::print("ops perf: backend {} ({}: {}, {} threads)\n", backend->name(),
             backend->device().str(), backend->device_name(), backend->threads());
  std::fflush(stdout);
  OpsPerfOptions options;
  options.op_regex = args.op;
  options.seconds = args.seconds;
  options.shape = args.shape;
  run_ops_perf(*backend, options, stdout);
  return 0;
}

int run_ops_test(const OpsArgs& args) {
  if (args.list) {
    for (const std::string& name : ops_test_names()) fmt::print("{}\n", name);
    return 0;
  }
  MemoryTracker tracker, reference_tracker;
  const std::unique_ptr<Backend> backend = make_backend(args.backend, args.threads, tracker);
  // Another backend is held to the CPU backend's results, the CPU one (and any
  // backend in a build without it: MESHTRAIN_BACKEND_ONLY without oneDNN) to float64.
  std::unique_ptr<Backend> reference;
  if (args.backend != kHostBackend && backend_unavailable(kHostBackend).empty())
    reference = make_backend(kHostBackend, args.threads, reference_tracker);
  fmt::print("ops test: backend {} ({}: {}, {} threads) against {}\n", backend->name(),
             backend->device().str(), backend->device_name(), backend->threads(),
             reference ? "the cpu backend" : "float64");
  std::fflush(stdout);
  OpsTestOptions options;
  options.op_regex = args.op;
  options.seed = args.seed;
  options.verbose = args.verbose;
  const OpsTestResult result = run_ops_test(*backend, reference.get(), options, stdout);
  const auto total = result.passed + static_cast<int>(result.failures.size());
  if (total == 0) {
    std::fprintf(stderr, "meshtrain: ops test: no op matches --op '%s'\n", args.op.c_str());
    return 1;
  }
  if (result.failures.empty()) {
    fmt::print("ops test: all {} cases passed\n", total);
    return 0;
  }
  std::set<std::string> ops;
  for (const std::string& f : result.failures) ops.insert(f.substr(0, f.find(' ')));
  std::fflush(stdout);
  std::fprintf(stderr, "meshtrain: ops test: %zu of %d cases failed, in %s\n",
               result.failures.size(), total, fmt::format("{}", fmt::join(ops, ", ")).c_str());
  return 1;
}

}  // namespace meshtrain
