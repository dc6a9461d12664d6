#include "meshtrain/cli/rank_world.h"

#include <cstring>
#include <string>
#include <utility>

#include "meshtrain/backend/guarded/guarded_memory.h"
#include "meshtrain/backend/registry.h"
#include "meshtrain/comm/routed.h"
#include "meshtrain/comm/staged.h"
#ifdef MESHTRAIN_HAVE_NCCL
#include "meshtrain/comm/nccl/device_world.h"
#endif
#include "meshtrain/util/error.h"

namespace meshtrain {
namespace {

class HostWorld final : public RankWorld {
 public:
  explicit HostWorld(Communicator& world) : world_(world) {}
  Communicator& world() override { return world_; }

 private:
  Communicator& world_;
};

// The guarded backend's memory as a communicator sees it, and its copies.
class GuardedLocator final : public MemoryLocator {
 public:
  MemorySide side(const void* data) const override {
    if (data == nullptr) return MemorySide::none;
    return guarded::GuardedMemory::instance().contains(data) ? MemorySide::device
                                                             : MemorySide::host;
  }
};

class GuardedCopier final : public DeviceCopier {
 public:
  void to_host(void* host, const void* device, size_t bytes) const override {
    const guarded::GuardedMemory::Open open;
    std::memcpy(host, device, bytes);
  }
  void to_device(void* device, const void* host, size_t bytes) const override {
    const guarded::GuardedMemory::Open open;
    std::memcpy(device, host, bytes);
  }
};

class GuardedWorld final : public RankWorld {
 public:
  GuardedWorld(Communicator& mpi, const std::string& comm_backend, MemoryTracker& tracker) {
    MESHTRAIN_CHECK(comm_backend != "nccl",
                    "config: comm.backend = \"nccl\" with train.device = \"guarded\": the guarded "
                    "backend's tensors move through host staging (comm.backend = \"auto\" or "
                    "\"mpi\")");
    auto device = std::make_unique<StagedCommunicator>(
        mpi.split(0, mpi.rank(), RoutedCommunicator::device_name(mpi.name())), copier_, tracker);
    world_ = std::make_unique<RoutedCommunicator>(mpi.split(0, mpi.rank(), mpi.name()),
                                                  std::move(device), locator_);
  }
  Communicator& world() override { return *world_; }

 private:
  GuardedLocator locator_;
  GuardedCopier copier_;
  std::unique_ptr<Communicator> world_;
};

#ifdef MESHTRAIN_HAVE_NCCL
class CudaRankWorld final : public RankWorld {
 public:
  explicit CudaRankWorld(CudaWorld world) : world_(std::move(world)) {}
  Communicator& world() override { return *world_.world; }

 private:
  CudaWorld world_;
};
#endif

}  // namespace

std::unique_ptr<RankWorld> make_rank_world(Communicator& mpi_world, const TrainConfig& config,
                                           int local_size, MemoryTracker& tracker,
                                           FlightRecorder& flight) {
  const std::string& device = config.train.device;
  if (device == kHostBackend || mpi_world.size() == 1) return std::make_unique<HostWorld>(mpi_world);
  if (device == "guarded") {
    return std::make_unique<GuardedWorld>(mpi_world, config.comm.backend, tracker);
  }
#ifdef MESHTRAIN_HAVE_NCCL
  return std::make_unique<CudaRankWorld>(
      make_cuda_world(mpi_world, config.comm.backend, local_size, tracker, flight));
#else
  (void)local_size;
  (void)flight;
  fail_as(ErrorKind::resource,
          "train.device = \"{}\" with {} ranks: this build has no device communicator (NCCL's "
          "header was not found at build time, docs/gpu.md)",
          device, mpi_world.size());
#endif
}

}  // namespace meshtrain
