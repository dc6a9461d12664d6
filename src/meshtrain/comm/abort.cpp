#include "meshtrain/comm/abort.h"

#include <algorithm>
#include <cstdio>
#include <string>
#include <thread>

#include "meshtrain/util/error.h"

namespace meshtrain {

RankFailureHandler::RankFailureHandler(MpiEnvironment& env, MemoryTracker& tracker)
    : env_(env), comm_(env.world(tracker, "failure")) {}

RankFailureHandler::~RankFailureHandler() = default;

int RankFailureHandler::fail_rank(const std::exception& error, std::chrono::milliseconds grace) {
  std::fflush(stdout);
  const auto* known = dynamic_cast<const Error*>(&error);
  const int code = known != nullptr ? exit_code(known->kind()) : 1;
  std::string line = "rank " + std::to_string(env_.world_rank()) + ": " + error.what();
  std::replace(line.begin(), line.end(), '\n', ' ');
  line += '\n';
  std::fputs(line.c_str(), stderr);
  std::fflush(stderr);
  if (env_.world_size() == 1) return code;
  // The barrier runs after anything already queued on the communication
  // thread; if that is stuck in a collective its peers never join, the
  // barrier never starts and the deadline passes.
  Work agreed = comm_->barrier_async();
  const auto deadline = std::chrono::steady_clock::now() + grace;
  while (std::chrono::steady_clock::now() < deadline) {
    if (agreed.test()) return code;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  env_.abort(code);
}

}  // namespace meshtrain
