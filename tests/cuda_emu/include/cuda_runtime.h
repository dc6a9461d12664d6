// The emulated CUDA runtime of tests/cuda_emu (emu.h), in place of the toolkit's header.
#pragma once

#include "../emu.h"
