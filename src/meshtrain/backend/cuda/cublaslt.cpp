#include "meshtrain/backend/cuda/cublaslt.h"

#include <fmt/format.h>

#include <mutex>

#include "meshtrain/backend/cuda/library.h"

namespace meshtrain::cuda {
namespace {

CublasLt load() {
  constexpr const char* what = "cuBLASLt";
  void* library = open_library(what, "MESHTRAIN_CUBLASLT", fmt::format("libcublasLt.so.{}", CUBLAS_VER_MAJOR));
  CublasLt api{};
  bind(library, what, "cublasLtCreate", api.create);
  bind(library, what, "cublasLtDestroy", api.destroy);
  bind(library, what, "cublasLtMatmul", api.matmul);
  bind(library, what, "cublasLtMatmulAlgoGetHeuristic", api.heuristic);
  bind(library, what, "cublasLtMatmulDescCreate", api.desc_create);
  bind(library, what, "cublasLtMatmulDescDestroy", api.desc_destroy);
  bind(library, what, "cublasLtMatmulDescSetAttribute", api.desc_set);
  bind(library, what, "cublasLtMatmulPreferenceCreate", api.preference_create);
  bind(library, what, "cublasLtMatmulPreferenceDestroy", api.preference_destroy);
  bind(library, what, "cublasLtMatmulPreferenceSetAttribute", api.preference_set);
  bind(library, what, "cublasLtMatrixLayoutCreate", api.layout_create);
  bind(library, what, "cublasLtMatrixLayoutDestroy", api.layout_destroy);
  bind(library, what, "cublasLtMatrixLayoutSetAttribute", api.layout_set);
  bind(library, what, "cublasLtGetVersion", api.version);
  return api;  // the library stays loaded for the process
}

}  // namespace

const CublasLt& cublaslt() {
  static std::once_flag once;
  static CublasLt api{};
  std::call_once(once, [] { api = load(); });
  return api;
}

}  // namespace meshtrain::cuda
