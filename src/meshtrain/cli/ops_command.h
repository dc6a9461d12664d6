// `meshtrain ops test`: the backend test suite (backend/ops_suite.h) on one
// backend, against float64 (the CPU backend, or any backend in a build without
// it) or against the CPU backend (any other). Exit 0 when every case passes, 1 naming the failed ops, 8 (resource)
// with one line when the backend is not built or has no device.
// `meshtrain ops perf`: every op timed at a training step's shapes, with its
// fraction of the backend's measured roofline (backend/ops_perf.h).
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
};

struct OpsCommands {
  CLI::App* test = nullptr;
  CLI::App* perf = nullptr;
};

// Adds `ops` with its `test` and `perf` subcommands.
OpsCommands add_ops_commands(CLI::App& app, OpsArgs& args);
int run_ops_test(const OpsArgs& args);
int run_ops_perf(const OpsArgs& args);

}  // namespace meshtrain
