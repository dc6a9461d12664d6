// Units, unit hooks and external parameter storage: the contract ZeRO builds on.
// The units cover the registry once; the hooks fire in the documented order;
// a model whose views an owner binds only inside before/after windows computes
// the flat model's loss and gradients bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "meshtrain/model/model.h"
#include "meshtrain/util/error.h"
#include "support/tiny_models.h"

namespace meshtrain {
namespace {

struct Case {
  ModelConfig config;
  const char* name;
};

std::vector<Case> cases() {
  return {{testing::tiny_llama(false), "llama untied"},
          {testing::tiny_llama(true), "llama tied"},
          {testing::tiny_gpt2(), "gpt2"}};
}

TEST(Units, CoverTheRegistryOnceAndContiguously) {
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    testing::CpuModel m(c.config, Precision::fp32, 1);
    const std::vector<ParamUnit>& units = m.model.units();
    const std::vector<Parameter>& params = m.model.params();
    const size_t L = static_cast<size_t>(c.config.n_layers);
    ASSERT_EQ(units.size(), L + 2);
    size_t next = 0;
    for (const ParamUnit& u : units) {
      EXPECT_EQ(u.first_param, next) << u.name;
      EXPECT_LT(u.first_param, u.end_param) << u.name;
      next = u.end_param;
    }
    EXPECT_EQ(next, params.size());
    EXPECT_EQ(units.front().name, "embed");
    EXPECT_EQ(units.back().name, "head");
    const bool llama = c.config.family == Family::llama;
    for (size_t l = 0; l < L; ++l) {
      const ParamUnit& u = units[1 + l];
      EXPECT_EQ(u.name, "layers." + std::to_string(l));
      const std::string prefix =
          (llama ? "model.layers." : "transformer.h.") + std::to_string(l) + ".";
      for (size_t i = u.first_param; i < u.end_param; ++i) {
        EXPECT_EQ(params[i].spec.name.rfind(prefix, 0), 0u) << params[i].spec.name;
      }
    }
    auto names = [&](const ParamUnit& u) {
      std::vector<std::string> out;
      for (size_t i = u.first_param; i < u.end_param; ++i) out.push_back(params[i].spec.name);
      return out;
    };
    using Names = std::vector<std::string>;
    if (!llama) {
      EXPECT_EQ(names(units.front()), (Names{"transformer.wte.weight", "transformer.wpe.weight"}));
      EXPECT_EQ(names(units.back()), (Names{"transformer.ln_f.weight", "transformer.ln_f.bias"}));
    } else if (c.config.tie_embeddings) {
      EXPECT_EQ(names(units.front()), Names{"model.embed_tokens.weight"});
      EXPECT_EQ(names(units.back()), Names{"model.norm.weight"});
    } else {
      EXPECT_EQ(names(units.front()), Names{"model.embed_tokens.weight"});
      EXPECT_EQ(names(units.back()), (Names{"model.norm.weight", "lm_head.weight"}));
    }
    // The free function gives the same units without a model.
    const std::vector<ParamUnit> built = build_param_units(c.config);
    ASSERT_EQ(built.size(), units.size());
    for (size_t u = 0; u < units.size(); ++u) {
      EXPECT_EQ(built[u].name, units[u].name);
      EXPECT_EQ(built[u].first_param, units[u].first_param);
      EXPECT_EQ(built[u].end_param, units[u].end_param);
    }
  }
}

TEST(Units, ComputeDtypeIsBf16ForMatmulWeightsInBf16Only) {
  testing::CpuModel m(testing::tiny_gpt2(), Precision::fp32, 1);
  for (const Parameter& p : m.model.params()) {
    EXPECT_EQ(param_compute_dtype(p.spec, Precision::fp32), DType::f32) << p.spec.name;
    EXPECT_EQ(param_compute_dtype(p.spec, Precision::bf16),
              p.spec.matmul_weight ? DType::bf16 : DType::f32)
        << p.spec.name;
  }
  EXPECT_EQ(param_compute_dtype(m.model.param("transformer.wte.weight").spec, Precision::bf16),
            DType::bf16);
  EXPECT_EQ(param_compute_dtype(m.model.param("transformer.wpe.weight").spec, Precision::bf16),
            DType::f32);
}

// Every hook call as "before|after <unit> fwd|bwd".
std::vector<std::string> record_hooks(Model& model, const std::function<void()>& run) {
  std::vector<std::string> events;
  auto recorder = [&](const char* what) {
    return [&events, &model, what](size_t u, UnitPass pass) {
      events.push_back(std::string(what) + " " + model.units()[u].name +
                       (pass == UnitPass::forward ? " fwd" : " bwd"));
    };
  };
  model.unit_hooks.before = recorder("before");
  model.unit_hooks.after = recorder("after");
  run();
  model.unit_hooks = UnitHooks{};
  return events;
}

using Events = std::vector<std::string>;

TEST(UnitHooks, FireInTheDocumentedSequence) {
  const Events trunk = {"before embed fwd",    "after embed fwd",    "before layers.0 fwd",
                        "after layers.0 fwd",  "before layers.1 fwd", "after layers.1 fwd"};
  auto with_trunk = [&](const Events& rest) {
    Events all = trunk;
    all.insert(all.end(), rest.begin(), rest.end());
    return all;
  };
  const Events layers_bwd = {"before layers.1 bwd", "after layers.1 bwd", "before layers.0 bwd",
                             "after layers.0 bwd"};
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    const bool tied = c.config.family == Family::gpt2 || c.config.tie_embeddings;
    Events train, infer;
    if (tied) {
      train = with_trunk({"before head fwd", "after head fwd", "before head bwd",
                          "before embed bwd", "after head bwd"});
      train.insert(train.end(), layers_bwd.begin(), layers_bwd.end());
      train.push_back("after embed bwd");
      infer = with_trunk(
          {"before head fwd", "before embed fwd", "after embed fwd", "after head fwd"});
    } else {
      train = with_trunk(
          {"before head fwd", "after head fwd", "before head bwd", "after head bwd"});
      train.insert(train.end(), layers_bwd.begin(), layers_bwd.end());
      train.push_back("before embed bwd");
      train.push_back("after embed bwd");
      infer = with_trunk({"before head fwd", "after head fwd"});
    }
    for (Precision prec : {Precision::fp32, Precision::bf16}) {
      testing::CpuModel m(c.config, prec, 1);
      Model& model = m.model;
      model.init_weights(3);
      const int64_t B = 2, T = 4, V = c.config.vocab_size;
      auto tokens = testing::random_ids(1, B * T, V), targets = testing::random_ids(2, B * T, V);
      for (int step = 0; step < 2; ++step) {  // the same every micro-batch
        EXPECT_EQ(record_hooks(model, [&] {
                    model.forward_backward(tokens.data(), targets.data(), B, T, 0.1f);
                  }),
                  train);
      }
      EXPECT_EQ(record_hooks(model,
                             [&] { model.forward_loss(tokens.data(), targets.data(), B, T); }),
                infer);
      std::vector<float> logits(static_cast<size_t>(B * T * V));
      EXPECT_EQ(record_hooks(model,
                             [&] { model.forward_logits(tokens.data(), B, T, logits.data()); }),
                infer);
      KVCache cache = model.make_kv_cache(B, T);
      EXPECT_EQ(
          record_hooks(model, [&] { model.decode(tokens.data(), B, 1, cache, logits.data()); }),
          infer);
    }
  }
}

