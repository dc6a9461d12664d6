// The emulated device's stand-in for cuDNN's fused attention (sdpa_emu.cpp).
#pragma once

namespace meshtrain::emu {

// Whether the stand-in takes the shapes cuDNN would (on by default, as a GPU
// with cuDNN); off, every shape is refused and the reference kernels run.
extern bool fused_attention;

}  // namespace meshtrain::emu
