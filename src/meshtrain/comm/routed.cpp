#include "meshtrain/comm/routed.h"

#include <algorithm>
#include <utility>

#include "meshtrain/util/error.h"

namespace meshtrain {

RoutedCommunicator::RoutedCommunicator(std::unique_ptr<Communicator> host,
                                       std::unique_ptr<Communicator> device,
                                       const MemoryLocator& locator)
    : host_(std::move(host)), device_(std::move(device)), locator_(locator) {
  MESHTRAIN_CHECK(host_->size() == device_->size() && host_->rank() == device_->rank(),
                  "comm {}: the device side {} is rank {} of {}, the host side rank {} of {}",
                  host_->name(), device_->name(), device_->rank(), device_->size(),
                  host_->rank(), host_->size());
}

Communicator& RoutedCommunicator::side(std::string_view call,
                                       std::span<const void* const> buffers) {
  MemorySide where = MemorySide::none;
  for (const void* buffer : buffers) {
    const MemorySide s = locator_.side(buffer);
    if (s == MemorySide::none) continue;
    MESHTRAIN_CHECK(where == MemorySide::none || where == s,
                    "comm {}: {}: one buffer is in host memory and another in device memory",
                    name(), call);
    where = s;
  }
  return where == MemorySide::host ? *host_ : *device_;
}

Work RoutedCommunicator::all_reduce_async(void* data, int64_t count, CommDType dtype,
                                          ReduceOp op) {
  return side("all_reduce", {data}).all_reduce_async(data, count, dtype, op);
}

Work RoutedCommunicator::reduce_scatter_async(const void* send, void* recv,
                                              std::span<const int64_t> counts, CommDType dtype,
                                              ReduceOp op) {
  return side("reduce_scatter", {send, recv}).reduce_scatter_async(send, recv, counts, dtype, op);
}

Work RoutedCommunicator::all_gather_async(const void* send, void* recv,
                                          std::span<const int64_t> counts, CommDType dtype) {
  return side("all_gather", {send, recv}).all_gather_async(send, recv, counts, dtype);
}

Work RoutedCommunicator::broadcast_async(void* data, int64_t count, CommDType dtype, int root) {
  return side("broadcast", {data}).broadcast_async(data, count, dtype, root);
}

Work RoutedCommunicator::all_to_all_async(const void* send, std::span<const int64_t> send_counts,
                                          void* recv, std::span<const int64_t> recv_counts,
                                          CommDType dtype) {
  return side("all_to_all", {send, recv})
      .all_to_all_async(send, send_counts, recv, recv_counts, dtype);
}

Work RoutedCommunicator::send_async(const void* data, int64_t count, CommDType dtype, int peer,
                                    int tag) {
  return side("send", {data}).send_async(data, count, dtype, peer, tag);
}

Work RoutedCommunicator::recv_async(void* data, int64_t count, CommDType dtype, int peer,
                                    int tag) {
  return side("recv", {data}).recv_async(data, count, dtype, peer, tag);
}

Work RoutedCommunicator::send_recv_async(std::vector<P2POp> ops) {
  std::vector<const void*> buffers;
  for (const P2POp& op : ops) buffers.push_back(op.data);
  return side("send_recv", buffers).send_recv_async(std::move(ops));
}

std::unique_ptr<Communicator> RoutedCommunicator::split(int color, int key, std::string name) {
  std::unique_ptr<Communicator> host = host_->split(color, key, name);
  std::unique_ptr<Communicator> device = device_->split(color, key, device_name(name));
  if (!host) return nullptr;
  return std::make_unique<RoutedCommunicator>(std::move(host), std::move(device), locator_);
}

CommStats RoutedCommunicator::stats() const {
  CommStats sum = host_->stats();
  const CommStats device = device_->stats();
  for (size_t i = 0; i < kCommOps; ++i) {
    sum.ops[i].calls += device.ops[i].calls;
    sum.ops[i].bytes += device.ops[i].bytes;
    sum.ops[i].busy_seconds += device.ops[i].busy_seconds;
  }
  return sum;
}

std::vector<CallRecord> RoutedCommunicator::recent_calls() const {
  std::vector<CallRecord> calls = host_->recent_calls();
  const std::vector<CallRecord> device = device_->recent_calls();
  calls.insert(calls.end(), device.begin(), device.end());
  std::stable_sort(calls.begin(), calls.end(), [](const CallRecord& a, const CallRecord& b) {
    return a.submitted < b.submitted;
  });
  return calls;
}

uint64_t RoutedCommunicator::calls_issued() const {
  return host_->calls_issued() + device_->calls_issued();
}

}  // namespace meshtrain
