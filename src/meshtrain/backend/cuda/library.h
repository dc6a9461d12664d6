// NVIDIA's large libraries (cuBLASLt, NCCL) opened when first needed rather
// than linked: a process that never uses them does not map them (cuBLASLt's
// half gigabyte cost every meshtrain process ~90 ms at start-up), and a
// binary built with the toolkit still starts on a machine without them.
#pragma once

#include <dlfcn.h>

#include <string>

#include "meshtrain/util/error_kind.h"

namespace meshtrain::cuda {

// Opens `what` as $<env> (a file) when set, else `soname` on the loader's
// path, else in the toolkit's library folder this build was configured with.
// Throws Error (resource) naming every place tried and why it failed.
void* open_library(const char* what, const char* env, const std::string& soname);

// Throws Error (resource) "<what>: <symbol> not found".
void* library_symbol(void* library, const char* what, const char* symbol);

template <typename F>
void bind(void* library, const char* what, const char* symbol, F& out) {
  out = reinterpret_cast<F>(library_symbol(library, what, symbol));
}

}  // namespace meshtrain::cuda
