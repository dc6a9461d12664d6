// The CUDA runtime as the backend uses it: errors as meshtrain Errors, the
// device a process takes, and the caching allocator behind its tensors.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <map>
#include <mutex>
#include <string>

#include "meshtrain/backend/cuda/kernels.h"
#include "meshtrain/tensor/dtype.h"
#include "meshtrain/tensor/tensor.h"

namespace meshtrain::cuda {

// Throws Error (kind resource) "cuda: <what>: <the runtime's message>" unless ok.
void check(cudaError_t status, const char* what);
void check(cublasStatus_t status, const char* what);

// "" when this process can use a CUDA device, else why not (no driver, no device).
std::string device_unavailable();
// The device this process takes: MESHTRAIN_CUDA_DEVICE if set, else the
// launcher's local rank (OMPI_COMM_WORLD_LOCAL_RANK, SLURM_LOCALID) modulo
// the devices, else 0.
int choose_device();

// The compute stream of `device` (non-blocking, made on first use, kept for the
// process): every backend on the device runs its kernels, copies and GEMMs on
// it, and the communicators made before the backend (comm/nccl/device_world.h)
// order their calls after it.
cudaStream_t compute_stream(int device);

Elem elem(DType dtype);  // a float DType's element kind; throws for i32

// Device memory in blocks that are kept for reuse when a tensor frees them
// (rounded to 512 bytes; a freed block serves a request of up to 2x less),
// stream-ordered on the backend's one compute stream, so a block a kernel
// still uses is only handed out again behind that kernel. Allocation zero-
// fills on the stream; when cudaMalloc fails the cache is returned to the
// device and the allocation retried once, then std::bad_alloc. Tensors count
// their own bytes in the MemoryTracker (tensor.h's Storage); reserved() is
// what the device holds for them, cached blocks included.
class CachingAllocator final : public Allocator {
 public:
  CachingAllocator(int device, cudaStream_t stream) : device_(device), stream_(stream) {}
  ~CachingAllocator() override;
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  Device device() const override { return {DeviceKind::cuda, device_}; }
  void* allocate(size_t bytes) const override;
  void release(void* data, size_t bytes) const override;
  void fill_zero(void* data, size_t bytes) const override;
  void copy(DType from, const void* src, DType to, void* dst, size_t n) const override;

  size_t reserved() const;
  void empty_cache() const;  // returns every cached block to the device

 private:
  static size_t rounded(size_t bytes);
  int device_;
  cudaStream_t stream_;
  mutable std::mutex mutex_;
  mutable std::multimap<size_t, void*> free_;  // cached blocks by size
  mutable std::map<void*, size_t> sizes_;      // every block this allocator holds
};

// Page-locked host memory (cudaHostAlloc): what the device copies to and from
// at full speed, asynchronously on a stream (Backend::staging_allocator). Its
// tensors are host tensors: zeroed, copied and converted by the host.
class PinnedAllocator final : public Allocator {
 public:
  Device device() const override { return {}; }
  void* allocate(size_t bytes) const override;
  void release(void* data, size_t bytes) const override;
  void fill_zero(void* data, size_t bytes) const override;
  void copy(DType from, const void* src, DType to, void* dst, size_t n) const override;
};

}  // namespace meshtrain::cuda
