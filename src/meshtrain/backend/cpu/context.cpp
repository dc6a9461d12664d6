#include "meshtrain/backend/cpu/context.h"

#include <omp.h>

#include <algorithm>

#include "meshtrain/backend/cpu/onednn.h"

namespace meshtrain::cpu {

int context_threads(int requested) {
  return std::min(requested > 0 ? requested : available_cores(), omp_get_thread_limit());
}

CpuContext::Impl::Impl(MemoryTracker& tracker)
    : engine(dnnl::engine::kind::cpu, 0), stream(engine), tracker_(tracker) {}

void* CpuContext::Impl::scratch(Scratch slot, size_t bytes) {
  Tensor& t = scratch_[static_cast<size_t>(slot)];
  if (!t.defined() || t.bytes() < bytes) {
    t = Tensor();  // free first so the peak does not count both
    // 2-byte elements: the tensor only provides tracked, aligned bytes.
    t = Tensor({static_cast<int64_t>((bytes + 1) / 2)}, DType::bf16, MemCategory::workspace, tracker_);
  }
  return t.raw();
}

CpuContext::CpuContext(int threads, MemoryTracker& tracker)
    : threads_(context_threads(threads)),
      tracker_(&tracker) {
  // oneDNN (OpenMP build) and our kernels both follow the OpenMP thread count. Above
  // OMP_THREAD_LIMIT a team gets fewer threads than oneDNN splits the work for, and part of
  // a GEMM would never be computed: hence the clamp.
  omp_set_num_threads(threads_);
  impl_ = std::make_unique<Impl>(tracker);
}

CpuContext::~CpuContext() = default;

}  // namespace meshtrain::cpu
