// GEMM through oneDNN: f32, bf16 or f16 inputs, f32 accumulation (f16 through
// f32 copies of the operands here: see F16Staging in onednn.h).
#pragma once

#include <cstddef>
#include <cstdint>

#include "meshtrain/backend/cpu/context.h"
#include "meshtrain/backend/ops.h"
#include "meshtrain/tensor/dtype.h"

namespace meshtrain::cpu {

using ops::MatmulDims;

// C[b] = alpha * op(A[b]) · op(B[b]) (+ bias[n]) (+ C[b] when accumulate).
// A and B have dtype `ab` (f32, bf16 or f16); C has dtype `c_dtype` (f32, bf16 or f16;
// accumulate requires f32). Batches are contiguous. bias is f32 or nullptr.
void matmul(CpuContext& ctx, const MatmulDims& dims, DType ab, const void* a, const void* b,
            DType c_dtype, void* c, float alpha = 1.0f, bool accumulate = false,
            const float* bias = nullptr);

// The workspace matmul() takes for one call (bytes), from the primitive
// descriptor matmul() itself creates: oneDNN's scratchpad (the context's
// `onednn` slot) and, for f16 operands, the f32 staging (`f16_staging` slot).
// oneDNN sizes its scratchpad by the OpenMP thread count, so `threads` is the
// count the call runs with (CpuContext::threads()). The slots are grown,
// never shrunk: a run's slot is the largest of its calls' (docs/plan.md).
using ops::MatmulWorkspace;
MatmulWorkspace matmul_workspace(const MatmulDims& dims, DType ab, DType c_dtype, int threads,
                                 float alpha = 1.0f, bool accumulate = false, bool bias = false);

// Backend::grouped_matmul: the groups' GEMMs spread over the OpenMP threads,
// each run single-threaded (ThreadMatmul), largest first; one thread or one
// group: matmul() per group. Small-m GEMMs keep more of the peak this way
// than each one split over the threads (docs/benchmarks.md, grouped GEMM).
using ops::GroupedMatmulDims;
void grouped_matmul(CpuContext& ctx, const GroupedMatmulDims& dims, DType ab, const void* a,
                    const void* b, DType c_dtype, void* c, float alpha = 1.0f,
                    bool accumulate = false);
// Its workspace with `threads` threads: per thread, the largest ThreadMatmul
// scratchpad of a group of dims.max_rows rows (the context's `grouped` slot).
size_t grouped_matmul_workspace(const GroupedMatmulDims& dims, DType ab, DType c_dtype, int threads,
                                float alpha = 1.0f, bool accumulate = false);

// Measures this process's sustained matmul FLOP/s with the given input dtype
// (square-ish GEMMs of the sizes a transformer uses), for MFU denominators:
// rounds of seconds / 2 until two in a row agree within 3% (at most 4).
double measure_matmul_peak_flops(CpuContext& ctx, DType ab, double seconds = 1.0);
// The workspace that probe takes with `threads` threads.
using ops::PeakProbeWorkspace;
PeakProbeWorkspace peak_probe_workspace(DType ab, int threads);

}  // namespace meshtrain::cpu
