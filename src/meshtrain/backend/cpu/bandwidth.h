// The host's sustained copy bandwidth with the context's threads: the
// roofline of the memory-bound kernels (`meshtrain ops perf`).
#pragma once

#include "meshtrain/backend/cpu/context.h"

namespace meshtrain::cpu {

// Bytes read + written per second copying `bytes` into another buffer, each
// thread its own contiguous part; the best of the repetitions within `seconds`.
double measure_copy_bandwidth(CpuContext& ctx, size_t bytes, double seconds);

}  // namespace meshtrain::cpu
