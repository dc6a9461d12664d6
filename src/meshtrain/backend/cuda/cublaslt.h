// cuBLASLt, loaded when the first CUDA backend needs it rather than linked
// (library.h: the library is half a gigabyte, and mapping it cost every
// meshtrain process ~90 ms at start-up, CPU runs included). Searched as
// $MESHTRAIN_CUBLASLT (a file), then libcublasLt.so.<major> on the loader's
// path, then in the toolkit's library folder this build was configured with.
#pragma once

#include <cublasLt.h>

namespace meshtrain::cuda {

struct CublasLt {
  decltype(&cublasLtCreate) create;
  decltype(&cublasLtDestroy) destroy;
  decltype(&cublasLtMatmul) matmul;
  decltype(&cublasLtMatmulAlgoGetHeuristic) heuristic;
  decltype(&cublasLtMatmulDescCreate) desc_create;
  decltype(&cublasLtMatmulDescDestroy) desc_destroy;
  decltype(&cublasLtMatmulDescSetAttribute) desc_set;
  decltype(&cublasLtMatmulPreferenceCreate) preference_create;
  decltype(&cublasLtMatmulPreferenceDestroy) preference_destroy;
  decltype(&cublasLtMatmulPreferenceSetAttribute) preference_set;
  decltype(&cublasLtMatrixLayoutCreate) layout_create;
  decltype(&cublasLtMatrixLayoutDestroy) layout_destroy;
  decltype(&cublasLtMatrixLayoutSetAttribute) layout_set;
  decltype(&cublasLtGetVersion) version;
};

// Loads the library once; throws Error (resource) naming what was tried.
const CublasLt& cublaslt();

}  // namespace meshtrain::cuda
