// Device buffers through a host communicator: each call copies its device
// inputs to host buffers, runs the host communicator's call (MPI), and copies
// the results back. What ranks that share one GPU use (NCCL refuses two ranks
// on one device, docs/gpu.md), and the fallback where NCCL is absent.
//
// Contract (communicator.h's, with these specifics):
// - Inputs are copied on the calling thread when the call is issued, so the
//   caller may reuse an input buffer as soon as the call returns.
// - Results reach the device buffers when the call's Work is waited for (or
//   the first test() that sees it complete): every call must be waited for.
// - Sequence numbers, stats, the flight recorder and the watchdog are the
//   host communicator's: a staged call is one host call.
// - Host staging buffers are tensors of category comm, held by the call until
//   it completes, in memory from the `staging` allocator (page-locked on a
//   GPU: Backend::staging_allocator). Blocks are kept for reuse after their
//   call, by power-of-two size class, shared with the communicators split
//   from this one and released with the last of them: a step's calls allocate
//   from `staging` only the first time a size class is needed at once. Kept
//   blocks are outside the tracker (as a caching allocator's free blocks);
//   reused blocks are zero-filled as new ones are.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/tensor/memory_tracker.h"
#include "meshtrain/tensor/tensor.h"

namespace meshtrain {

// Copies between the device a communicator's buffers live on and host memory,
// ordered after the device's pending work (and before its later work).
class DeviceCopier {
 public:
  virtual ~DeviceCopier() = default;
  virtual void to_host(void* host, const void* device, size_t bytes) const = 0;
  virtual void to_device(void* device, const void* host, size_t bytes) const = 0;
};

class StagedCommunicator final : public Communicator {
 public:
  // `copier`, `tracker` and `staging` must outlive this communicator.
  StagedCommunicator(std::unique_ptr<Communicator> host, const DeviceCopier& copier,
                     MemoryTracker& tracker, const Allocator& staging = host_allocator());

  int rank() const override { return host_->rank(); }
  int size() const override { return host_->size(); }
  const std::string& name() const override { return host_->name(); }

  Work all_reduce_async(void* data, int64_t count, CommDType dtype, ReduceOp op) override;
  Work reduce_scatter_async(const void* send, void* recv, std::span<const int64_t> counts,
                            CommDType dtype, ReduceOp op) override;
  Work all_gather_async(const void* send, void* recv, std::span<const int64_t> counts,
                        CommDType dtype) override;
  Work broadcast_async(void* data, int64_t count, CommDType dtype, int root) override;
  Work all_to_all_async(const void* send, std::span<const int64_t> send_counts, void* recv,
                        std::span<const int64_t> recv_counts, CommDType dtype) override;
  Work send_async(const void* data, int64_t count, CommDType dtype, int peer, int tag) override;
  Work recv_async(void* data, int64_t count, CommDType dtype, int peer, int tag) override;
  Work send_recv_async(std::vector<P2POp> ops) override;
  Work barrier_async() override { return host_->barrier_async(); }
  std::unique_ptr<Communicator> split(int color, int key, std::string name) override;

  CommStats stats() const override { return host_->stats(); }
  std::vector<CallRecord> recent_calls() const override { return host_->recent_calls(); }
  uint64_t calls_issued() const override { return host_->calls_issued(); }

 private:
  StagedCommunicator(std::unique_ptr<Communicator> host, const DeviceCopier& copier,
                     MemoryTracker& tracker, std::shared_ptr<const Allocator> pool);
  // A comm tensor of at least `bytes` from the pool.
  Tensor stage_buffer(size_t bytes) const;

  std::unique_ptr<Communicator> host_;
  const DeviceCopier& copier_;
  MemoryTracker& tracker_;
  std::shared_ptr<const Allocator> pool_;
};

}  // namespace meshtrain