// What an owner of external storage keeps: one buffer per role, laid out like
// the flat model (registry order, offsets as in Parameter::offset).
struct OwnerBuffers {
  Tensor master, compute, grad;
  OwnerBuffers(const Model& model, float fill, MemoryTracker& tracker) {
    const Shape n{model.num_params()};
    master = Tensor(n, DType::f32, MemCategory::params, tracker);
    compute = Tensor(n, DType::bf16, MemCategory::params, tracker);
    grad = Tensor(n, DType::f32, MemCategory::grads, tracker);
    if (fill != 0) {
      std::vector<float> v(static_cast<size_t>(model.num_params()), fill);
      std::memcpy(master.raw(), v.data(), master.bytes());
      std::memcpy(grad.raw(), v.data(), grad.bytes());
      convert(DType::f32, v.data(), DType::bf16, compute.raw(), v.size());
    }
  }
};

// Binds unit u's views of `model` to `buffers`: the value view of each
// parameter's compute dtype and the grad; the f32 master of a bf16 embedding
// only when `embed_master`.
void bind_unit(Model& model, size_t u, OwnerBuffers& buffers, bool embed_master) {
  const ParamUnit& unit = model.units()[u];
  for (size_t i = unit.first_param; i < unit.end_param; ++i) {
    Parameter& p = model.params()[i];
    const bool f32 = param_compute_dtype(p.spec, model.precision()) == DType::f32;
    const bool with_master = f32 || (i == 0 && embed_master);
    p.master = with_master ? buffers.master.view(p.offset, p.spec.shape) : Tensor();
    p.compute = f32 ? Tensor() : buffers.compute.view(p.offset, p.spec.shape);
    p.grad = buffers.grad.view(p.offset, p.spec.shape);
  }
}

