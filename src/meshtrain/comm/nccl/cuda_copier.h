// The DeviceCopier of a CUDA device (comm/staged.h): what ranks sharing one
// GPU use to run their collectives through MPI on the host. A copy to the host
// waits for the compute stream's work first (it must see what the kernels
// before the call wrote); a copy back is made on the compute stream and waited
// for (the host buffer is released right after).
#pragma once

#include <cuda_runtime_api.h>

#include "meshtrain/comm/staged.h"

namespace meshtrain {

class CudaCopier final : public DeviceCopier {
 public:
  CudaCopier(int device, cudaStream_t compute) : device_(device), compute_(compute) {}
  void to_host(void* host, const void* device, size_t bytes) const override;
  void to_device(void* device, const void* host, size_t bytes) const override;

 private:
  int device_;
  cudaStream_t compute_;
};

}  // namespace meshtrain
