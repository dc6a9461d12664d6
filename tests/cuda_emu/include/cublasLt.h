// The cuBLASLt types the CUDA backend's headers name, for tests/cuda_emu: the
// emulated backend's GEMMs are the CPU backend's (gemms_emu.cpp), so nothing
// of cuBLASLt runs.
#pragma once

#include <cstdint>

enum cublasStatus_t { CUBLAS_STATUS_SUCCESS = 0 };
struct cublasLtContext;
using cublasLtHandle_t = cublasLtContext*;
struct cublasLtMatmulDescOpaque_t;
using cublasLtMatmulDesc_t = cublasLtMatmulDescOpaque_t*;
struct cublasLtMatrixLayoutOpaque_t;
using cublasLtMatrixLayout_t = cublasLtMatrixLayoutOpaque_t*;
struct cublasLtMatmulAlgo_t {
  uint64_t data[8];
};
