#include "meshtrain/backend/cuda/runtime.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>

#include "meshtrain/util/error.h"

namespace meshtrain::cuda {

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    fail_as(ErrorKind::resource, "cuda: {}: {} ({})", what, cudaGetErrorString(status),
            cudaGetErrorName(status));
  }
}

void check(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    fail_as(ErrorKind::resource, "cublasLt: {}: status {}", what, static_cast<int>(status));
  }
}

std::string device_unavailable() {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    return fmt::format("no CUDA device ({})", cudaGetErrorString(status));
  }
  if (count == 0) return "no CUDA device";
  return "";
}

int choose_device() {
  int count = 0;
  check(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
  for (const char* name : {"MESHTRAIN_CUDA_DEVICE", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"}) {
    const char* value = std::getenv(name);
    if (value == nullptr || *value == '\0') continue;
    const int index = std::atoi(value);
    if (std::string_view(name) == "MESHTRAIN_CUDA_DEVICE") {
      MESHTRAIN_CHECK(index >= 0 && index < count,
                      "MESHTRAIN_CUDA_DEVICE={} but this machine has {} CUDA device(s)", index,
                      count);
      return index;
    }
    return index % count;
  }
  return 0;
}

cudaStream_t compute_stream(int device) {
  static std::mutex mutex;
  static std::map<int, cudaStream_t> streams;
  const std::lock_guard lock(mutex);
  cudaStream_t& stream = streams[device];
  if (stream == nullptr) {
    int current = 0;
    check(cudaGetDevice(&current), "cudaGetDevice");
    check(cudaSetDevice(device), "cudaSetDevice");
    check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    check(cudaSetDevice(current), "cudaSetDevice");
  }
  return stream;
}

Elem elem(DType dtype) {
  switch (dtype) {
    case DType::f32: return Elem::f32;
    case DType::bf16: return Elem::bf16;
    case DType::f16: return Elem::f16;
    case DType::i32: break;
  }
  fail("cuda: {} is not a float dtype", dtype_name(dtype));
}

CachingAllocator::~CachingAllocator() {
  // Blocks still held by tensors are the tensors' owners' to free; the cache is ours.
  empty_cache();
}

size_t CachingAllocator::rounded(size_t bytes) {
  constexpr size_t kUnit = 512;
  return bytes == 0 ? kUnit : (bytes + kUnit - 1) / kUnit * kUnit;
}

void* CachingAllocator::allocate(size_t bytes) const {
  const size_t size = rounded(bytes);
  void* data = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = free_.lower_bound(size);
    if (it != free_.end() && it->first <= 2 * size) {
      data = it->second;
      free_.erase(it);
    }
  }
  if (data == nullptr) {
    check(cudaSetDevice(device_), "cudaSetDevice");
    if (cudaMalloc(&data, size) != cudaSuccess) {
      (void)cudaGetLastError();  // clear the sticky-free error state of a failed cudaMalloc
      empty_cache();
      if (cudaMalloc(&data, size) != cudaSuccess) {
        (void)cudaGetLastError();
        throw std::bad_alloc();
      }
    }
    std::lock_guard<std::mutex> lock(mutex_);
    sizes_[data] = size;
  }
  check(cudaMemsetAsync(data, 0, size, stream_), "cudaMemsetAsync");
  return data;
}

void CachingAllocator::release(void* data, size_t) const {
  std::lock_guard<std::mutex> lock(mutex_);
  free_.emplace(sizes_.at(data), data);
}

void* PinnedAllocator::allocate(size_t bytes) const {
  void* data = nullptr;
  if (cudaHostAlloc(&data, std::max<size_t>(bytes, 1), cudaHostAllocDefault) != cudaSuccess) {
    (void)cudaGetLastError();  // clears the error for the next call
    throw std::bad_alloc();
  }
  std::memset(data, 0, bytes);
  return data;
}

void PinnedAllocator::release(void* data, size_t) const { cudaFreeHost(data); }

void PinnedAllocator::fill_zero(void* data, size_t bytes) const { std::memset(data, 0, bytes); }

void PinnedAllocator::copy(DType from, const void* src, DType to, void* dst, size_t n) const {
  convert(from, src, to, dst, n);
}

void CachingAllocator::fill_zero(void* data, size_t bytes) const {
  check(cudaMemsetAsync(data, 0, bytes, stream_), "cudaMemsetAsync");
}

void CachingAllocator::copy(DType from, const void* src, DType to, void* dst, size_t n) const {
  if (from == to) {
    check(cudaMemcpyAsync(dst, src, n * dtype_size(from), cudaMemcpyDeviceToDevice, stream_),
          "cudaMemcpyAsync");
    return;
  }
  launch_convert(stream_, elem(from), src, elem(to), dst, static_cast<int64_t>(n));
}

size_t CachingAllocator::reserved() const {
  std::lock_guard<std::mutex> lock(mutex_);
  size_t total = 0;
  for (const auto& [data, size] : sizes_) total += size;
  return total;
}

void CachingAllocator::empty_cache() const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (free_.empty()) return;
  cudaStreamSynchronize(stream_);
  for (const auto& [size, data] : free_) {
    cudaFree(data);
    sizes_.erase(data);
  }
  free_.clear();
}

}  // namespace meshtrain::cuda
