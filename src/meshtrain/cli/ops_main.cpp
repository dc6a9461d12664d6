// meshtrain-ops: `ops test` and `ops perf` without the engine (no MPI, no data,
// checkpoint or training code), the one executable a backend-only build
// (MESHTRAIN_BACKEND_ONLY) makes: what scripts/gpu_check.sh builds on a GPU
// machine that lacks the engine's dependencies. `meshtrain ops ...` runs the
// same commands.
#include <CLI/CLI.hpp>

#include "meshtrain/cli/exit.h"
#include "meshtrain/cli/ops_command.h"

int main(int argc, char** argv) {
  return meshtrain::run_guarded([&] {
    CLI::App app{"The ops layer's test suite and timings, without the engine"};
    app.require_subcommand(1);
    meshtrain::OpsArgs args;
    const meshtrain::OpsCommands commands = meshtrain::add_ops_commands(app, args);
    if (const std::optional<int> done = meshtrain::parse_command_line(app, argc, argv)) {
      return *done;
    }
    return meshtrain::run_ops(commands, args);
  });
}
