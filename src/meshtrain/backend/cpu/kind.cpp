// The CPU backend's registry entry: always available; the workspaces the
// memory plan asks a kind for are the kernels' own queries.
#include "meshtrain/backend/cpu/attention.h"
#include "meshtrain/backend/cpu/context.h"
#include "meshtrain/backend/cpu/cpu_backend.h"
#include "meshtrain/backend/cpu/cross_entropy.h"
#include "meshtrain/backend/cpu/matmul.h"
#include "meshtrain/backend/kinds.h"

namespace meshtrain {

BackendKind cpu_backend_kind() {
  return {
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
  };
}

}  // namespace meshtrain
