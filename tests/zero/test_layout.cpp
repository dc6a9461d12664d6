// ZeRO's flat parameters and the memory formulas, without communication.
#include <gtest/gtest.h>

#include <cstdlib>

#include "meshtrain/parallel/zero/flat_param.h"
#include "meshtrain/parallel/zero/memory.h"
#include "meshtrain/util/error.h"
#include "support/tiny_models.h"

namespace meshtrain::zero {
namespace {

struct ModelShape {
  ModelConfig config;
  std::vector<ParamSpec> specs;
  std::vector<ParamUnit> units;
  explicit ModelShape(const ModelConfig& c)
      : config(c), specs(build_param_specs(c)), units(build_param_units(c)) {}
};

std::vector<ModelConfig> shapes() {
  ModelConfig gpt2_50257 = model_preset("gpt2-124M");  // vocab 50257: divides by no dp > 1
  return {testing::tiny_llama(false), testing::tiny_llama(true), testing::tiny_gpt2(),
          model_preset("llama-60M"), gpt2_50257};
}

TEST(ZeroLayout, EveryParameterOnceInRegistryOrderGroupedByComputeDtype) {
  for (const ModelConfig& c : shapes()) {
    ModelShape s(c);
    for (Precision precision : {Precision::fp32, Precision::bf16}) {
      for (int dp : {1, 2, 3, 4, 7}) {
        ZeroLayout layout = make_zero_layout(s.specs, s.units, precision, dp);
        std::vector<int> seen(s.specs.size(), 0);
        size_t last_unit = 0;
        for (size_t fi = 0; fi < layout.flats.size(); ++fi) {
          const FlatParam& f = layout.flats[fi];
          EXPECT_GE(f.unit, last_unit) << "flat parameters follow the units";
          last_unit = f.unit;
          int64_t offset = 0;
          size_t prev = 0;
          for (const FlatMember& m : f.members) {
            ++seen[m.param];
            EXPECT_EQ(m.offset, offset) << "packed without gaps";
            EXPECT_EQ(m.numel, s.specs[m.param].numel());
            EXPECT_EQ(param_compute_dtype(s.specs[m.param], precision), f.dtype);
            EXPECT_GE(m.param, s.units[f.unit].first_param);
            EXPECT_LT(m.param, s.units[f.unit].end_param);
            if (m.offset > 0) {
              EXPECT_GT(m.param, prev) << "registry order";
            }
            EXPECT_EQ(layout.param_flat[m.param], fi);
            EXPECT_EQ(layout.param_offset[m.param], m.offset);
            prev = m.param;
            offset += m.numel;
          }
          EXPECT_EQ(f.numel, offset);
          EXPECT_EQ(f.padded % dp, 0);
          EXPECT_LT(f.padded - f.numel, dp) << "padding below dp elements";
          EXPECT_EQ(f.shard * dp, f.padded);
          if (precision == Precision::fp32) {
            EXPECT_EQ(f.dtype, DType::f32);
          }
        }
        for (size_t i = 0; i < seen.size(); ++i) EXPECT_EQ(seen[i], 1) << s.specs[i].name;
      }
    }
  }
}

// The fused GEMMs (q|k|v, gate|up) read adjacent weights: they must be
// adjacent in their flat parameter too.
TEST(ZeroLayout, FusedProjectionsStayAdjacent) {
  ModelShape s(model_preset("llama-60M"));
  for (Precision precision : {Precision::fp32, Precision::bf16}) {
    ZeroLayout layout = make_zero_layout(s.specs, s.units, precision, 4);
    for (size_t i = 0; i + 1 < s.specs.size(); ++i) {
      const std::string& name = s.specs[i].name;
      const bool fused_with_next = name.ends_with("q_proj.weight") ||
                                   name.ends_with("k_proj.weight") ||
                                   name.ends_with("gate_proj.weight");
      if (!fused_with_next) continue;
      EXPECT_EQ(layout.param_flat[i], layout.param_flat[i + 1]) << name;
      EXPECT_EQ(layout.param_offset[i] + s.specs[i].numel(), layout.param_offset[i + 1]) << name;
    }
  }
}

// The ranks' segments tile each flat parameter's members exactly.
TEST(ZeroLayout, ShardSegmentsTileTheMembers) {
  for (const ModelConfig& c : shapes()) {
    ModelShape s(c);
    for (int dp : {1, 3, 4}) {
      ZeroLayout layout = make_zero_layout(s.specs, s.units, Precision::bf16, dp);
      for (const FlatParam& f : layout.flats) {
        int64_t covered = 0;
        for (int r = 0; r < dp; ++r) {
          int64_t flat_pos = -1;
          for (const ShardSegment& seg : f.segments(r)) {
            const int64_t begin = layout.param_offset[seg.param] + seg.param_offset;
            EXPECT_EQ(begin, f.shard_begin(r) + seg.shard_offset);
            EXPECT_GT(begin, flat_pos);
            EXPECT_LE(seg.shard_offset + seg.numel, f.shard);
            EXPECT_LE(seg.param_offset + seg.numel, s.specs[seg.param].numel());
            flat_pos = begin;
            covered += seg.numel;
          }
        }
        EXPECT_EQ(covered, f.numel);
      }
    }
  }
}

TEST(ZeroLayout, BadUnitsAreRejected) {
  ModelShape s(testing::tiny_llama(false));
  std::vector<ParamUnit> units = s.units;
  units.pop_back();
  EXPECT_THROW(make_zero_layout(s.specs, units, Precision::fp32, 2), Error);
  EXPECT_THROW(make_zero_layout(s.specs, s.units, Precision::fp32, 0), Error);
}

// The exact per-rank count of a layout equals the closed-form formula up to
// the padding (at most 20 bytes per padding element and rank: 4 compute, 4
// grad, 12 optimizer), and the formulas show what each stage saves.
TEST(ZeroMemory, LayoutMatchesTheFormulaUpToPadding) {
  for (const ModelConfig& c : shapes()) {
    ModelShape s(c);
    for (Precision precision : {Precision::fp32, Precision::bf16}) {
      int64_t psi = 0, narrow = 0;
      for (const ParamSpec& spec : s.specs) {
        psi += spec.numel();
        if (param_compute_dtype(spec, precision) == DType::bf16) narrow += spec.numel();
      }
      for (int dp : {1, 2, 3, 4}) {
        ZeroLayout layout = make_zero_layout(s.specs, s.units, precision, dp);
        const auto slack = static_cast<double>(layout.padding() * 20);
        for (int stage = 1; stage <= 3; ++stage) {
          ModelStateBytes got = layout_model_state_bytes(layout, stage);
          ModelStateBytes want = zero_formula_bytes(stage, psi, narrow, dp);
          for (auto [a, b] : {std::pair{got.params, want.params}, {got.grads, want.grads},
                              {got.optimizer, want.optimizer}}) {
            EXPECT_GE(static_cast<double>(a) + 1, static_cast<double>(b));
            EXPECT_LE(static_cast<double>(a), static_cast<double>(b) + slack + 1)
                << "stage " << stage << " dp " << dp;
          }
        }
      }
      // 16Ψ + 2Ψn at stage 0, and a quarter of it at stage 3 on 4 ranks.
      ModelStateBytes ddp = zero_formula_bytes(0, psi, narrow, 4);
      EXPECT_EQ(ddp.total(), static_cast<size_t>(16 * psi + 2 * narrow));
      ModelStateBytes z3 = zero_formula_bytes(3, psi, narrow, 4);
      EXPECT_NEAR(static_cast<double>(z3.total()), (16.0 * psi + 2.0 * narrow) / 4, 3);
    }
  }
}

// Expert parallelism: a routed experts' flat of their own per unit and
// dtype, sharded over the expert-data-parallel group (dp 4 = edp 2 x ep 2:
// dp rank r is edp rank r / 2), the rest over dp as without experts.
TEST(ZeroLayout, ExpertsShardOverTheirGroup) {
  ModelConfig c = testing::tiny_llama(false);
  c.moe.experts = 4;
  c.moe.top_k = 2;
  c.moe.hidden_dim = 8;
  const std::vector<ParamSpec> specs = build_param_specs(c, 0, 1, 1, 2);  // ep rank 1 of 2
  const std::vector<ParamUnit> units = build_param_units(c);
  for (Precision precision : {Precision::fp32, Precision::bf16}) {
    const ZeroLayout layout = make_zero_layout(specs, units, precision, 4, 2);
    const ZeroLayout plain = make_zero_layout(specs, units, precision, 4);
    size_t expert_flats = 0;
    for (size_t i = 0; i < layout.flats.size(); ++i) {
      const FlatParam& f = layout.flats[i];
      EXPECT_EQ(f.ranks, f.expert ? 2 : 4);
      EXPECT_EQ(f.padded, f.shard * f.ranks);
      EXPECT_EQ(layout.group_rank(i, 3), f.expert ? 1 : 3);
      for (const FlatMember& m : f.members) EXPECT_EQ(specs[m.param].expert, f.expert);
      expert_flats += f.expert ? 1 : 0;
    }
    EXPECT_EQ(expert_flats, static_cast<size_t>(c.n_layers)) << "one per MoE layer and dtype";
    EXPECT_EQ(layout.flats.size(), plain.flats.size() + expert_flats);
    for (const FlatParam& f : plain.flats) EXPECT_FALSE(f.expert);
  }
  for (const ParamSpec& spec : specs) {
    if (!spec.expert) continue;
    EXPECT_EQ(spec.shape[0], 2) << spec.name << ": experts 2 and 3 of 4";
    EXPECT_EQ(spec.split.global_shape[0], 4) << spec.name;
  }
  EXPECT_THROW(make_zero_layout(specs, units, Precision::fp32, 4, 3), Error);
}

// LoRA: per unit and dtype, the adapters' flat and the frozen base's; the
// frozen one counts in the parameters only, its fused projections adjacent.
TEST(ZeroLayout, LoraSplitsTrainableFromFrozen) {
  ModelConfig c = testing::tiny_llama(false);
  c.lora.rank = 2;
  c.lora.targets = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
  ModelShape s(c);
  for (Precision precision : {Precision::fp32, Precision::bf16}) {
    ZeroLayout layout = make_zero_layout(s.specs, s.units, precision, 3);
    ModelStateBytes states = layout_model_state_bytes(layout, 2);
    size_t frozen_values = 0, trainable_values = 0, trainable_shard = 0, optimizer = 0;
    for (const FlatParam& f : layout.flats) {
      for (const FlatMember& m : f.members) {
        EXPECT_EQ(s.specs[m.param].trainable, f.trainable) << s.specs[m.param].name;
        EXPECT_EQ(s.specs[m.param].lora_adapter, f.trainable) << s.specs[m.param].name;
      }
      if (f.trainable) {
        trainable_values += static_cast<size_t>(f.padded) * dtype_size(f.dtype);
        trainable_shard += static_cast<size_t>(f.shard);
        optimizer += static_cast<size_t>(f.shard) * (f.dtype == DType::f32 ? 8 : 12);
      } else {
        frozen_values += static_cast<size_t>(f.padded) * dtype_size(f.dtype);
      }
    }
    EXPECT_GT(frozen_values, 0u);
    EXPECT_EQ(states.grads, 4 * trainable_shard);
    EXPECT_EQ(states.params, frozen_values + trainable_values);
    EXPECT_EQ(states.optimizer, optimizer);
    for (size_t i = 0; i + 1 < s.specs.size(); ++i) {
      const std::string& name = s.specs[i].name;
      if (!name.ends_with("q_proj.weight") && !name.ends_with("gate_proj.weight")) continue;
      EXPECT_EQ(layout.param_flat[i], layout.param_flat[i + 1]) << name;
      EXPECT_EQ(layout.param_offset[i] + s.specs[i].numel(), layout.param_offset[i + 1]) << name;
    }
  }
}

}  // namespace
}  // namespace meshtrain::zero
