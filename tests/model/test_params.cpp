#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "meshtrain/model/model.h"
#include "meshtrain/model/params.h"
#include "meshtrain/util/error.h"
#include "support/tiny_models.h"

namespace meshtrain {
namespace {

const ParamSpec& find_spec(const std::vector<ParamSpec>& specs, const std::string& name) {
  for (const ParamSpec& s : specs) {
    if (s.name == name) return s;
  }
  throw std::runtime_error("no spec " + name);
}

TEST(ParamRegistry, LlamaNamesShapesAndRoles) {
  const ModelConfig c = model_preset("llama-tiny");  // untied, GQA: kv width 2 * 16
  const std::vector<ParamSpec> specs = build_param_specs(c);
  ASSERT_EQ(specs.size(), 1 + 2 * 9 + 2u);
  EXPECT_EQ(specs.front().name, "model.embed_tokens.weight");
  EXPECT_EQ(specs.back().name, "lm_head.weight");
  EXPECT_EQ(specs[specs.size() - 2].name, "model.norm.weight");
  EXPECT_EQ(find_spec(specs, "model.layers.1.self_attn.q_proj.weight").shape, (Shape{64, 64}));
  EXPECT_EQ(find_spec(specs, "model.layers.1.self_attn.k_proj.weight").shape, (Shape{32, 64}));
  EXPECT_EQ(find_spec(specs, "model.layers.1.self_attn.o_proj.weight").shape, (Shape{64, 64}));
  EXPECT_EQ(find_spec(specs, "model.layers.0.mlp.gate_proj.weight").shape, (Shape{176, 64}));
  EXPECT_EQ(find_spec(specs, "model.layers.0.mlp.down_proj.weight").shape, (Shape{64, 176}));
  EXPECT_EQ(find_spec(specs, "model.layers.0.input_layernorm.weight").role, ParamRole::no_decay);
  EXPECT_EQ(find_spec(specs, "model.layers.0.input_layernorm.weight").init, InitKind::ones);
  EXPECT_EQ(find_spec(specs, "model.layers.0.mlp.up_proj.weight").role, ParamRole::decay);
  EXPECT_FALSE(specs.front().matmul_weight);  // untied: a lookup only
  EXPECT_TRUE(specs.back().matmul_weight);

  ModelConfig tied = c;
  tied.tie_embeddings = true;
  const std::vector<ParamSpec> tied_specs = build_param_specs(tied);
  EXPECT_EQ(tied_specs.back().name, "model.norm.weight");
  EXPECT_TRUE(tied_specs.front().matmul_weight);
}

TEST(ParamRegistry, Gpt2NamesShapesAndRoles) {
  const std::vector<ParamSpec> specs = build_param_specs(model_preset("gpt2-124M"));
  ASSERT_EQ(specs.size(), 2 + 12 * 12 + 2u);
  EXPECT_EQ(specs[1].name, "transformer.wpe.weight");
  EXPECT_EQ(specs[1].shape, (Shape{1024, 768}));
  EXPECT_EQ(find_spec(specs, "transformer.h.11.attn.c_attn.weight").shape, (Shape{768, 2304}));
  EXPECT_EQ(find_spec(specs, "transformer.h.11.attn.c_attn.bias").shape, (Shape{2304}));
  EXPECT_EQ(find_spec(specs, "transformer.h.0.mlp.c_fc.weight").shape, (Shape{768, 3072}));
  EXPECT_EQ(find_spec(specs, "transformer.h.0.mlp.c_proj.weight").shape, (Shape{3072, 768}));
  EXPECT_EQ(find_spec(specs, "transformer.h.0.ln_1.bias").role, ParamRole::no_decay);
  EXPECT_EQ(find_spec(specs, "transformer.h.0.ln_1.bias").init, InitKind::zeros);
  EXPECT_EQ(find_spec(specs, "transformer.h.0.mlp.c_fc.bias").role, ParamRole::no_decay);
  EXPECT_EQ(find_spec(specs, "transformer.wte.weight").role, ParamRole::decay);
  EXPECT_EQ(specs.back().name, "transformer.ln_f.bias");
  // Residual output projections start smaller: 0.02 / sqrt(2 * 12).
  EXPECT_FLOAT_EQ(find_spec(specs, "transformer.h.3.mlp.c_proj.weight").init_std,
                  0.02f / std::sqrt(24.0f));
  EXPECT_FLOAT_EQ(find_spec(specs, "transformer.h.3.attn.c_proj.weight").init_std,
                  0.02f / std::sqrt(24.0f));
  EXPECT_FLOAT_EQ(find_spec(specs, "transformer.h.3.mlp.c_fc.weight").init_std, 0.02f);
}

TEST(ParamInit, DependsOnlyOnSeedNameAndIndex) {
  ParamSpec a;
  a.name = "model.layers.0.self_attn.q_proj.weight";
  a.shape = {8, 16};
  std::vector<float> x(128), y(128);
  init_parameter(a, 7, x.data());
  init_parameter(a, 7, y.data());
  EXPECT_EQ(x, y);

  // Another shape with the same name: the shared elements are the same values.
  ParamSpec longer = a;
  longer.shape = {16, 16};
  std::vector<float> z(256);
  init_parameter(longer, 7, z.data());
  EXPECT_TRUE(std::equal(x.begin(), x.end(), z.begin()));

  init_parameter(a, 8, y.data());
  EXPECT_NE(x, y);
  ParamSpec b = a;
  b.name = "model.layers.0.self_attn.k_proj.weight";
  init_parameter(b, 7, y.data());
  EXPECT_NE(x, y);
}

TEST(ParamInit, NormalHasTheRequestedScaleAndConstantsAreExact) {
  ParamSpec s;
  s.name = "w";
  s.shape = {100000};
  s.init_std = 0.05f;
  std::vector<float> v(100000);
  init_parameter(s, 1, v.data());
  double sum = 0, sq = 0;
  for (float e : v) sum += e, sq += double(e) * e;
  const double mean = sum / 1e5, sd = std::sqrt(sq / 1e5 - mean * mean);
  EXPECT_NEAR(mean, 0.0, 0.002);
  EXPECT_NEAR(sd, 0.05, 0.001);
  s.init = InitKind::ones;
  init_parameter(s, 1, v.data());
  EXPECT_EQ(v[123], 1.0f);
  s.init = InitKind::zeros;
  init_parameter(s, 1, v.data());
  EXPECT_EQ(v[99999], 0.0f);
}

TEST(ModelParams, FlatLayoutAndLayoutIndependentInit) {
  const ModelConfig c = testing::tiny_llama(false);
  testing::CpuModel m(c, Precision::bf16, 1);
  Model& model = m.model;
  EXPECT_EQ(model.num_params(), c.num_params());
  model.init_weights(42);

  int64_t offset = 0;
  for (const Parameter& p : model.params()) {
    EXPECT_EQ(p.offset, offset) << p.spec.name;
    EXPECT_EQ(p.master.data<float>(), model.flat_master().data<float>() + offset);
    EXPECT_EQ(p.grad.data<float>(), model.flat_grad().data<float>() + offset);
    EXPECT_EQ(p.compute.defined(), p.spec.matmul_weight) << p.spec.name;
    offset += p.spec.numel();
    // Initialising the spec alone gives the model's slice.
    std::vector<float> alone(static_cast<size_t>(p.spec.numel()));
    init_parameter(p.spec, 42, alone.data());
    EXPECT_TRUE(std::equal(alone.begin(), alone.end(), p.master.data<float>())) << p.spec.name;
  }
  EXPECT_EQ(offset, model.num_params());

  // One GEMM each: q|k|v and gate|up are adjacent, in master, grad and compute buffers.
  const Parameter& q = model.param("model.layers.1.self_attn.q_proj.weight");
  const Parameter& k = model.param("model.layers.1.self_attn.k_proj.weight");
  const Parameter& v = model.param("model.layers.1.self_attn.v_proj.weight");
  EXPECT_EQ(k.offset, q.offset + q.spec.numel());
  EXPECT_EQ(v.offset, k.offset + k.spec.numel());
  EXPECT_EQ(k.compute.data<bf16>(), q.compute.data<bf16>() + q.spec.numel());
  EXPECT_EQ(v.compute.data<bf16>(), k.compute.data<bf16>() + k.spec.numel());
  const Parameter& gate = model.param("model.layers.0.mlp.gate_proj.weight");
  const Parameter& up = model.param("model.layers.0.mlp.up_proj.weight");
  EXPECT_EQ(up.offset, gate.offset + gate.spec.numel());
  EXPECT_EQ(up.compute.data<bf16>(), gate.compute.data<bf16>() + gate.spec.numel());

  // Compute copies are the rounded masters.
  EXPECT_EQ(bf16_to_float(q.compute.data<bf16>()[5]),
            bf16_to_float(float_to_bf16(q.master.data<float>()[5])));
  EXPECT_THROW(model.param("model.layers.9.mlp.up_proj.weight"), Error);
}

}  // namespace
}  // namespace meshtrain
