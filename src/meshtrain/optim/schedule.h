// Learning-rate schedule: linear warm-up, then cosine decay to min_lr or constant.
#pragma once

#include <cstdint>
#include <string_view>

namespace meshtrain {

enum class LrDecay { cosine, constant };
LrDecay parse_lr_decay(std::string_view name);  // "cosine" | "constant"

struct LrSchedule {
  float max_lr = 3e-4f;
  float min_lr = 3e-5f;
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;
  LrDecay decay = LrDecay::cosine;

  // step is 0-based: the learning rate of the (step+1)-th update.
  float at(int64_t step) const;
};

}  // namespace meshtrain
