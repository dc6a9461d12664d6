// The world a multi-rank run's mesh splits, by where its backend keeps
// tensors: MPI's world when in host memory; for a device backend, MPI's world
// for host buffers routed beside a device communicator for tensors
// (comm/routed.h) as comm.backend says: NCCL or host staging on CUDA
// (comm/nccl/device_world.h), host staging on the guarded backend
// (backend/guarded: the same routing, checked on any CPU).
#pragma once

#include <memory>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/comm/flight_recorder.h"
#include "meshtrain/tensor/memory_tracker.h"
#include "meshtrain/train/config.h"

namespace meshtrain {

class RankWorld {
 public:
  virtual ~RankWorld() = default;
  virtual Communicator& world() = 0;
};

// Collective over `mpi_world` (which must outlive the result) when
// train.device is not the host's and the job has more than one rank.
std::unique_ptr<RankWorld> make_rank_world(Communicator& mpi_world, const TrainConfig& config,
                                           int local_size, MemoryTracker& tracker,
                                           FlightRecorder& flight);

}  // namespace meshtrain
