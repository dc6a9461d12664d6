// The guarded backend's registry entry: the CPU backend's, under its own name,
// making the CPU backend wrapped in guarded memory (available where the CPU
// backend is; the same threads and workspaces).
#include "meshtrain/backend/guarded/guarded_backend.h"
#include "meshtrain/backend/kinds.h"

namespace meshtrain {

BackendKind guarded_backend_kind() {
  BackendKind kind = cpu_backend_kind();
  kind.name = "guarded";
  if (kind.make == nullptr) return kind;
  kind.make = [](int threads, MemoryTracker& tracker) -> std::unique_ptr<Backend> {
    return std::make_unique<guarded::GuardedBackend>(cpu_backend_kind().make(threads, tracker),
                                                     tracker);
  };
  return kind;
}

}  // namespace meshtrain
