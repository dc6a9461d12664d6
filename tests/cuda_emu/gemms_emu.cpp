// The emulated CUDA backend's GEMMs (tests/cuda_emu): the CPU backend's, on
// the host memory the emulated device hands out. cuBLASLt cannot run without a
// device; what the emulation checks is everything around the GEMMs.
#include "emu.h"
#define cuda cuda_emu
#include "meshtrain/backend/cuda/matmul.h"

#include "meshtrain/backend/registry.h"

namespace meshtrain::cuda_emu {
namespace {

Backend& cpu() {
  static MemoryTracker tracker;
  static const std::unique_ptr<Backend> backend = make_backend("cpu", 1, tracker);
  return *backend;
}

}  // namespace

Gemms::Gemms(cudaStream_t stream, void* workspace) : stream_(stream), workspace_(workspace) {}

Gemms::~Gemms() = default;

void Gemms::run(const ops::MatmulDims& dims, DType ab, const void* a, const void* b,
                DType c_dtype, void* c, float alpha, bool accumulate, const float* bias,
                const void* c_in) {
  if (accumulate && c_in != nullptr) {  // cuBLASLt reads C from c_in and writes D to c
    cpu().matmul_add(dims, ab, a, b, static_cast<const float*>(c_in), static_cast<float*>(c),
                     bias);
    return;
  }
  cpu().matmul(dims, ab, a, b, c_dtype, c, alpha, accumulate, bias);
}

void Gemms::prepare(const ops::MatmulDims&, DType, DType, bool, bool) {}

}  // namespace meshtrain::cuda_emu
