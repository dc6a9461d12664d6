#include "meshtrain/backend/registry.h"

#include <fmt/format.h>

#include "meshtrain/backend/kinds.h"
#include "meshtrain/util/error.h"

namespace meshtrain {
namespace {

const std::vector<BackendKind>& kinds() {
  static const std::vector<BackendKind> all{cpu_backend_kind(), cuda_backend_kind(),
                                            guarded_backend_kind()};
  return all;
}

}  // namespace

std::vector<std::string> backend_names() {
  std::vector<std::string> names;
  for (const BackendKind& k : kinds()) names.emplace_back(k.name);
  return names;
}

std::string backend_unavailable(const std::string& name) {
  for (const BackendKind& k : kinds()) {
    if (name == k.name) return k.unavailable();
  }
  return fmt::format("no backend is called '{}'", name);
}

const BackendKind& backend_kind(const std::string& name) {
  for (const BackendKind& k : kinds()) {
    if (name != k.name) continue;
    const std::string why = k.unavailable();
    MESHTRAIN_CHECK_AS(ErrorKind::resource, why.empty(), "backend '{}' is not available: {}", name,
                       why);
    return k;
  }
  fail("backend '{}' (train.device, --backend) is not one of: {}", name,
       fmt::join(backend_names(), ", "));
}

std::unique_ptr<Backend> make_backend(const std::string& name, int threads,
                                      MemoryTracker& tracker) {
  return backend_kind(name).make(threads, tracker);
}

}  // namespace meshtrain
