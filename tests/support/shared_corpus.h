// Multi-rank trainer tests: a scratch directory shared by every rank with the
// phrase corpus in it (rank 0 writes it; collective).
#pragma once

#include <string>

#include "meshtrain/comm/communicator.h"
#include "mpi_test.h"
#include "support/trainer_run.h"

namespace meshtrain::testing {

inline std::string shared_phrase_corpus(Communicator& world, int vocab) {
  std::string dir = shared_scratch_dir(world);
  if (world.rank() == 0) write_phrase_corpus(dir, vocab);
  world.barrier();
  return dir;
}

}  // namespace meshtrain::testing
