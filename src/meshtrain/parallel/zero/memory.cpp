#include "meshtrain/parallel/zero/memory.h"

#include "meshtrain/util/error.h"

namespace meshtrain::zero {

ModelStateBytes zero_formula_bytes(int stage, int64_t params, int64_t narrow_params, int dp) {
  MESHTRAIN_CHECK(stage >= 0 && stage <= 3 && dp >= 1, "zero: stage {} / dp {} out of range",
                  stage, dp);
  const double psi = static_cast<double>(params), narrow = static_cast<double>(narrow_params);
  const double wide = psi - narrow, n = stage == 0 ? 1.0 : static_cast<double>(dp);
  const double compute = 4 * wide + 2 * narrow;
  ModelStateBytes b;
  b.params = static_cast<size_t>(stage == 0 ? 4 * psi + 2 * narrow
                                 : stage == 3 ? compute / n
                                              : compute);
  b.grads = static_cast<size_t>(stage >= 2 ? 4 * psi / n : 4 * psi);
  b.optimizer = static_cast<size_t>(stage == 0 ? 8 * psi : (8 * psi + 4 * narrow) / n);
  return b;
}

ModelStateBytes layout_model_state_bytes(const ZeroLayout& layout, int stage) {
  MESHTRAIN_CHECK(stage >= 1 && stage <= 3, "zero: stage {} has no sharded layout", stage);
  ModelStateBytes b;
  for (const FlatParam& f : layout.flats) {
    const auto shard = static_cast<size_t>(f.shard), padded = static_cast<size_t>(f.padded);
    const size_t compute = dtype_size(f.dtype);
    b.params += (stage == 3 ? shard : padded) * compute;
    if (!f.trainable) continue;  // values only
    b.grads += (stage >= 2 ? shard : padded) * 4;
    b.optimizer += shard * (f.dtype == DType::f32 ? 8 : 12);
  }
  return b;
}

size_t layout_offloaded_bytes(const ZeroLayout& layout, int stage) {
  MESHTRAIN_CHECK(stage >= 1 && stage <= 3, "zero: stage {} has no sharded layout", stage);
  size_t bytes = 0;
  for (const FlatParam& f : layout.flats) {
    if (!f.trainable) continue;  // LoRA's frozen base: no optimizer state (stage <= 2)
    const auto shard = static_cast<size_t>(f.shard);
    const bool wide = f.dtype == DType::f32;
    bytes += stage == 3 ? shard * (12 + (wide ? 0 : dtype_size(f.dtype)))
                        : shard * (wide ? 8 : 12);
  }
  return bytes;
}

}  // namespace meshtrain::zero
