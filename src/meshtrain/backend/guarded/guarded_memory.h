// Device memory the host cannot touch, on the CPU: what the "guarded" backend
// (guarded_backend.h) allocates its tensors in. Every block is its own
// mapping, inaccessible (PROT_NONE) except while a GuardedMemory::Open is
// alive: the backend's operations, its copies to and from the host, and the
// allocator's own fills and copies open it. Host code that reads or writes a
// tensor any other way faults, and the fault handler names it: one line
// "guarded backend: host access to device memory at <address> (a block of N
// bytes)" and the stack on stderr, then the process aborts. What a GPU would
// do to such code (a segfault or garbage), made visible on every CPU run.
//
// Contract:
// - Open nests and is process-wide (any thread); a block allocated while
//   open is accessible until the outermost Open closes.
// - contains() answers for any address (a communicator's MemoryLocator).
#pragma once

#include <cstddef>
#include <map>
#include <mutex>

#include "meshtrain/tensor/tensor.h"

namespace meshtrain::guarded {

class GuardedMemory final : public Allocator {
 public:
  static GuardedMemory& instance();

  // While alive, every block is readable and writable.
  class Open {
   public:
    Open();
    ~Open();
    Open(const Open&) = delete;
    Open& operator=(const Open&) = delete;
  };

  Device device() const override { return {DeviceKind::guarded, 0}; }
  void* allocate(size_t bytes) const override;
  void release(void* data, size_t bytes) const override;
  void fill_zero(void* data, size_t bytes) const override;
  void copy(DType from, const void* src, DType to, void* dst, size_t n) const override;

  // Whether `data` lies in a live block.
  bool contains(const void* data) const;
  // The fault handler's lookup: the block holding `data` ({nullptr, 0} if
  // none, or if another thread holds the lock: it never waits).
  std::pair<const char*, size_t> block_of_in_handler(const void* data) const;

 private:
  GuardedMemory();
  std::pair<const char*, size_t> find(const void* data) const;  // with mutex_ held
  void protect_all(int protection) const;  // with mutex_ held

  mutable std::mutex mutex_;
  mutable std::map<char*, size_t> blocks_;  // start -> mapped bytes
  mutable int open_ = 0;
};

}  // namespace meshtrain::guarded
