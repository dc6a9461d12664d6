#include "meshtrain/backend/guarded/guarded_memory.h"

#include <execinfo.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>

#include "meshtrain/tensor/dtype.h"
#include "meshtrain/util/error.h"

namespace meshtrain::guarded {
namespace {

size_t page_size() {
  static const size_t size = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  return size;
}

size_t mapped_bytes(size_t bytes) {
  const size_t page = page_size();
  return std::max<size_t>((bytes + page - 1) / page, 1) * page;
}

struct sigaction previous_segv {};

// SIGSEGV: name a fault inside a guarded block, then abort; any other fault
// goes to the handler that was there before.
void on_segv(int signal, siginfo_t* info, void* context) {
  const auto [start, size] = GuardedMemory::instance().block_of_in_handler(info->si_addr);
  if (start == nullptr) {
    ::sigaction(SIGSEGV, &previous_segv, nullptr);  // re-raised by the faulting instruction
    (void)signal;
    (void)context;
    return;
  }
  char line[256];
  const int n = std::snprintf(line, sizeof line,
                              "guarded backend: host access to device memory at %p (a block of "
                              "%zu bytes at %p): host code must go through the backend's ops or "
                              "copy_to_host / copy_from_host\n",
                              info->si_addr, size, static_cast<const void*>(start));
  if (n > 0) (void)!::write(STDERR_FILENO, line, static_cast<size_t>(n));
  void* frames[48];
  ::backtrace_symbols_fd(frames, ::backtrace(frames, 48), STDERR_FILENO);
  std::abort();
}

}  // namespace

GuardedMemory& GuardedMemory::instance() {
  static GuardedMemory* memory = new GuardedMemory();  // never destroyed: tensors may outlive main
  return *memory;
}

GuardedMemory::GuardedMemory() {
  struct sigaction action {};
  action.sa_sigaction = on_segv;
  action.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&action.sa_mask);
  ::sigaction(SIGSEGV, &action, &previous_segv);
}

GuardedMemory::Open::Open() {
  GuardedMemory& m = instance();
  const std::lock_guard lock(m.mutex_);
  if (m.open_++ == 0) m.protect_all(PROT_READ | PROT_WRITE);
}

GuardedMemory::Open::~Open() {
  GuardedMemory& m = instance();
  const std::lock_guard lock(m.mutex_);
  if (--m.open_ == 0) m.protect_all(PROT_NONE);
}

void GuardedMemory::protect_all(int protection) const {
  for (const auto& [start, size] : blocks_) {
    MESHTRAIN_CHECK(::mprotect(start, size, protection) == 0, "guarded backend: mprotect: {}",
                    std::strerror(errno));
  }
}

void* GuardedMemory::allocate(size_t bytes) const {
  const size_t size = mapped_bytes(bytes);
  const std::lock_guard lock(mutex_);
  const int protection = open_ > 0 ? PROT_READ | PROT_WRITE : PROT_NONE;
  void* data = ::mmap(nullptr, size, protection, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (data == MAP_FAILED) throw std::bad_alloc();  // anonymous pages start zero-filled
  blocks_.emplace(static_cast<char*>(data), size);
  return data;
}

void GuardedMemory::release(void* data, size_t) const {
  const std::lock_guard lock(mutex_);
  const auto it = blocks_.find(static_cast<char*>(data));
  MESHTRAIN_CHECK(it != blocks_.end(), "guarded backend: release of {} it did not allocate", data);
  ::munmap(it->first, it->second);
  blocks_.erase(it);
}

void GuardedMemory::fill_zero(void* data, size_t bytes) const {
  const Open open;
  std::memset(data, 0, bytes);
}

void GuardedMemory::copy(DType from, const void* src, DType to, void* dst, size_t n) const {
  const Open open;
  convert(from, src, to, dst, n);
}

std::pair<const char*, size_t> GuardedMemory::find(const void* data) const {
  if (data == nullptr) return {nullptr, 0};
  const char* p = static_cast<const char*>(data);
  auto it = blocks_.upper_bound(const_cast<char*>(p));
  if (it == blocks_.begin()) return {nullptr, 0};
  --it;
  if (p >= it->first + it->second) return {nullptr, 0};
  return {it->first, it->second};
}

std::pair<const char*, size_t> GuardedMemory::block_of_in_handler(const void* data) const {
  // try_lock: the fault may have interrupted a thread holding the mutex.
  const std::unique_lock lock(mutex_, std::try_to_lock);
  if (!lock.owns_lock()) return {nullptr, 0};
  return find(data);
}

bool GuardedMemory::contains(const void* data) const {
  const std::lock_guard lock(mutex_);
  return find(data).first != nullptr;
}

}  // namespace meshtrain::guarded
