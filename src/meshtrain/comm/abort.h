// What a rank does when it fails in a multi-rank job, so that no rank is left
// hanging: it prints "rank R: <message>" once on stderr, then waits a short
// grace period for the other ranks to fail too (a barrier on a communicator
// reserved for this, so it never matches a training collective). If every
// rank fails within the grace period (a bad config or mesh is seen by all),
// all of them exit normally with the error's code (meshtrain::exit_code of
// its kind; 1 for an exception that is not an Error), each having printed its
// line; otherwise MPI_Abort ends the whole job within seconds, with that code.
#pragma once

#include <chrono>
#include <exception>
#include <memory>
#include <string_view>

#include "meshtrain/comm/mpi.h"

namespace meshtrain {

class RankFailureHandler {
 public:
  // Collective: creates the reserved communicator. `env` and `tracker` must outlive it.
  RankFailureHandler(MpiEnvironment& env, MemoryTracker& tracker);
  ~RankFailureHandler();

  // Prints the line (newlines in the message become spaces), then returns the exit code when all
  // ranks failed together, or aborts the job with it (never returns).
  int fail_rank(const std::exception& error,
                std::chrono::milliseconds grace = std::chrono::milliseconds(3000));

 private:
  MpiEnvironment& env_;
  std::unique_ptr<MpiCommunicator> comm_;
};

}  // namespace meshtrain
