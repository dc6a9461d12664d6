// gtest main for multi-rank tests: initialises MPI, runs the tests on every
// rank, and keeps ranks other than 0 quiet except for their failures.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>

#include "mpi_test.h"

namespace meshtrain::testing {
namespace {

MpiEnvironment* g_env = nullptr;  // the process's MPI, for the tests

// Ranks > 0 print only failed assertions, each line marked with the rank.
class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  // (UnitTest::current_test_info() would deadlock inside OnTestPartResult.)
  void OnTestStart(const ::testing::TestInfo& info) override {
    test_ = std::string(info.test_suite_name()) + "." + info.name();
  }
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (!r.failed()) return;
    std::fprintf(stderr, "[rank %d] %s: %s:%d: %s\n", rank_, test_.c_str(),
                 r.file_name() ? r.file_name() : "?", r.line_number(), r.summary());
    std::fflush(stderr);
  }

 private:
  int rank_;
  std::string test_;
};

}  // namespace

MpiEnvironment& mpi_env() { return *g_env; }

namespace {

std::filesystem::path test_dir() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return std::filesystem::path(MESHTRAIN_BINARY_DIR "/test_scratch") /
         ("mpi_np" + std::to_string(g_env->world_size())) /
         (std::string(info->test_suite_name()) + "." + info->name());
}

}  // namespace

std::string rank_scratch_dir() {
  auto dir = test_dir() / ("rank" + std::to_string(g_env->world_rank()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

std::string shared_scratch_dir(Communicator& world) {
  auto dir = test_dir() / "shared";
  if (world.rank() == 0) {
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
  }
  world.barrier();
  return dir.string();
}

bool all_ranks(Communicator& world, bool ok) {
  int32_t v = ok ? 1 : 0;
  world.all_reduce(&v, 1, CommDType::i32, ReduceOp::sum);
  return v == world.size();
}

}  // namespace meshtrain::testing

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  int rc = 0;
  {
    meshtrain::MpiEnvironment env;
    meshtrain::testing::g_env = &env;
    if (env.world_rank() != 0) {
      auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
      delete listeners.Release(listeners.default_result_printer());
      listeners.Append(new meshtrain::testing::FailurePrinter(env.world_rank()));
    }
    rc = RUN_ALL_TESTS();
    meshtrain::testing::g_env = nullptr;
  }
  return rc;
}
