#include "meshtrain/backend/cuda/cublaslt.h"

#include <dlfcn.h>
#include <fmt/format.h>

#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "meshtrain/util/error.h"

namespace meshtrain::cuda {
namespace {

template <typename F>
void bind(void* library, const char* symbol, F& out) {
  void* address = dlsym(library, symbol);
  MESHTRAIN_CHECK_AS(ErrorKind::resource, address != nullptr, "cuBLASLt: {} not found ({})",
                     symbol, dlerror());
  out = reinterpret_cast<F>(address);
}

CublasLt load() {
  const std::string soname = fmt::format("libcublasLt.so.{}", CUBLAS_VER_MAJOR);
  std::vector<std::string> tried;
  if (const char* path = std::getenv("MESHTRAIN_CUBLASLT"); path != nullptr && *path != '\0') {
    tried.emplace_back(path);
  }
  tried.push_back(soname);
  tried.push_back(std::string(MESHTRAIN_CUDA_LIBDIR) + "/" + soname);
  void* library = nullptr;
  std::string errors;
  for (const std::string& name : tried) {
    library = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (library != nullptr) break;
    errors += fmt::format("{}{}", errors.empty() ? "" : "; ", dlerror());
  }
  MESHTRAIN_CHECK_AS(ErrorKind::resource, library != nullptr,
                     "cuBLASLt could not be loaded (set MESHTRAIN_CUBLASLT to the file): {}",
                     errors);
  CublasLt api{};
  bind(library, "cublasLtCreate", api.create);
  bind(library, "cublasLtDestroy", api.destroy);
  bind(library, "cublasLtMatmul", api.matmul);
  bind(library, "cublasLtMatmulAlgoGetHeuristic", api.heuristic);
  bind(library, "cublasLtMatmulDescCreate", api.desc_create);
  bind(library, "cublasLtMatmulDescDestroy", api.desc_destroy);
  bind(library, "cublasLtMatmulDescSetAttribute", api.desc_set);
  bind(library, "cublasLtMatmulPreferenceCreate", api.preference_create);
  bind(library, "cublasLtMatmulPreferenceDestroy", api.preference_destroy);
  bind(library, "cublasLtMatmulPreferenceSetAttribute", api.preference_set);
  bind(library, "cublasLtMatrixLayoutCreate", api.layout_create);
  bind(library, "cublasLtMatrixLayoutDestroy", api.layout_destroy);
  bind(library, "cublasLtMatrixLayoutSetAttribute", api.layout_set);
  bind(library, "cublasLtGetVersion", api.version);
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
