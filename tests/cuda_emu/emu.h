// The CUDA execution model on the CPU, for tests: a .cu file of the CUDA
// backend, rewritten by tests/cuda_emu.cmake (launches `k<<<g, b, s, st>>>(…)`
// become `::emu::launch(k, g, b, s, st)(…)`, and `extern __shared__` a call
// for the launch's dynamic shared memory), compiles with the host compiler
// against this header, and its launchers run each kernel here, with host
// pointers for device memory.
//
// A launch runs its blocks one after another. A block's threads are fibers
// (made with ucontext, switched with _setjmp / _longjmp) on the calling
// thread, each running until it waits at a barrier: __syncthreads waits for the whole block, and __shfl_down_sync for
// the thread's warp (two waits around an exchange through a per-thread slot).
// A barrier opens when every thread it waits for has arrived.
//
// Blocks running one at a time make `static` a valid stand-in for
// __shared__. The dynamic shared memory is filled with NaN before each block,
// so reading it unwritten shows in the results. A barrier that some threads
// leave the kernel without reaching (the hang or undefined behaviour of a
// real launch) is an Error naming the kernel's launch.
//
// It checks what the kernels compute: their indices, masks, barriers and
// reductions. It does not check their speed, the hardware's memory model
// (no data race can occur), or anything that needs a device.
//
// Under AddressSanitizer every switch is announced with its fiber
// annotations, so each fiber and the scheduler keep their own fake stack
// (detect_stack_use_after_return). Without them ASan's one fake stack per OS
// thread reclaims a suspended fiber's frames when the scheduler's are made, and
// reports a kernel's reads of its own parameters as use after return.
#pragma once

#include <setjmp.h>
#include <ucontext.h>
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

// ---- the runtime API the backend calls, on host memory: one emulated device
// whose streams run everything at once (so synchronizing is a no-op). These
// are C++ functions (the real ones are extern "C"), so a test links beside
// the real runtime.
struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct CUstream_st;
using cudaStream_t = CUstream_st*;
struct CUevent_st;
using cudaEvent_t = CUevent_st*;
enum cudaError_t { cudaSuccess = 0, cudaErrorMemoryAllocation = 2 };
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
enum cudaDeviceAttr { cudaDevAttrMaxSharedMemoryPerBlockOptin = 97 };
enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3
};
inline constexpr unsigned cudaStreamNonBlocking = 1;
struct cudaDeviceProp {
  char name[256] = "emulated CUDA device (tests/cuda_emu)";
  int major = 9, minor = 0;
  size_t totalGlobalMem = size_t{1} << 34;
};
namespace emu {
// What a device of compute capability 9.0 allows a block (227 KiB).
inline constexpr int kSharedOptin = 227 * 1024;
}  // namespace emu

inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline const char* cudaGetErrorString(cudaError_t e) {
  return e == cudaSuccess ? "no error" : "out of memory";
}
inline const char* cudaGetErrorName(cudaError_t e) {
  return e == cudaSuccess ? "cudaSuccess" : "cudaErrorMemoryAllocation";
}
template <typename Kernel>
cudaError_t cudaFuncSetAttribute(Kernel, cudaFuncAttribute, int) {
  return cudaSuccess;
}
inline cudaError_t cudaGetDeviceCount(int* count) {
  *count = 1;
  return cudaSuccess;
}
inline cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
inline cudaError_t cudaSetDevice(int) { return cudaSuccess; }
inline cudaError_t cudaGetDeviceProperties(cudaDeviceProp* props, int) {
  *props = cudaDeviceProp{};
  return cudaSuccess;
}
inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr, int) {
  *value = emu::kSharedOptin;
  return cudaSuccess;
}
inline cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned) {
  static char streams[16];
  static unsigned next = 0;
  *stream = reinterpret_cast<cudaStream_t>(&streams[next++ % 16]);
  return cudaSuccess;
}
inline cudaError_t cudaStreamCreate(cudaStream_t* stream) { return cudaStreamCreateWithFlags(stream, 0); }
inline cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
inline cudaError_t cudaMalloc(void** p, size_t bytes) {
  *p = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
  return *p != nullptr ? cudaSuccess : cudaErrorMemoryAllocation;
}
inline cudaError_t cudaFree(void* p) {
  std::free(p);
  return cudaSuccess;
}
// Page-locked host memory: plain host memory here, its live allocations counted.
inline constexpr unsigned cudaHostAllocDefault = 0;
namespace emu {
inline std::atomic<int64_t> pinned_blocks{0};  // live cudaHostAlloc blocks
inline std::atomic<int64_t> pinned_made{0};    // every one made
}  // namespace emu
inline cudaError_t cudaHostAlloc(void** p, size_t bytes, unsigned) {
  *p = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
  if (*p == nullptr) return cudaErrorMemoryAllocation;
  ++emu::pinned_blocks;
  ++emu::pinned_made;
  return cudaSuccess;
}
inline cudaError_t cudaFreeHost(void* p) {
  std::free(p);
  --emu::pinned_blocks;
  return cudaSuccess;
}
inline cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t = nullptr) {
  std::memset(p, value, bytes);
  return cudaSuccess;
}
inline cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind,
                                   cudaStream_t = nullptr) {
  if (bytes > 0) std::memmove(dst, src, bytes);
  return cudaSuccess;
}
inline cudaError_t cudaMemcpy2DAsync(void* dst, size_t dpitch, const void* src, size_t spitch,
                                     size_t width, size_t height, cudaMemcpyKind,
                                     cudaStream_t = nullptr) {
  for (size_t r = 0; r < height; ++r)
    std::memmove(static_cast<char*>(dst) + r * dpitch, static_cast<const char*>(src) + r * spitch,
                 width);
  return cudaSuccess;
}
// Events time nothing here: every interval is 1 ms.
inline cudaError_t cudaEventCreate(cudaEvent_t* event) {
  static char events[16];
  static unsigned next = 0;
  *event = reinterpret_cast<cudaEvent_t>(&events[next++ % 16]);
  return cudaSuccess;
}
inline cudaError_t cudaEventRecord(cudaEvent_t, cudaStream_t = nullptr) { return cudaSuccess; }
inline cudaError_t cudaEventSynchronize(cudaEvent_t) { return cudaSuccess; }
inline cudaError_t cudaEventDestroy(cudaEvent_t) { return cudaSuccess; }
inline cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t, cudaEvent_t) {
  *ms = 1.0f;
  return cudaSuccess;
}

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static

