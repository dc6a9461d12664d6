#include "meshtrain/backend/cuda/library.h"

#include <fmt/format.h>

#include <cstdlib>
#include <vector>

#include "meshtrain/util/error.h"

namespace meshtrain::cuda {

void* open_library(const char* what, const char* env, const std::string& soname) {
  std::vector<std::string> tried;
  if (const char* path = std::getenv(env); path != nullptr && *path != '\0') tried.emplace_back(path);
  tried.push_back(soname);
  tried.push_back(std::string(MESHTRAIN_CUDA_LIBDIR) + "/" + soname);
  std::string errors;
  for (const std::string& name : tried) {
    if (void* library = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL)) return library;
    errors += fmt::format("{}{}", errors.empty() ? "" : "; ", dlerror());
  }
  fail_as(ErrorKind::resource, "{} could not be loaded (set {} to the file): {}", what, env, errors);
}

void* library_symbol(void* library, const char* what, const char* symbol) {
  void* address = dlsym(library, symbol);
  MESHTRAIN_CHECK_AS(ErrorKind::resource, address != nullptr, "{}: {} not found ({})", what, symbol,
                     dlerror());
  return address;
}

}  // namespace meshtrain::cuda
