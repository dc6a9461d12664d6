#include "meshtrain/parallel/zero/offload.h"

#include "meshtrain/util/error.h"

namespace meshtrain::zero {

std::string_view offload_tier_name(OffloadTier tier) {
  switch (tier) {
    case OffloadTier::none: return "none";
    case OffloadTier::cpu: return "cpu";
    case OffloadTier::disk: return "disk";
  }
  return "?";
}

OffloadTier parse_offload_tier(std::string_view name) {
  if (name == "none") return OffloadTier::none;
  if (name == "cpu") return OffloadTier::cpu;
  if (name == "disk") return OffloadTier::disk;
  fail("offload: unknown tier '{}' (expected none, cpu or disk)", name);
}

}  // namespace meshtrain::zero