namespace emu {

inline constexpr int kWarp = 32;
inline constexpr size_t kStackBytes = 64 * 1024;

// What a block's thread is doing between the scheduler's turns.
enum class State : unsigned char { ready, at_warp_barrier, at_block_barrier, done };

// Where a suspended fiber (or the scheduler) continues.
struct Resume {
  jmp_buf at;
};

// The launch being run: the block's fibers and what its threads see. A fiber
// lives for the whole launch and runs the kernel once per block.
struct Launch {
  dim3 grid, block, thread_idx, block_idx;
  std::vector<ucontext_t> fibers;  // only to enter each fiber the first time
  std::vector<std::unique_ptr<char[]>> stacks;
  std::vector<Resume> resume;
  std::vector<bool> started;
  std::vector<State> state;
  std::vector<double> slots;    // one value per thread for the warp shuffles
  std::vector<double> dynamic;  // the dynamic shared memory, 8-byte aligned
  Resume scheduler;
  ucontext_t scheduler_context{};
  unsigned current = 0;
  std::function<void()> body;
  // AddressSanitizer's view of the switches (leaving / arrived): each fiber's
  // saved fake stack, the scheduler's, and the scheduler's stack.
  std::vector<void*> fiber_fake;
  void* scheduler_fake = nullptr;
  const void* scheduler_bottom = nullptr;
  size_t scheduler_size = 0;
  bool finishing = false;  // the fibers' last turn: they hand their fake stacks back
};

// The switches announced to AddressSanitizer: leaving() before leaving for the
// stack [bottom, bottom + size), `save` keeping the leaving side's fake stack
// (nullptr: it never comes back, ASan frees it); arrived() on arriving, with
// what this side kept when it left (nullptr the first time), from_* receiving
// the stack it came from. Without ASan they do nothing.
#if defined(__SANITIZE_ADDRESS__)
inline constexpr bool kAnnounceSwitches = true;
inline void leaving(void** save, const void* bottom, size_t size) {
  __sanitizer_start_switch_fiber(save, bottom, size);
}
inline void arrived(void* saved, const void** from_bottom, size_t* from_size) {
  __sanitizer_finish_switch_fiber(saved, from_bottom, from_size);
}
#else
inline constexpr bool kAnnounceSwitches = false;
inline void leaving(void**, const void*, size_t) {}
inline void arrived(void*, const void**, size_t*) {}
#endif

// The launch this OS thread is running (launches on other threads are their own).
inline Launch*& active() {
  static thread_local Launch* launch = nullptr;
  return launch;
}

// The calling thread waits at a barrier of its warp or of its block (or, done,
// for the next block). _setjmp / _longjmp switch fibers without the signal
// mask's system calls that swapcontext makes.
inline void wait(State at) {
  Launch& l = *active();
  l.state[l.current] = at;
  if (_setjmp(l.resume[l.current].at) == 0) {
    leaving(&l.fiber_fake[l.current], l.scheduler_bottom, l.scheduler_size);
    _longjmp(l.scheduler.at, 1);
  }
  arrived(l.fiber_fake[l.current], &l.scheduler_bottom, &l.scheduler_size);
}

inline void fiber_entry() {
  Launch& l = *active();
  arrived(nullptr, &l.scheduler_bottom, &l.scheduler_size);
  for (;;) {
    l.body();
    wait(State::done);
    if (l.finishing) {
      leaving(nullptr, l.scheduler_bottom, l.scheduler_size);
      _longjmp(l.scheduler.at, 1);
    }
  }
}

// Opens the barriers every unfinished thread of has reached (the block's, or
// a warp's); false when none opens.
inline bool open_barriers(Launch& l) {
  const unsigned n = l.block.x;
  bool opened = false;
  auto open = [&](unsigned first, unsigned end, State at) {
    bool waiting = false;
    for (unsigned i = first; i < end; ++i) {
      if (l.state[i] == State::done) continue;
      if (l.state[i] != at) return;
      waiting = true;
    }
    if (!waiting) return;
    for (unsigned i = first; i < end; ++i)
      if (l.state[i] == at) l.state[i] = State::ready;
    opened = true;
  };
  for (unsigned w = 0; w < n; w += kWarp) open(w, std::min(n, w + kWarp), State::at_warp_barrier);
  open(0, n, State::at_block_barrier);
  return opened;
}

// Runs thread l.current until it waits or finishes the block. Never inlined,
// like make_fiber: a function that returns twice (_setjmp, getcontext) gets a
// frame of its own, so no local of run() can be clobbered (-Wclobbered).
[[gnu::noinline]] inline void step(Launch& l) {
  const unsigned i = l.current;
  if (_setjmp(l.scheduler.at) != 0) {
    arrived(l.scheduler_fake, nullptr, nullptr);
    return;
  }
  leaving(&l.scheduler_fake, l.stacks[i].get(), kStackBytes);
  if (l.started[i]) _longjmp(l.resume[i].at, 1);
  l.started[i] = true;
  swapcontext(&l.scheduler_context, &l.fibers[i]);
}

// A fiber that enters fiber_entry on `stack`.
[[gnu::noinline]] inline void make_fiber(ucontext_t& fiber, char* stack) {
  getcontext(&fiber);
  fiber.uc_stack.ss_sp = stack;
  fiber.uc_stack.ss_size = kStackBytes;
  fiber.uc_link = nullptr;
  makecontext(&fiber, fiber_entry, 0);
}

// Runs `body` as every thread of every block of `grid` x `block` (1-D blocks).
inline void run(dim3 grid, dim3 block, size_t shared_bytes, const char* name,
                std::function<void()> body) {
  if (block.y != 1 || block.z != 1) throw std::logic_error("emu: only 1-D blocks");
  const unsigned n = block.x;
  Launch l;
  l.grid = grid;
  l.block = block;
  l.fibers.resize(n);
  l.fiber_fake.assign(n, nullptr);
  l.resume.resize(n);
  l.started.assign(n, false);
  l.state.resize(n);
  l.slots.resize(n);
  l.dynamic.resize((shared_bytes + sizeof(double) - 1) / sizeof(double));
  l.body = std::move(body);
  for (unsigned i = 0; i < n; ++i) {
    l.stacks.emplace_back(new char[kStackBytes]);
    make_fiber(l.fibers[i], l.stacks[i].get());
  }
  Launch* outer = active();
  active() = &l;
  for (unsigned z = 0; z < grid.z; ++z) {
    for (unsigned y = 0; y < grid.y; ++y) {
      for (unsigned x = 0; x < grid.x; ++x) {
        l.block_idx = dim3(x, y, z);
        std::fill(l.dynamic.begin(), l.dynamic.end(), std::numeric_limits<double>::quiet_NaN());
        std::fill(l.state.begin(), l.state.end(), State::ready);
        // Every ready thread runs to its next barrier or its end; then the
        // barriers that every thread they wait for has reached open.
        for (;;) {
          for (unsigned i = 0; i < n; ++i) {
            if (l.state[i] != State::ready) continue;
            l.current = i;
            l.thread_idx = dim3(i);
            step(l);
          }
          if (std::all_of(l.state.begin(), l.state.end(), [](State s) { return s == State::done; }))
            break;
          if (!open_barriers(l)) {
            active() = outer;
            throw std::runtime_error(std::string("emu: ") + name + ": block (" +
                                     std::to_string(x) + ", " + std::to_string(y) + ", " +
                                     std::to_string(z) +
                                     "): threads wait at barriers that will never open "
                                     "(some left without them, or wait at another)");
          }
        }
      }
    }
  }
  if (kAnnounceSwitches) {
    // Each fiber's last turn, so that ASan frees its fake stack.
    l.finishing = true;
    for (unsigned i = 0; i < n; ++i) {
      if (!l.started[i]) continue;
      l.current = i;
      step(l);
    }
  }
  active() = outer;
}

// What `k<<<grid, block, shared, stream>>>(args...)` becomes.
template <typename... Params>
auto launch_named(const char* name, void (*kernel)(Params...), dim3 grid, dim3 block,
                  size_t shared = 0, cudaStream_t = nullptr) {
  return [=](auto&&... args) {
    // Each thread gets its own copies of the parameters, as a kernel's are.
    run(grid, block, shared, name, [&] { kernel(args...); });
  };
}

template <typename T>
T* dynamic_shared() {
  return reinterpret_cast<T*>(active()->dynamic.data());
}

template <typename V>
V shfl_down(V v, int offset) {
  Launch& l = *active();
  const unsigned i = l.current;
  static_assert(sizeof(V) <= sizeof(double));
  std::memcpy(&l.slots[i], &v, sizeof v);
  wait(State::at_warp_barrier);
  V out = v;
  const unsigned lane = i % kWarp, source = i + static_cast<unsigned>(offset);
  if (lane + static_cast<unsigned>(offset) < kWarp && source < l.block.x) {
    std::memcpy(&out, &l.slots[source], sizeof out);
  }
  wait(State::at_warp_barrier);  // the slots are free again
  return out;
}

}  // namespace emu

#define EMU_LAUNCH(kernel, ...) ::emu::launch_named(#kernel, kernel, __VA_ARGS__)
#define threadIdx (::emu::active()->thread_idx)
#define blockIdx (::emu::active()->block_idx)
#define blockDim (::emu::active()->block)
#define gridDim (::emu::active()->grid)

inline float __fadd_rn(float a, float b) { return a + b; }  // no contraction: -ffp-contract=off
inline float __fmul_rn(float a, float b) { return a * b; }
inline void __syncthreads() { emu::wait(emu::State::at_block_barrier); }
template <typename V>
V __shfl_down_sync(unsigned /*mask*/, V v, int offset) {
  return emu::shfl_down(v, offset);
}
