// One communicator over two: calls on host memory go to a host communicator
// (MPI), calls on device memory to a device one (NCCL, or host staging). What
// a rank whose tensors live on a GPU runs: gradients, activations and routed
// tokens move between devices, the loss sums, guard votes, checkpoint
// barriers and text the engine keeps on the host move through MPI. PyTorch
// keeps gloo beside NCCL for the same reason ("cpu:gloo,cuda:nccl").
//
// Contract (communicator.h's, with these specifics):
// - A call goes where its buffers are, as the MemoryLocator says. A null
//   buffer is in no memory; every other buffer of one call must be in the same
//   memory, else the call throws Error naming it before anything is issued. A
//   call with no non-null buffer goes to the device side (an empty tensor's
//   part on one rank); barrier() goes to the host side. So a host call must
//   pass a non-null buffer on every member, as a host vector does once it
//   holds an element.
// - Each side keeps its own order, sequence numbers, flight recorder records
//   and watchdog deadlines under its own name (the device side's is
//   "<name>.device"): a hang names the side and its call. A call on one side
//   never waits for the other side's calls.
// - stats() and calls_issued() add the two sides; recent_calls() holds both,
//   by submit time. split() splits the host side, then the device side, and
//   routes the pair alike.
#pragma once

#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "meshtrain/comm/communicator.h"

namespace meshtrain {

// Where a buffer lives, as a communicator moving it needs to know.
enum class MemorySide : uint8_t { none, host, device };

class MemoryLocator {
 public:
  virtual ~MemoryLocator() = default;
  // none for nullptr; host or device for any other address.
  virtual MemorySide side(const void* data) const = 0;
};

class RoutedCommunicator final : public Communicator {
 public:
  // Both sides over the same members in the same rank order; `locator`
  // outlives this communicator.
  RoutedCommunicator(std::unique_ptr<Communicator> host, std::unique_ptr<Communicator> device,
                     const MemoryLocator& locator);

  // The device side's name for a group called `name`.
  static std::string device_name(const std::string& name) { return name + ".device"; }

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

  CommStats stats() const override;
  std::vector<CallRecord> recent_calls() const override;
  uint64_t calls_issued() const override;

  Communicator& host() { return *host_; }
  Communicator& device() { return *device_; }

 private:
  // The side every non-null buffer of call `call` is on.
  Communicator& side(std::string_view call, std::span<const void* const> buffers);
  Communicator& side(std::string_view call, std::initializer_list<const void*> buffers) {
    return side(call, std::span(buffers.begin(), buffers.size()));
  }

  std::unique_ptr<Communicator> host_, device_;
  const MemoryLocator& locator_;
};

}  // namespace meshtrain
