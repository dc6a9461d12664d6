// Quantised weights on the CPU: NF4 dequantisation (tensor/nf4.h).
#pragma once

#include <cstdint>

#include "meshtrain/tensor/dtype.h"
#include "meshtrain/tensor/nf4.h"

namespace meshtrain::cpu {

void dequantize_nf4(const uint8_t* packed, int64_t n, DType to, void* y, nf4::Form form);

}  // namespace meshtrain::cpu
