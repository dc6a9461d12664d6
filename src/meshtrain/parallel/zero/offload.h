// Offload tier for ZeRO optimizer-state shards (work in progress).
#pragma once

#include <cstdint>
#include <string_view>

namespace meshtrain::zero {

enum class OffloadTier : uint8_t { none, cpu, disk };

std::string_view offload_tier_name(OffloadTier tier);
OffloadTier parse_offload_tier(std::string_view name);

}  // namespace meshtrain::zero
