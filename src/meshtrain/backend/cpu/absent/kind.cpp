// The CPU backend's registry entry in a backend-only build without oneDNN
// (MESHTRAIN_BACKEND_ONLY on a machine that lacks it): known, never available.
#include "meshtrain/backend/kinds.h"

namespace meshtrain {

BackendKind cpu_backend_kind() {
  return {.name = "cpu", .unavailable = [] {
            return std::string("this build has no CPU backend (oneDNN was not found)");
          }};
}

}  // namespace meshtrain
