// The registry's entry for the CUDA backend (registry.cpp): kind.cpp when the
// build has CUDA, absent/kind.cpp (always unavailable, saying why) when not.
#pragma once

#include "meshtrain/backend/registry.h"

namespace meshtrain {

BackendKind cuda_backend_kind();

}  // namespace meshtrain
