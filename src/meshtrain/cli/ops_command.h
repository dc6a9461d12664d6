// `meshtrain ops test`: the backend test suite (backend/ops_suite.h) on one
// backend, against float64 (the CPU backend, or any backend in a build without
// it) or against the CPU backend (any other). Exit 0 when every case passes, 1 naming the failed ops, 8 (resource)
// with one line when the backend is not built or has no device.
// `meshtrain ops perf`: every op timed at a training step's shapes, with its
// fraction of the backend's measured roofline (backend/ops_perf.h).
// `meshtrain ops nccl`: the NCCL communicator on one rank and one GPU
// (comm/nccl/self_test.h); exit 8 (resource) with one line when the build has
// no NCCL or there is no device, 1 when a call fails.
#pragma once

#include <CLI/CLI.hpp>

#include <string>

#include "meshtrain/backend/ops_perf.h"

namespace meshtrain {

struct OpsArgs {
  std::string backend = "cpu";
  std::string op;  // regex
  int threads = 0;
  unsigned seed = 1;
  bool verbose = false;
  bool list = false;
  double seconds = 0.3;  // perf: per case
  OpsPerfShape shape;    // perf
  int device = -1;       // nccl: the GPU (-1: cuda::choose_device's)
};

struct OpsCommands {
  CLI::App* test = nullptr;
  CLI::App* perf = nullptr;
  CLI::App* nccl = nullptr;
};

// Adds `ops` with its `test` and `perf` subcommands.
OpsCommands add_ops_commands(CLI::App& app, OpsArgs& args);
int run_ops_test(const OpsArgs& args);
int run_ops_perf(const OpsArgs& args);
int run_ops_nccl(const OpsArgs& args);
// Runs whichever of test, perf and nccl was parsed.
int run_ops(const OpsCommands& commands, const OpsArgs& args);

}  // namespace meshtrain