std::vector<float> to_vector(const Tensor& t) {
  return std::vector<float>(t.data<float>(), t.data<float>() + t.numel());
}

// The flat model (A) and an external one (B) whose owner binds each unit's real
// buffers in before(u) and NaN-filled ones in after(u): B must read and write
// its parameters only inside the windows to reproduce A bit for bit, over two
// accumulated micro-batches, evaluation and logits.
void expect_external_matches_flat(const ModelConfig& config, Precision prec, bool embed_master) {
  testing::CpuModel a(config, prec, 1);
  testing::init_for_test(a.model, 11);
  const bool bf16_embed =
      param_compute_dtype(a.model.params()[0].spec, prec) == DType::bf16;
  if (bf16_embed && !embed_master) {
    // B then looks rows up in the bf16 copy: A's f32 embedding rounded likewise.
    Tensor& w = a.model.params()[0].master;
    w.copy_from(a.model.params()[0].compute);
  }

  Model b(config, prec, a.ctx, ParamStorage::external);
  OwnerBuffers real(b, 0.0f, a.tracker);
  OwnerBuffers poison(b, std::numeric_limits<float>::quiet_NaN(), a.tracker);
  real.master.copy_from(a.model.flat_master());
  for (const Parameter& p : a.model.params()) {
    if (p.compute.defined()) real.compute.view(p.offset, p.spec.shape).copy_from(p.compute);
  }
  for (size_t u = 0; u < b.units().size(); ++u) bind_unit(b, u, poison, embed_master);
  b.unit_hooks.before = [&](size_t u, UnitPass) { bind_unit(b, u, real, embed_master); };
  b.unit_hooks.after = [&](size_t u, UnitPass) { bind_unit(b, u, poison, embed_master); };

  const int64_t B = 2, T = 7, V = config.vocab_size, n = B * T;
  a.model.zero_grads();
  for (uint64_t k = 0; k < 2; ++k) {
    auto tokens = testing::random_ids(20 + k, n, V), targets = testing::random_ids(30 + k, n, V);
    const double la = a.model.forward_backward(tokens.data(), targets.data(), B, T, 0.05f);
    const double lb = b.forward_backward(tokens.data(), targets.data(), B, T, 0.05f);
    EXPECT_EQ(la, lb) << "micro-batch " << k;
  }
  const std::vector<float> ga = to_vector(a.model.flat_grad()), gb = to_vector(real.grad);
  for (const Parameter& p : a.model.params()) {
    EXPECT_EQ(std::memcmp(ga.data() + p.offset, gb.data() + p.offset,
                          static_cast<size_t>(p.spec.numel()) * sizeof(float)),
              0)
        << "gradient of " << p.spec.name;
  }
  EXPECT_GT(std::fabs(gb[5]), 0.0f);

  auto tokens = testing::random_ids(40, n, V), targets = testing::random_ids(41, n, V);
  EXPECT_EQ(a.model.forward_loss(tokens.data(), targets.data(), B, T),
            b.forward_loss(tokens.data(), targets.data(), B, T));
  std::vector<float> logits_a(static_cast<size_t>(n * V)), logits_b(logits_a.size());
  a.model.forward_logits(tokens.data(), B, T, logits_a.data());
  b.forward_logits(tokens.data(), B, T, logits_b.data());
  EXPECT_EQ(std::memcmp(logits_a.data(), logits_b.data(), logits_a.size() * sizeof(float)), 0);
}

