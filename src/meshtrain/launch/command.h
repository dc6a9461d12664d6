// The job command `meshtrain launch` runs (mpirun / srun ... meshtrain train ...,
// or `meshtrain train` alone) and the rewrites a relaunch applies to it. Pure
// functions over argv; the rules are in docs/launch.md.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace meshtrain::launch {

using Argv = std::vector<std::string>;

// Where `train` subcommands are: each argument "train" that follows one whose
// file name starts with "meshtrain" (the binary, under any path). An MPMD
// command (mpirun ... : ...) may hold several.
std::vector<size_t> train_positions(const Argv& argv);

// The arguments of the first train subcommand (after "train", up to a ":"
// MPMD separator); empty when there is none.
Argv train_arguments(const Argv& argv);

// Every train subcommand without --resume gets "--resume auto" right after
// "train"; one that has --resume (any value) is left alone.
Argv with_resume_auto(const Argv& argv);

// The rank count of the launcher before the binary: -np N, -n N, --np N,
// --n N, -c N, --ntasks N, --ntasks=N, --np=N, -nN (mpirun, mpiexec, srun).
// nullopt when none is given (or the command is meshtrain itself: 1 rank).
std::optional<int> rank_count(const Argv& argv);
// The same command with that rank count replaced; Error when it has none.
Argv with_rank_count(const Argv& argv, int ranks);

// Open MPI's launchers (mpirun, mpiexec, orterun, prterun) pass a variable to
// ranks on other hosts only when told: "-x NAME" for each is inserted after
// the launcher. Other commands are returned unchanged (srun exports all).
Argv with_exported_env(const Argv& argv, const std::vector<std::string>& names);

// The file name of a path ("/usr/bin/mpirun" -> "mpirun").
std::string base_name(const std::string& path);
// Open MPI's launcher and daemon processes (by file name): they turn SIGTERM
// into a kill of every rank one second later, so signals go to the ranks.
bool is_mpi_launcher(const std::string& name);

}  // namespace meshtrain::launch
