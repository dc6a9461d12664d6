// The world communicator of a rank whose tensors live on a CUDA device: MPI
// for host memory, and for device memory NCCL or MPI with host staging
// (comm/routed.h routes each call by where its buffers are).
//
// comm.backend:
// - "nccl": NCCL between the devices; a config error when a node has more
//   ranks than GPUs (NCCL refuses two ranks on one device).
// - "mpi": MPI through host buffers (comm/staged.h), any number of ranks per GPU.
// - "auto" (the default): "nccl" when no node has more ranks than GPUs, else "mpi".
#pragma once

#include <memory>
#include <string>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/comm/flight_recorder.h"
#include "meshtrain/comm/routed.h"
#include "meshtrain/comm/staged.h"
#include "meshtrain/tensor/memory_tracker.h"

namespace meshtrain {

// What comm.backend `requested` means on this job: "nccl" or "mpi". shares_gpu:
// some node runs more ranks than it has GPUs (the same answer on every rank).
std::string resolve_comm_backend(const std::string& requested, bool shares_gpu);

// Where a buffer is, as the CUDA runtime sees it (device and managed memory
// are device; pageable and pinned host memory are host).
class CudaMemoryLocator final : public MemoryLocator {
 public:
  MemorySide side(const void* data) const override;
};

// The routed world and what it needs, destroyed world first.
struct CudaWorld {
  std::string backend;  // "nccl" or "mpi"
  std::unique_ptr<CudaMemoryLocator> locator;
  std::unique_ptr<DeviceCopier> copier;  // with "mpi"
  std::unique_ptr<Communicator> world;
};

// Collective over `host_world` (MPI's world, which must outlive the result):
// decides comm.backend `requested` for the whole job (every rank tells
// whether its node has more ranks than GPUs), then builds the device side on
// this process's device (cuda::choose_device) ordered after its compute stream,
// recording every NCCL call in `flight` and counting scratch in `tracker`.
// Throws Error (resource) when the device or NCCL cannot be used.
CudaWorld make_cuda_world(Communicator& host_world, const std::string& requested, int local_size,
                          MemoryTracker& tracker, FlightRecorder& flight);

}  // namespace meshtrain
