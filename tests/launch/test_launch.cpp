// The launcher's pure parts: the restart policy, the command rewrites, and
// what it reads from a failed job's stderr.
#include <gtest/gtest.h>

#include "meshtrain/launch/command.h"
#include "meshtrain/launch/policy.h"
#include "meshtrain/launch/supervisor.h"
#include "meshtrain/util/error.h"

namespace meshtrain::launch {
namespace {

TEST(Policy, EachExitCodeByItsKind) {
  EXPECT_EQ(decide(0).action, Action::done);
  for (int stop : {1, 2, 5, 8, 9, 126, 127}) EXPECT_EQ(decide(stop).action, Action::stop) << stop;
  for (int again : {3, 4, 6, 7, 75, 137, 143, 255}) {
    EXPECT_EQ(decide(again).action, Action::relaunch) << again;
  }
  EXPECT_EQ(decide(1).kind, "config");
  EXPECT_EQ(decide(75).kind, "preempted");
  EXPECT_EQ(decide(9).kind, "busy");
  EXPECT_TRUE(decide(75).preempted);
  EXPECT_FALSE(decide(6).preempted);
  EXPECT_EQ(decide(137).kind, "signal");
  EXPECT_EQ(decide(2).kind, "usage");
}

TEST(Command, ResumeAutoIsAddedAfterEachTrainWithoutResume) {
  const Argv cmd = {"mpirun", "-np", "2", "/b/meshtrain", "train", "--config", "x.toml"};
  EXPECT_EQ(with_resume_auto(cmd), (Argv{"mpirun", "-np", "2", "/b/meshtrain", "train", "--resume",
                                         "auto", "--config", "x.toml"}));
  const Argv has = {"meshtrain", "train", "--config", "x.toml", "--resume", "runs/x/step_4"};
  EXPECT_EQ(with_resume_auto(has), has);
  const Argv has_eq = {"meshtrain", "train", "--resume=auto"};
  EXPECT_EQ(with_resume_auto(has_eq), has_eq);
  // MPMD: each part on its own.
  const Argv mpmd = {"mpirun", "-np", "1", "meshtrain", "train", "--resume", "auto", ":",
                     "-np", "1", "meshtrain", "train"};
  const Argv out = with_resume_auto(mpmd);
  EXPECT_EQ(out.size(), mpmd.size() + 2);
  EXPECT_EQ(out.back(), "auto");
  // "train" as a value of something else is not the subcommand.
  const Argv other = {"srun", "--job-name", "train", "/opt/meshtrain", "eval"};
  EXPECT_TRUE(train_positions(other).empty());
  EXPECT_EQ(with_resume_auto(other), other);
}

TEST(Command, TrainArgumentsStopAtTheMpmdSeparator) {
  const Argv cmd = {"mpirun", "-np", "1", "meshtrain", "train", "--config", "a.toml", ":", "-np",
                    "1", "meshtrain", "train", "--config", "b.toml"};
  EXPECT_EQ(train_arguments(cmd), (Argv{"--config", "a.toml"}));
  EXPECT_TRUE(train_arguments(Argv{"bash", "run.sh"}).empty());
}

TEST(Command, RankCountOfMpirunAndSrunIsFoundAndRewritten) {
  const Argv mpirun = {"mpirun", "--oversubscribe", "-np", "4", "meshtrain", "train", "-n", "9"};
  EXPECT_EQ(rank_count(mpirun), 4);
  EXPECT_EQ(with_rank_count(mpirun, 2),
            (Argv{"mpirun", "--oversubscribe", "-np", "2", "meshtrain", "train", "-n", "9"}));
  EXPECT_EQ(rank_count(Argv{"srun", "--ntasks=8", "--mpi=pmix", "meshtrain", "train"}), 8);
  EXPECT_EQ(with_rank_count(Argv{"srun", "--ntasks=8", "meshtrain"}, 6),
            (Argv{"srun", "--ntasks=6", "meshtrain"}));
  EXPECT_EQ(rank_count(Argv{"srun", "-n4", "meshtrain"}), 4);
  EXPECT_EQ(with_rank_count(Argv{"srun", "-n4", "meshtrain"}, 2), (Argv{"srun", "-n2", "meshtrain"}));
  EXPECT_EQ(rank_count(Argv{"srun", "-n", "3", "meshtrain"}), 3);
  // After the binary, -n belongs to meshtrain; without a launcher there is none.
  EXPECT_FALSE(rank_count(Argv{"meshtrain", "train", "-n", "4"}).has_value());
  EXPECT_THROW(with_rank_count(Argv{"meshtrain", "train"}, 2), Error);
}

TEST(Command, OpenMpiGetsTheLaunchVariablesExported) {
  EXPECT_EQ(with_exported_env(Argv{"/usr/bin/mpirun", "-np", "2", "meshtrain"}, {"A", "B"}),
            (Argv{"/usr/bin/mpirun", "-x", "A", "-x", "B", "-np", "2", "meshtrain"}));
  const Argv srun = {"srun", "-n", "2", "meshtrain"};
  EXPECT_EQ(with_exported_env(srun, {"A"}), srun);
  EXPECT_TRUE(is_mpi_launcher("mpirun"));
  EXPECT_TRUE(is_mpi_launcher("orted"));
  EXPECT_FALSE(is_mpi_launcher("meshtrain"));
  EXPECT_FALSE(is_mpi_launcher("srun"));
}

TEST(Stderr, CauseIsTheLastMeshtrainLineElseTheLastText) {
  const std::vector<std::string> mpirun_abort = {
      "step 3 | loss 5.1", "rank 1: peer: MPI_Allreduce failed: connection reset",
      "--------------------------------------------------------------------------",
      "Primary job  terminated normally, but 1 process returned", "  Exit code:    6",
      "--------------------------------------------------------------------------"};
  EXPECT_EQ(cause_line(mpirun_abort), "rank 1: peer: MPI_Allreduce failed: connection reset");
  const std::vector<std::string> killed = {
      "--------------------------------------------------------------------------",
      "mpirun noticed that process rank 1 with PID 0 on node vm exited on signal 9 (Killed).",
      "--------------------------------------------------------------------------"};
  EXPECT_EQ(cause_line(killed),
            "mpirun noticed that process rank 1 with PID 0 on node vm exited on signal 9 (Killed).");
  EXPECT_EQ(failing_rank(killed), 1);
  EXPECT_EQ(failing_rank(mpirun_abort), 1);
  EXPECT_EQ(failing_rank({"nothing here"}), -1);
  EXPECT_EQ(cause_line({}), "");
}

TEST(Shrink, LargestDivisorOfTheBatchBelowDp) {
  EXPECT_EQ(shrunk_dp(4, 8), 2);
  EXPECT_EQ(shrunk_dp(4, 12), 3);
  EXPECT_EQ(shrunk_dp(2, 8), 1);
  EXPECT_EQ(shrunk_dp(1, 8), 0);
  EXPECT_EQ(shrunk_dp(8, 0), 0);
}

}  // namespace
}  // namespace meshtrain::launch
