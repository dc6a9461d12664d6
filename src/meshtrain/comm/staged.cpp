#include "meshtrain/comm/staged.h"

#include <bit>
#include <functional>
#include <map>
#include <mutex>
#include <numeric>
#include <utility>
#include <vector>

#include "meshtrain/tensor/tensor.h"
#include "meshtrain/util/error.h"

namespace meshtrain {
namespace {

// A call's host buffers, and what lands its results on the device, once.
class StagedWork final : public Work::State {
 public:
  StagedWork(Work inner, std::vector<Tensor> buffers, std::function<void()> land)
      : inner_(std::move(inner)), buffers_(std::move(buffers)), land_(std::move(land)) {}
  void wait() override {
    inner_.wait();
    land();
  }
  bool test() override {
    if (!inner_.test()) return false;
    land();
    return true;
  }
  CallRecord record() const override { return inner_.record(); }

 private:
  void land() {
    std::call_once(once_, [&] {
      if (land_) land_();
      buffers_.clear();
    });
  }
  Work inner_;
  std::vector<Tensor> buffers_;
  std::function<void()> land_;
  std::once_flag once_;
};

Work staged(Work inner, std::vector<Tensor> buffers, std::function<void()> land = {}) {
  const uint64_t seq = inner.seq();
  return Work(std::make_shared<StagedWork>(std::move(inner), std::move(buffers), std::move(land)),
              seq);
}

size_t bytes_of(int64_t count, CommDType dtype) {
  return static_cast<size_t>(count) * comm_dtype_size(dtype);
}

// The staging allocator's blocks kept for reuse: each request rounded up to a
// power of two (at least 4 KiB), released blocks kept per size and handed out
// again, zero-filled, before the staging allocator is asked for more. A call's
// buffers are released by whichever thread lands it, hence the lock.
class StagingPool final : public Allocator {
 public:
  explicit StagingPool(const Allocator& staging) : staging_(staging) {}
  ~StagingPool() override {
    for (auto& [size, blocks] : free_) {
      for (void* block : blocks) staging_.release(block, size);
    }
  }
  Device device() const override { return staging_.device(); }
  void* allocate(size_t bytes) const override {
    const size_t size = size_class(bytes);
    {
      const std::lock_guard lock(mutex_);
      std::vector<void*>& blocks = free_[size];
      if (!blocks.empty()) {
        void* block = blocks.back();
        blocks.pop_back();
        staging_.fill_zero(block, size);
        return block;
      }
    }
    return staging_.allocate(size);
  }
  void release(void* data, size_t bytes) const override {
    const std::lock_guard lock(mutex_);
    free_[size_class(bytes)].push_back(data);
  }
  void fill_zero(void* data, size_t bytes) const override { staging_.fill_zero(data, bytes); }
  void copy(DType from, const void* src, DType to, void* dst, size_t n) const override {
    staging_.copy(from, src, to, dst, n);
  }

