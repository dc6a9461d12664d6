#include "meshtrain/comm/nccl/device_world.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <utility>

#include "meshtrain/backend/cuda/runtime.h"
#include "meshtrain/comm/nccl/cuda_copier.h"
#include "meshtrain/comm/nccl/nccl.h"
#include "meshtrain/util/error.h"

namespace meshtrain {

std::string resolve_comm_backend(const std::string& requested, bool shares_gpu) {
  if (requested == "auto") return shares_gpu ? "mpi" : "nccl";
  MESHTRAIN_CHECK(requested != "nccl" || !shares_gpu,
                  "config: comm.backend = \"nccl\" but a node runs more ranks than it has GPUs, "
                  "and NCCL refuses two ranks on one device: use comm.backend = \"mpi\" (host "
                  "staging) or one rank per GPU");
  MESHTRAIN_CHECK(requested == "nccl" || requested == "mpi",
                  "config: comm.backend must be \"auto\", \"mpi\" or \"nccl\", not \"{}\"",
                  requested);
  return requested;
}

MemorySide CudaMemoryLocator::side(const void* data) const {
  if (data == nullptr) return MemorySide::none;
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, data) != cudaSuccess) {
    cudaGetLastError();  // an address the runtime does not know is host memory
    return MemorySide::host;
  }
  return attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged
             ? MemorySide::device
             : MemorySide::host;
}

CudaWorld make_cuda_world(Communicator& host_world, const std::string& requested, int local_size,
                          MemoryTracker& tracker, FlightRecorder& flight) {
  int devices = 0;
  cuda::check(cudaGetDeviceCount(&devices), "cudaGetDeviceCount");
  int64_t shares = local_size > devices ? 1 : 0;
  host_world.all_reduce(&shares, 1, CommDType::i64, ReduceOp::max);

  CudaWorld w;
  w.backend = resolve_comm_backend(requested, shares != 0);
  w.locator = std::make_unique<CudaMemoryLocator>();
  const int device = cuda::choose_device();
  const cudaStream_t compute = cuda::compute_stream(device);
  const std::string device_name = RoutedCommunicator::device_name(host_world.name());
  std::unique_ptr<Communicator> device_side;
  if (w.backend == "nccl") {
    const NcclId id = share_nccl_id(host_world);
    NcclCommunicator::Options options;
    options.device = device;
    options.compute = compute;
    options.tracker = &tracker;
    options.flight = &flight;
    device_side = NcclCommunicator::create(id, host_world.rank(), host_world.size(), device_name,
                                           std::move(options));
  } else {
    w.copier = std::make_unique<CudaCopier>(device, compute);
    static const cuda::PinnedAllocator pinned;  // what the device copies to at full speed
    device_side = std::make_unique<StagedCommunicator>(
        host_world.split(0, host_world.rank(), device_name), *w.copier, tracker, pinned);
  }
  w.world = std::make_unique<RoutedCommunicator>(
      host_world.split(0, host_world.rank(), host_world.name()), std::move(device_side),
      *w.locator);
  return w;
}

}  // namespace meshtrain
