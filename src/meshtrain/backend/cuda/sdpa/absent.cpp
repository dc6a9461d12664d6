// A CUDA build without the cuDNN frontend's headers (scripts/get_cudnn_frontend.sh
// not run), and the emulated device (tests/cuda_emu): the cuDNN path declines
// every shape, so attention runs on the reference kernels.
#include "meshtrain/backend/cuda/sdpa/sdpa.h"

#include "meshtrain/util/error.h"

namespace meshtrain::cuda {

namespace {
constexpr const char* kAbsent = "this build has no cuDNN frontend";
}  // namespace

std::string sdpa_declines(const ops::AttentionDims&, DType) { return kAbsent; }
std::string validate_sdpa(const SdpaShape&, int) { return kAbsent; }

struct SdpaRunner::Impl {};
SdpaRunner::SdpaRunner(CUstream_st*) {}
SdpaRunner::~SdpaRunner() = default;
std::string SdpaRunner::prepare(const SdpaShape&) { return kAbsent; }
size_t SdpaRunner::forward_workspace(const SdpaShape&) const { return 0; }
size_t SdpaRunner::backward_workspace(const SdpaShape&) const { return 0; }
void SdpaRunner::forward(const SdpaShape&, const SdpaForward&, void*) const {
  MESHTRAIN_CHECK(false, "cuDNN attention: {}", kAbsent);
}
void SdpaRunner::backward(const SdpaShape&, const SdpaBackward&, void*) const {
  MESHTRAIN_CHECK(false, "cuDNN attention: {}", kAbsent);
}

}  // namespace meshtrain::cuda
