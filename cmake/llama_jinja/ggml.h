// Stands in for ggml.h when llama.cpp's common/json.cpp is built alone (cmake/llama_jinja.cmake):
// that file takes only GGML_ASSERT from it.
#pragma once
#include <cstdio>
#include <cstdlib>
#define GGML_ASSERT(x)                                                                   \
  do {                                                                                   \
    if (!(x)) {                                                                          \
      std::fprintf(stderr, "GGML_ASSERT(%s) failed at %s:%d\n", #x, __FILE__, __LINE__); \
      std::abort();                                                                      \
    }                                                                                    \
  } while (0)