 private:
  static size_t size_class(size_t bytes) { return std::bit_ceil(std::max<size_t>(bytes, 4096)); }
  const Allocator& staging_;
  mutable std::mutex mutex_;
  mutable std::map<size_t, std::vector<void*>> free_;
};

char* at(const Tensor& buffer, int64_t count, CommDType dtype) {
  return static_cast<char*>(buffer.raw()) + bytes_of(count, dtype);
}

}  // namespace

StagedCommunicator::StagedCommunicator(std::unique_ptr<Communicator> host,
                                       const DeviceCopier& copier, MemoryTracker& tracker,
                                       const Allocator& staging)
    : StagedCommunicator(std::move(host), copier, tracker,
                         std::make_shared<const StagingPool>(staging)) {}

StagedCommunicator::StagedCommunicator(std::unique_ptr<Communicator> host,
                                       const DeviceCopier& copier, MemoryTracker& tracker,
                                       std::shared_ptr<const Allocator> pool)
    : host_(std::move(host)), copier_(copier), tracker_(tracker), pool_(std::move(pool)) {}

Tensor StagedCommunicator::stage_buffer(size_t bytes) const {
  return Tensor({static_cast<int64_t>(std::max<size_t>((bytes + 3) / 4, 1))}, DType::i32,
                MemCategory::comm, tracker_, *pool_);
}

Work StagedCommunicator::all_reduce_async(void* data, int64_t count, CommDType dtype, ReduceOp op) {
  check_reduce(*this, "all_reduce", dtype, op);
  MESHTRAIN_CHECK(count >= 0, "comm {}: all_reduce: negative count {}", name(), count);
  const size_t bytes = bytes_of(count, dtype);
  Tensor buffer = stage_buffer(bytes);
  void* host = buffer.raw();
  copier_.to_host(host, data, bytes);
  Work inner = host_->all_reduce_async(host, count, dtype, op);
  return staged(std::move(inner), {std::move(buffer)},
                [this, data, host, bytes] { copier_.to_device(data, host, bytes); });
}

Work StagedCommunicator::reduce_scatter_async(const void* send, void* recv,
                                              std::span<const int64_t> counts, CommDType dtype,
                                              ReduceOp op) {
  check_counts(*this, "reduce_scatter", counts);
  const size_t total = bytes_of(sum_of(counts), dtype);
  const size_t mine = bytes_of(counts[static_cast<size_t>(rank())], dtype);
  Tensor in = stage_buffer(total), out = stage_buffer(mine);
  copier_.to_host(in.raw(), send, total);
  void* host = out.raw();
  Work inner = host_->reduce_scatter_async(in.raw(), host, counts, dtype, op);
  return staged(std::move(inner), {std::move(in), std::move(out)},
                [this, recv, host, mine] { copier_.to_device(recv, host, mine); });
}

Work StagedCommunicator::all_gather_async(const void* send, void* recv,
                                          std::span<const int64_t> counts, CommDType dtype) {
  check_counts(*this, "all_gather", counts);
  const auto r = static_cast<size_t>(rank());
  const int64_t offset = std::accumulate(counts.begin(), counts.begin() + static_cast<int64_t>(r),
                                         int64_t{0});
  const size_t total = bytes_of(sum_of(counts), dtype);
  Tensor out = stage_buffer(total);
  char* own = at(out, offset, dtype);
  copier_.to_host(own, send, bytes_of(counts[r], dtype));  // send may be recv's own part
  void* host = out.raw();
  Work inner = host_->all_gather_async(own, host, counts, dtype);
  return staged(std::move(inner), {std::move(out)},
                [this, recv, host, total] { copier_.to_device(recv, host, total); });
}

Work StagedCommunicator::broadcast_async(void* data, int64_t count, CommDType dtype, int root) {
  check_peer(*this, "broadcast", root, "root");
  MESHTRAIN_CHECK(count >= 0, "comm {}: broadcast: negative count {}", name(), count);
  const size_t bytes = bytes_of(count, dtype);
  Tensor buffer = stage_buffer(bytes);
  void* host = buffer.raw();
  const bool receiver = rank() != root;
  if (!receiver) copier_.to_host(host, data, bytes);
  Work inner = host_->broadcast_async(host, count, dtype, root);
  return staged(std::move(inner), {std::move(buffer)}, [this, data, host, bytes, receiver] {
    if (receiver) copier_.to_device(data, host, bytes);
  });
}

Work StagedCommunicator::all_to_all_async(const void* send, std::span<const int64_t> send_counts,
                                          void* recv, std::span<const int64_t> recv_counts,
                                          CommDType dtype) {
  check_counts(*this, "all_to_all", send_counts);
  check_counts(*this, "all_to_all", recv_counts);
  const size_t out_bytes = bytes_of(sum_of(send_counts), dtype);
  const size_t in_bytes = bytes_of(sum_of(recv_counts), dtype);
  Tensor out = stage_buffer(out_bytes), in = stage_buffer(in_bytes);
  copier_.to_host(out.raw(), send, out_bytes);
  void* host = in.raw();
  Work inner = host_->all_to_all_async(out.raw(), send_counts, host, recv_counts, dtype);
  return staged(std::move(inner), {std::move(out), std::move(in)},
                [this, recv, host, in_bytes] { copier_.to_device(recv, host, in_bytes); });
}

Work StagedCommunicator::send_async(const void* data, int64_t count, CommDType dtype, int peer,
                                    int tag) {
  check_peer(*this, "send", peer, "peer");
  MESHTRAIN_CHECK(count >= 0, "comm {}: send: negative count {}", name(), count);
  Tensor buffer = stage_buffer(bytes_of(count, dtype));
  copier_.to_host(buffer.raw(), data, bytes_of(count, dtype));
  Work inner = host_->send_async(buffer.raw(), count, dtype, peer, tag);
  return staged(std::move(inner), {std::move(buffer)});
}

Work StagedCommunicator::recv_async(void* data, int64_t count, CommDType dtype, int peer, int tag) {
  check_peer(*this, "recv", peer, "peer");
  MESHTRAIN_CHECK(count >= 0, "comm {}: recv: negative count {}", name(), count);
  const size_t bytes = bytes_of(count, dtype);
  Tensor buffer = stage_buffer(bytes);
  void* host = buffer.raw();
  Work inner = host_->recv_async(host, count, dtype, peer, tag);
  return staged(std::move(inner), {std::move(buffer)},
                [this, data, host, bytes] { copier_.to_device(data, host, bytes); });
}

Work StagedCommunicator::send_recv_async(std::vector<P2POp> ops) {
  struct Landing {
    void* device;
    const void* host;
    size_t bytes;
  };
  std::vector<Tensor> buffers;
  std::vector<Landing> landings;
  for (P2POp& op : ops) {
    MESHTRAIN_CHECK(op.count >= 0, "comm {}: send_recv: negative count {}", name(), op.count);
    const size_t bytes = bytes_of(op.count, op.dtype);
    buffers.push_back(stage_buffer(bytes));
    void* host = buffers.back().raw();
    if (op.send) {
      copier_.to_host(host, op.data, bytes);
    } else {
      landings.push_back({op.data, host, bytes});
    }
    op.data = host;
  }
  Work inner = host_->send_recv_async(std::move(ops));
  return staged(std::move(inner), std::move(buffers), [this, landings = std::move(landings)] {
    for (const Landing& l : landings) copier_.to_device(l.device, l.host, l.bytes);
  });
}

std::unique_ptr<Communicator> StagedCommunicator::split(int color, int key, std::string name) {
  std::unique_ptr<Communicator> sub = host_->split(color, key, std::move(name));
  if (!sub) return nullptr;
  return std::unique_ptr<Communicator>(new StagedCommunicator(std::move(sub), copier_, tracker_, pool_));
}

}  // namespace meshtrain
