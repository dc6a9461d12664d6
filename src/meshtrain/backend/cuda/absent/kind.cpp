// The CUDA backend's registry entry in a build without it (MESHTRAIN_CUDA=OFF
// or no toolkit found): known by name, never available.
#include "meshtrain/backend/kinds.h"

namespace meshtrain {

BackendKind cuda_backend_kind() {
  return {.name = "cuda",
          .unavailable = [] {
            return std::string("this build has no CUDA backend (docs/gpu.md: MESHTRAIN_CUDA)");
          }};
}

}  // namespace meshtrain
