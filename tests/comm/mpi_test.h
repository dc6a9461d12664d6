// Multi-rank GoogleTest programs (tests/comm, tests/ddp): one MpiEnvironment
// per process, made by mpi_test_main.cpp before the tests run. The same
// binary runs under mpirun with 1, 2 and 4 ranks (tests/mpi.cmake); tests
// read the world size and check what each rank must see.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "meshtrain/comm/mpi.h"

namespace meshtrain::testing {

MpiEnvironment& mpi_env();

// A fresh directory of this test for this rank:
// <build>/test_scratch/mpi_np<N>/<suite>.<test>/rank<R>.
std::string rank_scratch_dir();
// A fresh directory of this test shared by all ranks (rank 0 makes it; collective):
// <build>/test_scratch/mpi_np<N>/<suite>.<test>/shared.
std::string shared_scratch_dir(Communicator& world);

// True on every rank when `ok` is true on every rank (so a rank's failure
// is seen by all and no rank waits in a collective the others skipped).
bool all_ranks(Communicator& world, bool ok);

}  // namespace meshtrain::testing
