// `meshtrain launch [options] -- CMD...`: the options, and the glue that reads
// the supervised run's config (train/) for its out_dir, tp x pp and batch size.
#pragma once

#include <CLI/CLI.hpp>

#include <string>
#include <vector>

#include "meshtrain/launch/supervisor.h"

namespace meshtrain {

struct LaunchArgs {
  launch::LaunchOptions options;
  std::string log;  // empty: <out_dir>/launch.jsonl
  std::vector<std::string> command;
};

void add_launch_options(CLI::App& command, LaunchArgs& args);
int run_launch(LaunchArgs args);

}  // namespace meshtrain
