// GEMMs through cuBLASLt: ops::MatmulDims (row-major, as the CPU backend
// takes them) mapped onto cuBLASLt's column-major operations, with the
// descriptors, layouts and the heuristic's algorithm made once per shape and
// kept. f32 accumulation whatever the inputs; bias through cuBLASLt's bias
// epilogue (f32).
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <map>
#include <tuple>

#include "meshtrain/backend/ops.h"

namespace meshtrain::cuda {

// The workspace every cuBLASLt call may use (NVIDIA recommends 32 MiB on Hopper).
inline constexpr size_t kGemmWorkspace = size_t{32} << 20;

class Gemms {
 public:
  // workspace: kGemmWorkspace bytes of device memory that outlives this object.
  Gemms(cudaStream_t stream, void* workspace);
  ~Gemms();
  Gemms(const Gemms&) = delete;
  Gemms& operator=(const Gemms&) = delete;

  // accumulate: C is read from `c_in` when given (cuBLASLt's C and D apart), else from c.
  void run(const ops::MatmulDims& dims, DType ab, const void* a, const void* b, DType c_dtype,
           void* c, float alpha, bool accumulate, const float* bias,
           const void* c_in = nullptr);

  // The plan for `dims` without running it: descriptors, layouts and an
  // algorithm the heuristic accepts (throws Error naming the shape if none).
  void prepare(const ops::MatmulDims& dims, DType ab, DType c_dtype, bool accumulate, bool bias);

 private:
  using Key = std::tuple<int64_t, int64_t, int64_t, int64_t, bool, bool, bool, int64_t, int64_t,
                         int64_t, DType, DType, bool, bool>;
  struct Plan {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };
  Plan& plan(const ops::MatmulDims& dims, DType ab, DType c_dtype, bool accumulate, bool bias);

  cudaStream_t stream_;
  void* workspace_;
  cublasLtHandle_t handle_ = nullptr;
  std::map<Key, Plan> plans_;
};

}  // namespace meshtrain::cuda
