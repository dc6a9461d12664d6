// LoRA exports from synthetic checkpoints (a TensorSource holding a base model and
// adapters under the checkpoint's names): the merge against float64, the merged
// HF export, PEFT's adapter layout and its round trip, and the agreement of the
// two (merging PEFT's adapter in HF's row order gives the merged export).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <set>
#include <nlohmann/json.hpp>

#include "meshtrain/backend/cpu/context.h"
#include "meshtrain/ckpt/hf.h"
#include "meshtrain/ckpt/lora_export.h"
#include "meshtrain/ckpt/safetensors.h"
#include "meshtrain/model/params.h"
#include "meshtrain/util/rng.h"
#include "support/scratch.h"
#include "util.h"

namespace meshtrain {
namespace {

namespace fs = std::filesystem;
using ckpt_test::CkptTest;

// A checkpoint as a map: the base model and every adapter, random (B non-zero).
struct SyntheticCheckpoint {
  std::map<std::string, std::vector<float>> tensors;
  std::set<std::string> asked;  // names a reader asked for

  void add(const ParamSpec& spec, uint64_t seed, float std) {
    std::vector<float>& v = tensors[spec.name];
    v.resize(static_cast<size_t>(spec.numel()));
    const uint64_t key = stream_key(seed, spec.name);
    for (size_t i = 0; i < v.size(); ++i) v[i] = normal_at(key, i) * std;
  }
  TensorSource source() {
    return [this](const ParamSpec& spec, float* out) {
      auto it = tensors.find(spec.name);
      ASSERT_NE(it, tensors.end()) << spec.name;
      ASSERT_EQ(static_cast<int64_t>(it->second.size()), spec.numel()) << spec.name;
      asked.insert(spec.name);
      std::copy(it->second.begin(), it->second.end(), out);
    };
  }
};

// Base and adapters (B non-zero), as a LoRA run's checkpoint holds them.
SyntheticCheckpoint lora_checkpoint(const ModelConfig& c) {
  SyntheticCheckpoint ck;
  for (const ParamSpec& spec : build_param_specs(c)) ck.add(spec, 1, spec.lora_adapter ? 0.5f : 0.3f);
  return ck;
}

ModelConfig with_lora(ModelConfig c, std::vector<std::string> targets) {
  c.lora = {.rank = 3, .alpha = 6.0f, .dropout = 0.05f, .targets = std::move(targets)};
  c.validate();
  return c;
}

std::vector<float> read_all(const SafetensorsReader& r, const std::string& name) {
  MemoryTracker tracker;
  const Tensor t = r.read_tensor(name, DType::f32, MemCategory::workspace, tracker);
  return {t.data<float>(), t.data<float>() + t.numel()};
}

TEST(LoraModules, FindTheTargetsOfEachFamily) {
  const ModelConfig llama = with_lora(testing::small_llama(false), {"q_proj", "v_proj"});
  const auto q_v = lora_modules(llama);
  ASSERT_EQ(q_v.size(), 4u);  // 2 layers
  EXPECT_EQ(q_v[0].module, "model.layers.0.self_attn.q_proj");
  EXPECT_EQ(q_v[0].a.shape, (Shape{3, llama.dim}));
  EXPECT_EQ(q_v[1].module, "model.layers.0.self_attn.v_proj");
  EXPECT_EQ(q_v[1].b.shape, (Shape{llama.n_kv_heads * llama.head_dim(), 3}));
  EXPECT_FALSE(q_v[0].conv1d);

  // GPT-2: Conv1D [in, out] bases, PEFT's [r, in] / [out, r] adapters; c_proj is
  // the attention's and the MLP's (a suffix match, as PEFT does).
  const ModelConfig gpt2 = with_lora(testing::small_gpt2(), {"c_proj", "c_fc"});
  const auto proj = lora_modules(gpt2);
  ASSERT_EQ(proj.size(), 6u);
  EXPECT_EQ(proj[0].module, "transformer.h.0.attn.c_proj");
  EXPECT_EQ(proj[1].module, "transformer.h.0.mlp.c_fc");
  EXPECT_TRUE(proj[1].conv1d);
  EXPECT_EQ(proj[1].a.shape, (Shape{3, gpt2.dim}));
  EXPECT_EQ(proj[1].b.shape, (Shape{gpt2.hidden_dim, 3}));
  EXPECT_EQ(proj[2].a.shape, (Shape{3, gpt2.hidden_dim}));  // mlp.c_proj: in = hidden

  EXPECT_TRUE(lora_modules(without_lora(gpt2)).empty());
  EXPECT_TRUE(is_lora_tensor("transformer.h.0.attn.c_attn.lora_B.weight"));
  EXPECT_FALSE(is_lora_tensor("transformer.h.0.attn.c_attn.weight"));
}

// Against a float64 merge: each element is the double result rounded once.
TEST(LoraMerge, EqualsFloat64BaseplusScaledBA) {
  const int64_t r = 4, in = 37, out = 29;
  const float scale = 16.0f / 4;
  for (bool conv1d : {false, true}) {
    SCOPED_TRACE(conv1d ? "conv1d" : "linear");
    std::vector<float> a(r * in), b(out * r), w(out * in);
    const uint64_t key = stream_key(7, "merge");
    for (size_t i = 0; i < a.size(); ++i) a[i] = normal_at(key, i);
    for (size_t i = 0; i < b.size(); ++i) b[i] = normal_at(key, 1000 + i) * 0.01f;
    for (size_t i = 0; i < w.size(); ++i) w[i] = normal_at(key, 5000 + i);
    std::vector<float> merged = w;
    merge_lora_delta(a.data(), b.data(), r, in, out, scale, conv1d, merged.data());
    double worst_f32_accumulation = 0;
    for (int64_t o = 0; o < out; ++o) {
      for (int64_t i = 0; i < in; ++i) {
        double delta = 0;
        float delta_f32 = 0;
        for (int64_t k = 0; k < r; ++k) {
          delta += static_cast<double>(b[o * r + k]) * a[k * in + i];
          delta_f32 += b[o * r + k] * a[k * in + i];
        }
        const int64_t at = conv1d ? i * out + o : o * in + i;
        const double want = w[at] + scale * delta;
        EXPECT_EQ(merged[at], static_cast<float>(want)) << o << "," << i;
        worst_f32_accumulation = std::max(
            worst_f32_accumulation, std::abs(static_cast<double>(w[at] + scale * delta_f32) - want));
      }
    }
    // What an all-f32 merge (PEFT's, torch matmul) would differ by: an ulp or so of W.
    EXPECT_LT(worst_f32_accumulation, 1e-6);
  }
}

class LoraExport : public CkptTest {};

// The merged HF export: targeted weights are W + scale·BA (in HF's row order
// for q/k), the rest as stored, no adapter tensor; the adapters are read.
TEST_F(LoraExport, MergedHfExportHoldsBasePlusDeltaAndNoAdapters) {
  for (const ModelConfig& c :
       {with_lora(testing::small_llama(false), {"q_proj", "k_proj", "v_proj", "down_proj"}),
        with_lora(testing::small_gpt2(), {"c_attn", "c_proj"})}) {
    SCOPED_TRACE(family_name(c.family));
    SyntheticCheckpoint ck = lora_checkpoint(c);
    const std::string out = dir + "/" + std::string(family_name(c.family));
    export_hf(without_lora(c), merge_lora(c, ck.source()), out);
    const std::vector<LoraModule> modules = lora_modules(c);
    for (const LoraModule& m : modules) {
      EXPECT_EQ(ck.asked.count(m.a.name), 1u) << m.module;
    }
    const SafetensorsReader hf(out + "/model.safetensors");
    for (const StTensorInfo& t : hf.tensors()) EXPECT_FALSE(is_lora_tensor(t.name)) << t.name;
    for (const LoraModule& m : modules) {
      SCOPED_TRACE(m.module);
      std::vector<float> want = ck.tensors[m.base.name];
      merge_lora_delta(ck.tensors[m.a.name].data(), ck.tensors[m.b.name].data(),
                       m.rank, m.in_features, m.out_features, c.lora.scale(), m.conv1d, want.data());
      if (auto [heads, hd] = rope_rows(c, m.base.name); heads != 0) {
        std::vector<float> permuted(want.size());
        rope_rows_to_hf(want.data(), permuted.data(), heads, hd, m.in_features);
        want = permuted;
      }
      EXPECT_EQ(read_all(hf, m.base.name), want);
      EXPECT_NE(want, ck.tensors[m.base.name]);  // the adapters changed it
    }
    // An untouched tensor is as stored.
    const std::string other = c.family == Family::llama ? "model.layers.1.self_attn.o_proj.weight"
                                                        : "transformer.h.1.mlp.c_fc.weight";
    EXPECT_EQ(read_all(hf, other), ck.tensors[other]);
  }
}

// PEFT's layout, and the identity PEFT relies on: merging the exported adapter
// into the exported (HF-order) base gives the merged export.
TEST_F(LoraExport, PeftAdapterMergedIntoHfBaseEqualsTheMergedExport) {
  for (const ModelConfig& c : {with_lora(testing::small_llama(true), {"q_proj", "k_proj", "o_proj"}),
                               with_lora(testing::small_gpt2(), {"c_attn", "c_fc"})}) {
    SCOPED_TRACE(family_name(c.family));
    const LoraConfig& lora = c.lora;
    SyntheticCheckpoint ck = lora_checkpoint(c);
    const std::string base = dir + "/base_" + std::string(family_name(c.family));
    const std::string merged = dir + "/merged_" + std::string(family_name(c.family));
    const std::string peft = dir + "/peft_" + std::string(family_name(c.family));
    export_hf(without_lora(c), ck.source(), base);
    export_hf(without_lora(c), merge_lora(c, ck.source()), merged);
    export_peft(c, ck.source(), peft, "my/base");

    const nlohmann::json cfg = nlohmann::json::parse(testing::read_file(peft + "/adapter_config.json"));
    EXPECT_EQ(cfg["peft_type"], "LORA");
    EXPECT_EQ(cfg["task_type"], "CAUSAL_LM");
    EXPECT_EQ(cfg["r"], 3);
    EXPECT_EQ(cfg["lora_alpha"], 6.0);
    EXPECT_EQ(cfg["lora_dropout"], 0.05);
    EXPECT_EQ(cfg["target_modules"], nlohmann::json(lora.targets));
    EXPECT_EQ(cfg["fan_in_fan_out"], c.family == Family::gpt2);
    EXPECT_EQ(cfg["bias"], "none");
    EXPECT_EQ(cfg["base_model_name_or_path"], "my/base");

    const SafetensorsReader adapter(peft + "/adapter_model.safetensors");
    const SafetensorsReader base_hf(base + "/model.safetensors");
    const SafetensorsReader merged_hf(merged + "/model.safetensors");
    const std::vector<LoraModule> modules = lora_modules(c);
    EXPECT_EQ(adapter.tensors().size(), 2 * modules.size());
    for (const LoraModule& m : modules) {
      SCOPED_TRACE(m.module);
      const std::vector<float> a = read_all(adapter, "base_model.model." + m.module + ".lora_A.weight");
      const std::vector<float> b = read_all(adapter, "base_model.model." + m.module + ".lora_B.weight");
      EXPECT_EQ(a, ck.tensors[m.a.name]);
      std::vector<float> w = read_all(base_hf, m.base.name);
      merge_lora_delta(a.data(), b.data(), m.rank, m.in_features, m.out_features, lora.scale(),
                       m.conv1d, w.data());
      EXPECT_EQ(w, read_all(merged_hf, m.base.name));
    }

    // Read back: meshtrain's names and row order again.
    const PeftAdapter back = read_peft_adapter(peft, without_lora(c));
    EXPECT_EQ(back.config.lora, c.lora);
    EXPECT_EQ(back.base_model, "my/base");
    ASSERT_EQ(back.tensors.size(), 2 * modules.size());
    for (const auto& [name, values] : back.tensors) EXPECT_EQ(values, ck.tensors[name]) << name;
  }
}

TEST_F(LoraExport, ReadPeftAdapterRefusesWhatItCannotMerge) {
  const ModelConfig c = with_lora(testing::small_llama(false), {"q_proj"});
  SyntheticCheckpoint ck = lora_checkpoint(c);
  export_peft(c, ck.source(), dir);
  const std::string config = dir + "/adapter_config.json";
  const std::string text = testing::read_file(config);
  auto edit = [&](const char* key, const nlohmann::json& value) {
    nlohmann::json j = nlohmann::json::parse(text);
    j[key] = value;
    testing::write_file(config, j.dump());
  };
  edit("bias", "all");
  EXPECT_ERROR(read_peft_adapter(dir, without_lora(c)), "adapter_config.json", "'bias'");
  edit("use_dora", true);
  EXPECT_ERROR(read_peft_adapter(dir, without_lora(c)), "adapter_config.json", "'use_dora'");
  edit("target_modules", "all-linear");
  EXPECT_ERROR(read_peft_adapter(dir, without_lora(c)), "adapter_config.json", "'target_modules'");
  edit("r", 4);  // the tensors are r = 3
  EXPECT_ERROR(read_peft_adapter(dir, without_lora(c)), "adapter_model.safetensors", "lora_A.weight' has shape");
  edit("target_modules", nlohmann::json::array({"q_proj", "v_proj"}));  // v_proj has none
  EXPECT_ERROR(read_peft_adapter(dir, without_lora(c)), "adapter_model.safetensors", "v_proj.lora_A.weight' is missing");
  edit("target_modules", nlohmann::json::array({"k_proj"}));  // q_proj's tensors belong to nothing
  EXPECT_ERROR(read_peft_adapter(dir, without_lora(c)), "adapter_model.safetensors", "k_proj.lora_A.weight' is missing");
  edit("target_modules", nlohmann::json::array({"c_attn"}));
  EXPECT_ERROR(read_peft_adapter(dir, without_lora(c)), "adapter_config.json", "'c_attn' is not a linear layer of llama");
}

// Adapters PyPI peft wrote (tests/reference/peft_models.py; the hf-venv ctest
// points MESHTRAIN_HF_FIXTURES at freshly written ones): read, merged into the
// base, they give peft's merge_and_unload() weights (1e-6) and PeftModel's
// logits (1e-5). Llama with GQA and q/k/v/o/down targets; GPT-2's Conv1D.
TEST_F(LoraExport, PeftFixturesMergeAsPeftDoesAndGiveItsLogits) {
  const char* env = std::getenv("MESHTRAIN_HF_FIXTURES");
  const fs::path root = env != nullptr && *env != '\0'
                            ? fs::path(env)
                            : fs::path(MESHTRAIN_SOURCE_DIR) / "tests/reference/fixtures";
  for (const char* name : {"peft_tiny_llama", "peft_tiny_gpt2"}) {
    SCOPED_TRACE(name);
    const fs::path d = root / name;
    ASSERT_TRUE(fs::is_directory(d)) << d;
    std::unique_ptr<Model> base = import_hf((d / "base").string(), Precision::fp32, ctx);
    const ModelConfig& c = base->config();
    const PeftAdapter adapter = read_peft_adapter((d / "adapter").string(), c);
    EXPECT_FALSE(lora_modules(adapter.config).empty());
    const std::string merged_dir = dir + "/" + name;
    export_hf(c, merge_lora(adapter.config, with_adapter(model_tensors(*base), adapter)), merged_dir);

    const SafetensorsReader theirs((d / "merged.safetensors").string());
    const SafetensorsReader ours(merged_dir + "/model.safetensors");
    EXPECT_EQ(theirs.tensors().size(), ours.tensors().size());
    for (const StTensorInfo& t : theirs.tensors()) {
      const std::string our_name = c.family == Family::gpt2 && !t.name.starts_with("transformer.")
                                       ? "transformer." + t.name
                                       : t.name;
      const std::vector<float> want = read_all(theirs, t.name), got = read_all(ours, our_name);
      ASSERT_EQ(want.size(), got.size()) << t.name;
      double worst = 0;
      for (size_t i = 0; i < want.size(); ++i) {
        worst = std::max(worst, std::abs(static_cast<double>(want[i]) - got[i]) /
                                    std::max(1.0, std::abs(static_cast<double>(want[i]))));
      }
      EXPECT_LE(worst, 1e-6) << t.name;
    }

    std::unique_ptr<Model> merged = import_hf(merged_dir, Precision::fp32, ctx);
    const SafetensorsReader ref((d / "logits.safetensors").string());
    const std::vector<float> want = read_all(ref, "logits");
    const int64_t seq = ref.info("logits").shape[0];
    std::vector<int32_t> ids(static_cast<size_t>(seq));
    for (int64_t t = 0; t < seq; ++t) ids[static_cast<size_t>(t)] = static_cast<int32_t>((7 * t + 3) % c.vocab_size);
    std::vector<float> got(want.size());
    merged->forward_logits(ids.data(), 1, seq, got.data());
    double worst = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      worst = std::max(worst, std::abs(static_cast<double>(want[i]) - got[i]) /
                                  std::max(1.0, std::abs(static_cast<double>(want[i]))));
    }
    EXPECT_LE(worst, 1e-5);
  }
}

}  // namespace
}  // namespace meshtrain
