// Each backend folder's registry entry (registry.cpp lists them): <folder>/kind.cpp
// when the build has the backend, <folder>/absent/kind.cpp (known by name,
// never available, saying why) when it does not. A new device adds its line here.
#pragma once

#include "meshtrain/backend/registry.h"

namespace meshtrain {

BackendKind cpu_backend_kind();   // backend/cpu: needs oneDNN
BackendKind cuda_backend_kind();  // backend/cuda: needs the CUDA toolkit
BackendKind guarded_backend_kind();  // backend/guarded: the CPU backend in guarded memory

}  // namespace meshtrain