TEST(ExternalStorage, BoundViewsGiveTheFlatModelsLossAndGradientsBitForBit) {
  for (const Case& c : cases()) {
    for (Precision prec : {Precision::fp32, Precision::bf16}) {
      SCOPED_TRACE(std::string(c.name) + " " + std::string(precision_name(prec)));
      expect_external_matches_flat(c.config, prec, true);
      // A tied bf16 embedding bound as its bf16 copy only (what a ZeRO narrow
      // group holds): the flat model with that embedding rounded to bf16.
      if (prec == Precision::bf16) expect_external_matches_flat(c.config, prec, false);
    }
  }
}

TEST(ExternalStorage, AllocatesNothingAndRejectsFlatOnlyCalls) {
  const ModelConfig c = testing::tiny_llama(false);
  testing::CpuModel flat(c, Precision::bf16, 1);
  const size_t params_before = flat.tracker.live(MemCategory::params);
  Model model(c, Precision::bf16, flat.ctx, ParamStorage::external);
  EXPECT_EQ(model.storage(), ParamStorage::external);
  EXPECT_EQ(model.num_params(), flat.model.num_params());
  EXPECT_LT(flat.tracker.live(MemCategory::params) - params_before, size_t{1} << 16);  // rope
  for (const Parameter& p : model.params()) {
    EXPECT_FALSE(p.master.defined() || p.grad.defined() || p.compute.defined()) << p.spec.name;
  }
  auto expect_error = [](const std::function<void()>& call, const std::string& needle) {
    try {
      call();
      ADD_FAILURE() << "no error; expected one mentioning '" << needle << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error([&] { model.init_weights(1); }, "init_weights needs flat parameter storage");
  expect_error([&] { model.sync_compute_weights(); }, "external");
  expect_error([&] { model.zero_grads(); }, "external");
  expect_error([&] { model.flat_master(); }, "flat_master() needs flat");
  expect_error([&] { model.flat_grad(); }, "external");
  std::vector<int32_t> ids(8, 1);
  std::vector<float> logits(static_cast<size_t>(c.vocab_size) * 8);
  KVCache cache = model.make_kv_cache(1, 8);
  expect_error([&] { model.decode(ids.data(), 1, 1, cache, logits.data()); }, "decode");
  // Nothing bound: the first parameter read is named.
  expect_error([&] { model.forward_backward(ids.data(), ids.data(), 2, 4, 1.0f); },
               "'model.embed_tokens.weight' (unit 'embed') needs its master view");

  // A unit bound with the wrong dtype, or with q|k|v not adjacent.
  MemoryTracker& tracker = flat.tracker;
  OwnerBuffers buffers(model, 0.0f, tracker);
  model.unit_hooks.before = [&](size_t u, UnitPass) { bind_unit(model, u, buffers, false); };
  model.forward_backward(ids.data(), ids.data(), 2, 4, 1.0f);  // all bound: runs
  Parameter& k = model.param("model.layers.1.self_attn.k_proj.weight");
  model.unit_hooks.before = [&](size_t u, UnitPass) {
    bind_unit(model, u, buffers, false);
    if (u == 2) k.compute = buffers.compute.view(k.offset + 1, k.spec.shape);
  };
  expect_error([&] { model.forward_loss(ids.data(), ids.data(), 2, 4); },
               "'model.layers.1.self_attn.k_proj.weight' must directly follow "
               "'model.layers.1.self_attn.q_proj.weight'");
  model.unit_hooks.before = [&](size_t u, UnitPass) {
    bind_unit(model, u, buffers, false);
    if (u == 2) k.compute = buffers.master.view(k.offset, k.spec.shape);
  };
  expect_error([&] { model.forward_loss(ids.data(), ids.data(), 2, 4); },
               "needs its compute view bound (bf16 x [8, 16]) before the model uses it; found "
               "f32 x [8, 16]");
  model.unit_hooks.before = [&](size_t u, UnitPass pass) {
    bind_unit(model, u, buffers, false);
    if (pass == UnitPass::backward) model.params()[model.units()[u].first_param].grad = Tensor();
  };
  expect_error([&] { model.forward_backward(ids.data(), ids.data(), 2, 4, 1.0f); },
               "needs its grad view bound");
}

}  // namespace
}  // namespace meshtrain
