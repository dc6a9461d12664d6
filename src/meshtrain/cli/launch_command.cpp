#include "meshtrain/cli/launch_command.h"

#include <fmt/format.h>

#include <cstdio>
#include <filesystem>

#include "meshtrain/cli/args.h"
#include "meshtrain/launch/command.h"
#include "meshtrain/train/config.h"

namespace meshtrain {

void add_launch_options(CLI::App& command, LaunchArgs& args) {
  launch::LaunchOptions& o = args.options;
  command.add_option("--max-restarts", o.max_restarts, "Relaunches after failures at most")
      ->check(CLI::NonNegativeNumber)->capture_default_str();
  command.add_option("--backoff", o.backoff_s,
                     "Seconds before the first relaunch, doubled per failure without a new "
                     "checkpoint")
      ->check(CLI::NonNegativeNumber)->capture_default_str();
  command.add_option("--backoff-max", o.backoff_max_s, "Longest back-off, seconds")
      ->check(CLI::NonNegativeNumber)->capture_default_str();
  command.add_flag("--shrink", o.shrink,
                   "Relaunch with fewer data-parallel ranks when the same rank keeps failing");
  command.add_option("--shrink-after", o.shrink_after,
                     "Consecutive failures of one rank before --shrink acts")
      ->check(CLI::PositiveNumber)->capture_default_str();
  command.add_option("--log", args.log, "JSONL log of the attempts (default: <out_dir>/launch.jsonl)");
  command.add_option("command", args.command, "The job: mpirun/srun ... meshtrain train ...")
      ->required();
  command.footer("Restart policy by exit code: docs/launch.md");
}

int run_launch(LaunchArgs args) {
  launch::LaunchOptions& o = args.options;
  // The run's settings, read the way train reads them; a config the launcher
  // cannot read is the job's to report (it fails with its own message).
  const launch::Argv train = launch::train_arguments(args.command);
  std::string config_path;
  std::vector<std::string> rest;
  for (size_t i = 0; i < train.size(); ++i) {
    const std::string& a = train[i];
    if (a == "--config" && i + 1 < train.size()) {
      config_path = train[++i];
    } else if (a.starts_with("--config=")) {
      config_path = a.substr(9);
    } else if (a == "--resume" && i + 1 < train.size()) {
      ++i;
    } else if (a.starts_with("--") && a.find('.') != std::string::npos) {
      rest.push_back(a);
      if (a.find('=') == std::string::npos && i + 1 < train.size()) rest.push_back(train[++i]);
    }
  }
  if (!config_path.empty()) {
    try {
      const TrainConfig config = load_config(config_path, parse_overrides(rest));
      o.out_dir = config.train.out_dir;
      o.ranks_per_replica =
          static_cast<int>(config.parallel.tp * config.parallel.pp * config.parallel.cp);
      o.batch_size = static_cast<int>(config.train.batch_size);
    } catch (const Error& e) {
      std::fprintf(stderr, "launch: cannot read the run's config (%s); the job will say why\n",
                   e.what());
    }
  }
  o.log_path = args.log;
  if (o.log_path.empty() && !o.out_dir.empty()) {
    std::filesystem::create_directories(o.out_dir);
    o.log_path = (std::filesystem::path(o.out_dir) / "launch.jsonl").string();
  }
  return launch::supervise(args.command, o);
}

}  // namespace meshtrain
