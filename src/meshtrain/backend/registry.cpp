#include "meshtrain/backend/registry.h"

#include <fmt/format.h>

#include "meshtrain/backend/cpu/attention.h"
#include "meshtrain/backend/cpu/context.h"
#include "meshtrain/backend/cpu/cpu_backend.h"
#include "meshtrain/backend/cpu/cross_entropy.h"
#include "meshtrain/backend/cpu/matmul.h"
#include "meshtrain/backend/cuda/kind.h"
#include "meshtrain/util/error.h"

namespace meshtrain {
namespace {

const BackendKind kKinds[] = {
    {
        .name = "cpu",
        .unavailable = [] { return std::string(); },
        .make = [](int threads, MemoryTracker& tracker) -> std::unique_ptr<Backend> {
          return std::make_unique<cpu::CpuBackend>(threads, tracker);
        },
        .threads = cpu::context_threads,
        .matmul_workspace = cpu::matmul_workspace,
        .grouped_matmul_workspace = cpu::grouped_matmul_workspace,
        .attention_workspace_bytes = cpu::attention_workspace_bytes,
        .context_attention_workspace_bytes = cpu::context_attention_workspace_bytes,
        .ring_attention_workspace_bytes = cpu::ring_attention_workspace_bytes,
        .classifier_workspace = cpu::classifier_workspace,
        .peak_probe_workspace = cpu::peak_probe_workspace,
    },
    cuda_backend_kind(),
};

}  // namespace

std::vector<std::string> backend_names() {
  std::vector<std::string> names;
  for (const BackendKind& k : kKinds) names.emplace_back(k.name);
  return names;
}

const BackendKind& backend_kind(const std::string& name) {
  for (const BackendKind& k : kKinds) {
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
