#include "meshtrain/comm/nccl/cuda_copier.h"

#include "meshtrain/backend/cuda/runtime.h"

namespace meshtrain {

void CudaCopier::to_host(void* host, const void* device, size_t bytes) const {
  cuda::check(cudaSetDevice(device_), "cudaSetDevice");
  cuda::check(cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, compute_),
              "cudaMemcpyAsync (staging to the host)");
  cuda::check(cudaStreamSynchronize(compute_), "cudaStreamSynchronize");
}

void CudaCopier::to_device(void* device, const void* host, size_t bytes) const {
  cuda::check(cudaSetDevice(device_), "cudaSetDevice");
  cuda::check(cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, compute_),
              "cudaMemcpyAsync (staging to the device)");
  cuda::check(cudaStreamSynchronize(compute_), "cudaStreamSynchronize");
}

}  // namespace meshtrain
