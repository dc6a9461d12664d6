// The HF fixtures' reference logits (tests/reference/hf_models.py): the
// largest relative difference, max |got - want| / max(1, |want|), between
// `model`'s fp32 logits for the ids (7 t + 3) % vocab and transformers'
// logits.safetensors in `dir`.
#pragma once

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "meshtrain/ckpt/safetensors.h"
#include "meshtrain/model/model.h"
#include "meshtrain/util/error.h"

namespace meshtrain::testing {

inline double hf_logits_error(Model& model, const std::string& dir) {
  MemoryTracker tracker;
  SafetensorsReader ref(dir + "/logits.safetensors");
  const int64_t seq = ref.info("logits").shape[0], vocab = model.config().vocab_size;
  MESHTRAIN_CHECK(ref.info("logits").shape[1] == vocab, "{}: logits of vocab {}, the model's {}", dir,
                  ref.info("logits").shape[1], vocab);
  std::vector<int32_t> ids(static_cast<size_t>(seq));
  for (int64_t t = 0; t < seq; ++t) ids[static_cast<size_t>(t)] = static_cast<int32_t>((7 * t + 3) % vocab);
  const Tensor want = ref.read_tensor("logits", DType::f32, MemCategory::workspace, tracker);
  std::vector<float> got(static_cast<size_t>(seq * vocab));
  model.forward_logits(ids.data(), 1, seq, got.data());
  double worst = 0;
  for (int64_t i = 0; i < seq * vocab; ++i) {
    const double w = want.data<float>()[i];
    worst = std::max(worst, std::abs(got[static_cast<size_t>(i)] - w) / std::max(1.0, std::abs(w)));
  }
  return worst;
}

}  // namespace meshtrain::testing
