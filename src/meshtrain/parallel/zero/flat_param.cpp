#include "meshtrain/parallel/zero/flat_param.h"

#include <algorithm>

#include "meshtrain/util/error.h"

namespace meshtrain::zero {

std::vector<ShardSegment> FlatParam::segments(int rank) const {
  std::vector<ShardSegment> out;
  const int64_t begin = shard_begin(rank), end = begin + shard;
  for (const FlatMember& m : members) {
    const int64_t lo = std::max(begin, m.offset), hi = std::min(end, m.offset + m.numel);
    if (lo >= hi) continue;
    out.push_back({m.param, lo - begin, lo - m.offset, hi - lo});
  }
  return out;
}

int64_t ZeroLayout::padding() const {
  int64_t total = 0;
  for (const FlatParam& f : flats) total += f.padded - f.numel;
  return total;
}

int ZeroLayout::group_rank(size_t flat, int dp_rank) const {
  return flats[flat].expert ? dp_rank / (dp / expert_dp) : dp_rank;
}

ZeroLayout make_zero_layout(const std::vector<ParamSpec>& specs,
                            const std::vector<ParamUnit>& units, Precision precision, int dp,
                            int expert_dp) {
  MESHTRAIN_CHECK(dp >= 1, "zero: data-parallel size must be >= 1, got {}", dp);
  MESHTRAIN_CHECK(expert_dp >= 0 && (expert_dp == 0 || dp % expert_dp == 0),
                  "zero: the expert-data-parallel size {} does not divide dp {}", expert_dp, dp);
  ZeroLayout layout;
  layout.dp = dp;
  layout.expert_dp = expert_dp;
  layout.unit_flats.resize(units.size());
  layout.param_flat.assign(specs.size(), static_cast<size_t>(-1));
  layout.param_offset.assign(specs.size(), 0);
  size_t expected_first = 0;
  for (size_t u = 0; u < units.size(); ++u) {
    const ParamUnit& unit = units[u];
    MESHTRAIN_CHECK(unit.first_param == expected_first && unit.end_param > unit.first_param &&
                        unit.end_param <= specs.size(),
                    "zero: unit '{}' [{}, {}) does not continue the registry at {}", unit.name,
                    unit.first_param, unit.end_param, expected_first);
    expected_first = unit.end_param;
    // Per dtype (the f32 flat, then in mixed precision the compute dtype's;
    // empty in fp32) the trainable parameters, then the frozen ones, then
    // QLoRA's packed NF4 weights (frozen, in 4-byte words); under expert
    // parallelism the routed experts' after the others of each.
    auto add_flat = [&](DType dtype, bool trainable, bool expert, bool packed) {
      FlatParam flat{.unit = u,
                     .dtype = dtype,
                     .trainable = trainable,
                     .expert = expert,
                     .packed = packed,
                     .ranks = expert ? expert_dp : dp,
                     .members = {},
                     .numel = 0,
                     .padded = 0,
                     .shard = 0};
      for (size_t i = unit.first_param; i < unit.end_param; ++i) {
        const ParamSpec& spec = specs[i];
        if (spec.nf4 != packed || (expert_dp > 0 && spec.expert != expert)) continue;
        if (!packed && (param_compute_dtype(spec, precision) != dtype ||
                        spec.trainable != trainable)) {
          continue;
        }
        const int64_t n = packed ? nf4_layout(spec).bytes / 4 : spec.numel();
        flat.members.push_back({i, flat.numel, n});
        layout.param_flat[i] = layout.flats.size();
        layout.param_offset[i] = flat.numel;
        flat.numel += n;
      }
      if (flat.members.empty()) return;
      flat.padded = (flat.numel + flat.ranks - 1) / flat.ranks * flat.ranks;
      flat.shard = flat.padded / flat.ranks;
      layout.unit_flats[u].push_back(layout.flats.size());
      layout.flats.push_back(std::move(flat));
    };
    const DType narrow = compute_dtype(precision);
    for (DType dtype : {DType::f32, narrow == DType::f32 ? DType::bf16 : narrow}) {
      for (bool trainable : {true, false}) {
        for (bool expert : {false, true}) {
          if (!expert || expert_dp > 0) add_flat(dtype, trainable, expert, false);
        }
      }
    }
    for (bool expert : {false, true}) {
      if (!expert || expert_dp > 0) add_flat(DType::i32, false, expert, true);
    }
  }
  MESHTRAIN_CHECK(expected_first == specs.size(), "zero: units cover {} of {} parameters",
                  expected_first, specs.size());
  return layout;
}

}  // namespace meshtrain::zero
