// NF4 dequantisation (QLoRA's frozen base weights), one thread per element.
#include "meshtrain/backend/cuda/device.cuh"

namespace meshtrain::cuda {
namespace {

constexpr int64_t kNf4Block = 64, kNf4ScaleBlock = 256;  // tensor/nf4.h's kBlock, kScaleBlock

template <typename E>
__global__ void dequantize_nf4_kernel(Nf4Tables tables, Nf4Layout l, const uint8_t* packed,
                                      typename E::T* y) {
  MESHTRAIN_GRID_STRIDE(i, l.n) {
    const int64_t b = i / kNf4Block;
    float absmax;
    if (l.absmax_at >= 0) {
      absmax = reinterpret_cast<const float*>(packed + l.absmax_at)[b];
    } else {
      const float s = reinterpret_cast<const float*>(packed + l.scales_at)[b / kNf4ScaleBlock];
      const float offset = *reinterpret_cast<const float*>(packed + l.offset_at);
      absmax = __fadd_rn(__fmul_rn(tables.dynamic[packed[l.codes_at + b]], s), offset);
    }
    const uint8_t pair = packed[l.packed_at + i / 2];
    const int code = i % 2 == 0 ? pair >> 4 : pair & 0xF;
    y[i] = E::store(__fmul_rn(tables.levels[code], absmax));
  }
}

}  // namespace

void launch_dequantize_nf4(cudaStream_t s, const Nf4Tables& tables, const Nf4Layout& layout,
                           const void* packed, Elem to, void* y) {
  if (layout.n == 0) return;
  with_elem(to, [&](auto tag) {
    using E = decltype(tag);
    dequantize_nf4_kernel<E><<<blocks_for(layout.n), kThreads, 0, s>>>(
        tables, layout, static_cast<const uint8_t*>(packed), static_cast<typename E::T*>(y));
  });
  check_launch("dequantize_nf4");
}

}  // namespace meshtrain::cuda
