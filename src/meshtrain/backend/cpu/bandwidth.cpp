#include "meshtrain/backend/cpu/bandwidth.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "meshtrain/tensor/tensor.h"

namespace meshtrain::cpu {

double measure_copy_bandwidth(CpuContext& ctx, size_t bytes, double seconds) {
  const auto kBytes = static_cast<int64_t>(std::max<size_t>(bytes, 4096) / 2 * 2);
  const Tensor src({kBytes / 2}, DType::bf16, MemCategory::workspace, ctx.tracker());
  const Tensor dst({kBytes / 2}, DType::bf16, MemCategory::workspace, ctx.tracker());
  std::memset(src.raw(), 1, kBytes);  // touch every page once before timing
  const int threads = ctx.threads();
  const auto copy = [&] {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int t = 0; t < threads; ++t) {
      const int64_t begin = kBytes * t / threads, end = kBytes * (t + 1) / threads;
      std::memcpy(static_cast<char*>(dst.raw()) + begin,
                  static_cast<const char*>(src.raw()) + begin, static_cast<size_t>(end - begin));
    }
  };
  copy();
  using Clock = std::chrono::steady_clock;
  const auto until = Clock::now() + std::chrono::duration<double>(seconds);
  double best = 0;
  do {
    const auto start = Clock::now();
    copy();
    const double s = std::chrono::duration<double>(Clock::now() - start).count();
    best = std::max(best, 2.0 * static_cast<double>(kBytes) / s);
  } while (Clock::now() < until);
  return best;
}

}  // namespace meshtrain::cpu
