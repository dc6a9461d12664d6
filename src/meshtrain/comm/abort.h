// What a rank does when it fails in a multi-rank job, so that no rank is left
// hanging: it prints "rank R: <message>" once on stderr, then waits a short
// grace period for the other ranks to fail too (a barrier on a communicator
// reserved for this, so it never matches a training collective). If every
// rank fails within the grace period (a bad config or mesh is seen by all),
// all of them exit normally with code 1, each having printed its line;
// otherwise MPI_Abort ends the whole job within seconds.
#pragma once

#include <chrono>
#include <memory>
#include <string_view>

#include "meshtrain/comm/mpi.h"

namespace meshtrain {

class RankFailureHandler {
 public:
  // Collective: creates the reserved communicator. `env` and `tracker` must outlive it.
  RankFailureHandler(MpiEnvironment& env, MemoryTracker& tracker);
  ~RankFailureHandler();

  // Prints the line (newlines in the message become spaces), then returns 1 when all ranks failed
  // together, or aborts the job (never returns).
  int fail_rank(std::string_view message,
                std::chrono::milliseconds grace = std::chrono::milliseconds(3000));

 private:
  MpiEnvironment& env_;
  std::unique_ptr<MpiCommunicator> comm_;
};

}  // namespace meshtrain
