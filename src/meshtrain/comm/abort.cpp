#include "meshtrain/comm/abort.h"

#include <algorithm>
#include <cstdio>
#include <string>
#include <thread>

namespace meshtrain {

RankFailureHandler::RankFailureHandler(MpiEnvironment& env, MemoryTracker& tracker)
    : env_(env), comm_(env.world(tracker, "failure")) {}

RankFailureHandler::~RankFailureHandler() = default;

int RankFailureHandler::fail_rank(std::string_view message, std::chrono::milliseconds grace) {
  std::fflush(stdout);
  std::string line = "rank " + std::to_string(env_.world_rank()) + ": " + std::string(message);
  std::replace(line.begin(), line.end(), '\n', ' ');
  line += '\n';
  std::fputs(line.c_str(), stderr);
  std::fflush(stderr);
  if (env_.world_size() == 1) return 1;
  // The barrier runs after anything already queued on the communication
  // thread; if that is stuck in a collective its peers never join, the
  // barrier never starts and the deadline passes.
  Work agreed = comm_->barrier_async();
  const auto deadline = std::chrono::steady_clock::now() + grace;
  while (std::chrono::steady_clock::now() < deadline) {
    if (agreed.test()) return 1;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  env_.abort(1);
}

}  // namespace meshtrain
