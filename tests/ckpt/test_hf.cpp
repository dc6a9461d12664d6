// Hugging Face config.json and weights: parsing, rejection of unsupported
// features, the q/k row permutation, import errors.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "meshtrain/ckpt/atomic_file.h"
#include "meshtrain/ckpt/hf.h"
#include "meshtrain/ckpt/safetensors.h"
#include "util.h"

namespace meshtrain {
namespace {

using testing::scratch_dir;

void expect_same_config(const ModelConfig& a, const ModelConfig& b) {
  EXPECT_EQ(a.family, b.family);
  EXPECT_EQ(a.dim, b.dim);
  EXPECT_EQ(a.n_layers, b.n_layers);
  EXPECT_EQ(a.n_heads, b.n_heads);
  EXPECT_EQ(a.n_kv_heads, b.n_kv_heads);
  EXPECT_EQ(a.hidden_dim, b.hidden_dim);
  EXPECT_EQ(a.vocab_size, b.vocab_size);
  EXPECT_EQ(a.max_seq_len, b.max_seq_len);
  EXPECT_EQ(a.norm_eps, b.norm_eps);
  EXPECT_EQ(a.tie_embeddings, b.tie_embeddings);
  EXPECT_EQ(a.init_std, b.init_std);
  if (a.family == Family::llama) {
    EXPECT_EQ(a.rope_theta, b.rope_theta);
    EXPECT_EQ(a.rope_scaling, b.rope_scaling);
  }
}

TEST(HfConfig, WriteThenParseGivesTheSameConfig) {
  for (ModelConfig c : {testing::small_llama(true), testing::small_llama(false),
                        testing::small_gpt2(), model_preset("gpt2-124M"),
                        model_preset("stories260K")}) {
    c.rope_theta = c.family == Family::llama ? 500000.0f : c.rope_theta;
    expect_same_config(parse_hf_config(hf_config_json(c), "config.json"), c);
  }
  ModelConfig scaled = testing::small_llama(false);
  scaled.rope_scaling = {RopeType::llama3, 8.0f, 1.0f, 4.0f, 8192};
  expect_same_config(parse_hf_config(hf_config_json(scaled), "config.json"), scaled);
  scaled.rope_scaling = {RopeType::linear, 2.0f};
  expect_same_config(parse_hf_config(hf_config_json(scaled), "config.json"), scaled);
  ModelConfig wide = testing::small_gpt2();
  wide.hidden_dim = 48;  // not 4 * dim: written as n_inner
  expect_same_config(parse_hf_config(hf_config_json(wide), "config.json"), wide);
  EXPECT_NE(hf_config_json(testing::small_llama(true)).find("\"rms_norm_eps\": 1e-05"),
            std::string::npos);
}

TEST(HfConfig, ParsesAHuggingFaceLlamaConfigWithDefaults) {
  const char* text = R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 5,
    "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 512,
    "bos_token_id": 1, "torch_dtype": "float32", "transformers_version": "4.40.0"})";
  ModelConfig c = parse_hf_config(text, "config.json");
  EXPECT_EQ(c.family, Family::llama);
  EXPECT_EQ(c.n_kv_heads, 4);
  EXPECT_EQ(c.max_seq_len, 2048);  // LlamaConfig's defaults
  EXPECT_FLOAT_EQ(c.norm_eps, 1e-6f);
  EXPECT_EQ(c.rope_theta, 10000.0f);
  EXPECT_FALSE(c.tie_embeddings);
}

TEST(HfConfig, ReadsEveryRopeFormTransformersWrites) {
  const std::string llama = R"({"model_type": "llama", "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 97)";
  // transformers >= 5: rope_parameters, no top-level rope_theta.
  ModelConfig v5 = parse_hf_config(llama + R"(, "rope_parameters": {"rope_type": "default",
    "rope_theta": 500000.0}})", "config.json");
  EXPECT_EQ(v5.rope_theta, 500000.0f);
  EXPECT_EQ(v5.rope_scaling.type, RopeType::none);
  ModelConfig v5_llama3 = parse_hf_config(llama + R"(, "rope_parameters": {"rope_type": "llama3",
    "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192}})", "config.json");
  EXPECT_EQ(v5_llama3.rope_theta, 500000.0f);
  EXPECT_EQ(v5_llama3.rope_scaling, (RopeScaling{RopeType::llama3, 8.0f, 1.0f, 4.0f, 8192}));
  // transformers 4: rope_theta + rope_scaling ("rope_type", or the older "type").
  ModelConfig v4 = parse_hf_config(llama + R"(, "rope_theta": 500000.0, "rope_scaling": {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192}})", "config.json");
  EXPECT_EQ(v4.rope_theta, 500000.0f);
  EXPECT_EQ(v4.rope_scaling, v5_llama3.rope_scaling);
  ModelConfig old = parse_hf_config(llama + R"(, "rope_scaling": {"type": "linear", "factor": 2.0}})",
                                    "config.json");
  EXPECT_EQ(old.rope_scaling, (RopeScaling{RopeType::linear, 2.0f}));
  EXPECT_EQ(old.rope_theta, 10000.0f);
}

TEST(HfConfig, BadConfigsNameTheFileAndKey) {
  const std::string llama = R"("model_type": "llama", "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 97)";
  auto parse = [](const std::string& body) { parse_hf_config("{" + body + "}", "cfg/config.json"); };
  EXPECT_ERROR(parse_hf_config("{", "cfg/config.json"), "cfg/config.json", "not valid JSON");
  EXPECT_ERROR(parse(R"("model_type": "falcon")"), "cfg/config.json", "model_type 'falcon'");
  EXPECT_ERROR(parse(R"("model_type": "llama", "hidden_size": 64)"), "cfg/config.json",
               "key 'intermediate_size' is missing");
  EXPECT_ERROR(parse(llama + R"(, "num_key_value_heads": "two")"), "cfg/config.json",
               "key 'num_key_value_heads' must be a positive integer");
  EXPECT_ERROR(parse(llama + R"(, "num_key_value_heads": 3)"), "cfg/config.json", "n_kv_heads");
  EXPECT_ERROR(parse(llama + R"(, "rope_scaling": {"type": "yarn", "factor": 2.0})"),
               "cfg/config.json", "key 'rope_scaling.type' = \"yarn\" is not supported");
  EXPECT_ERROR(parse(llama + R"(, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0})"),
               "cfg/config.json", "key 'rope_parameters.rope_type'");
  EXPECT_ERROR(parse(llama + R"(, "rope_parameters": {"rope_type": "linear", "factor": 2.0,
    "attention_factor": 0.5})"), "cfg/config.json", "key 'rope_parameters.attention_factor'");
  EXPECT_ERROR(parse(llama + R"(, "rope_parameters": {"rope_type": "llama3", "factor": 8.0})"),
               "cfg/config.json", "key 'rope_parameters.low_freq_factor' is missing");
  EXPECT_ERROR(parse(llama + R"(, "rope_theta": 10000.0, "rope_parameters": {"rope_theta": 5e5})"),
               "cfg/config.json", "disagrees");
  EXPECT_ERROR(parse(llama + R"(, "rope_parameters": {"rope_type": "default"},
    "rope_scaling": {"rope_type": "linear", "factor": 2.0})"), "cfg/config.json",
               "describe different RoPE scalings");
  EXPECT_ERROR(parse(llama + R"(, "hidden_act": "gelu")"), "cfg/config.json", "key 'hidden_act'");
  EXPECT_ERROR(parse(llama + R"(, "attention_bias": true)"), "cfg/config.json",
               "key 'attention_bias'");
  EXPECT_ERROR(parse(llama + R"(, "rms_norm_eps": -1)"), "cfg/config.json", "key 'rms_norm_eps'");
  EXPECT_ERROR(parse(llama + R"(, "head_dim": 15)"), "cfg/config.json", "model.head_dim: 15");
  EXPECT_ERROR(parse(R"("model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4,
    "vocab_size": 97, "activation_function": "relu")"), "cfg/config.json", "'activation_function'");
  EXPECT_ERROR(read_hf_config(scratch_dir() + "/none/config.json"), "none/config.json",
               "cannot open");
}

// A Mixtral-shaped MoE (every layer routed, renormalised softmax top-2 of 4).
ModelConfig small_mixtral() {
  ModelConfig c = testing::small_llama(false);
  c.moe.experts = 4;
  c.moe.top_k = 2;
  c.moe.hidden_dim = 8;
  c.hidden_dim = 8;  // Mixtral's intermediate_size: the experts' width (no dense layer)
  c.moe.aux_loss = 0.02f;
  return c;
}

TEST(HfConfig, MixtralRoutingIsReadWrittenAndRefusedByKey) {
  const ModelConfig c = small_mixtral();
  const ModelConfig back = parse_hf_config(hf_config_json(c), "config.json");
  expect_same_config(back, c);
  EXPECT_EQ(back.moe, c.moe);
  const std::string mixtral = R"("model_type": "mixtral", "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 97, "num_local_experts": 8,
    "num_experts_per_tok": 2)";
  auto parse = [](const std::string& body) { return parse_hf_config("{" + body + "}", "cfg/config.json"); };
  const ModelConfig read = parse(mixtral);
  EXPECT_EQ(read.moe.experts, 8);
  EXPECT_EQ(read.moe.hidden_dim, 96);
  EXPECT_EQ(read.moe.aux_loss, 0.0f) << "no router logits output: no auxiliary loss";
  EXPECT_ERROR(parse(mixtral + R"(, "router_jitter_noise": 0.1)"), "cfg/config.json",
               "key 'router_jitter_noise' = 0.1 is not supported");
  EXPECT_EQ(parse(mixtral + R"(, "sliding_window": 4096)").sliding_window, 4096);
  EXPECT_ERROR(parse(mixtral + R"(, "num_experts_per_tok": 9)"), "cfg/config.json", "moe.top_k");
  ModelConfig shared = c;
  shared.moe.shared_hidden = 8;  // ungated: no architecture has it
  EXPECT_ERROR(hf_config_json(shared), "no Hugging Face architecture expresses this model",
               "mixtral: it has no shared experts (moe.shared_hidden, moe.shared_gate)");
  ModelConfig sigmoid = c;
  sigmoid.moe.score = ops::RouterScore::sigmoid;
  EXPECT_ERROR(hf_config_json(sigmoid), "no Hugging Face architecture", "moe.score = \"sigmoid\"");
}

// The Qwen and OLMoE architectures (ckpt/hf.cpp kHfArchs): each written and
// read back to the same model, picked by the model's options; their
// unimplemented keys refused by name.
TEST(HfConfig, QwenAndOlmoeArchitecturesRoundTripAndRefuseByKey) {
  ModelConfig qwen2 = testing::small_llama(false);
  qwen2.qkv_bias = true;
  ModelConfig qwen3 = testing::small_llama(false);
  qwen3.qk_norm = QkNorm::head;
  qwen3.head_width = 32;  // 4 heads of 32 over dim 64
  ModelConfig qwen2_moe = small_mixtral();
  qwen2_moe.qkv_bias = true;
  qwen2_moe.hidden_dim = 24;  // the dense layers'
  qwen2_moe.moe.renormalize = false;
  qwen2_moe.moe.shared_hidden = 16;
  qwen2_moe.moe.shared_gate = true;
  qwen2_moe.moe.first_dense = 1;
  ModelConfig qwen3_moe = small_mixtral();
  qwen3_moe.n_layers = 5;
  qwen3_moe.hidden_dim = 24;
  qwen3_moe.qk_norm = QkNorm::head;
  qwen3_moe.moe.first_dense = 1;
  qwen3_moe.moe.every = 2;  // layers 1 and 3
  ModelConfig olmoe = small_mixtral();
  olmoe.qk_norm = QkNorm::full;
  olmoe.moe.renormalize = false;
  ModelConfig mistral = testing::small_llama(false);
  mistral.sliding_window = 4;
  ModelConfig mixtral_window = small_mixtral();
  mixtral_window.sliding_window = 16;
  const std::pair<ModelConfig, const char*> cases[] = {
      {qwen2, "Qwen2ForCausalLM"},        {qwen3, "Qwen3ForCausalLM"},
      {qwen2_moe, "Qwen2MoeForCausalLM"}, {qwen3_moe, "Qwen3MoeForCausalLM"},
      {olmoe, "OlmoeForCausalLM"},        {mistral, "MistralForCausalLM"},
      {mixtral_window, "MixtralForCausalLM"}};
  for (const auto& [c, arch] : cases) {
    SCOPED_TRACE(arch);
    const std::string text = hf_config_json(c);
    EXPECT_NE(text.find(arch), std::string::npos) << text;
    const ModelConfig back = parse_hf_config(text, "config.json");
    expect_same_config(back, c);
    EXPECT_EQ(back.head_dim(), c.head_dim());
    EXPECT_EQ(back.qkv_bias, c.qkv_bias);
    EXPECT_EQ(back.qk_norm, c.qk_norm);
    EXPECT_EQ(back.sliding_window, c.sliding_window);
    if (c.moe.enabled()) {
      EXPECT_EQ(back.moe, c.moe);
    }
  }
  ModelConfig plain = small_mixtral();
  plain.moe.renormalize = false;  // Mixtral always renormalises; the others have QK-norm
  EXPECT_ERROR(hf_config_json(plain), "mixtral: it has no moe.renormalize = false",
               "qwen2_moe: it always has a gated shared expert");
  ModelConfig both = qwen2;
  both.qk_norm = QkNorm::head;
  EXPECT_ERROR(hf_config_json(both), "no Hugging Face architecture",
               "qwen3: it has no q/k/v biases");

  auto parse = [](const std::string& body) { return parse_hf_config("{" + body + "}", "c/config.json"); };
  const std::string shape = R"("hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
    "num_attention_heads": 4, "vocab_size": 97)";
  const std::string moe = shape + R"(, "num_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32)";
  // Each architecture's unimplemented keys, refused with the file and the key.
  const struct {
    const char *type, *extra, *message;
    bool moe;
  } refused[] = {
      {"olmoe", R"("clip_qkv": 8.0)", "key 'clip_qkv' = 8.0 is not supported", true},
      {"qwen3_moe", R"("attention_bias": true)", "key 'attention_bias' = true is not supported", true},
      {"qwen2", R"("use_sliding_window": true)", "key 'use_sliding_window' = true is not supported",
       false},
      {"qwen2_moe", R"("mlp_only_layers": [1])",
       "keys 'mlp_only_layers' = [1] and 'decoder_sparse_step' = 1", true},
      {"mistral", R"("sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"])",
       "per-layer attention kinds are not implemented", false},
      {"mistral", R"("sliding_window": -3)", "key 'sliding_window'", false},
      {"qwen3", R"("head_dim": 15)", "model.head_dim: 15 must be even", false},
      {"qwen2", R"("attention_dropout": 0.1)", "key 'attention_dropout' = 0.1 is not supported",
       false},
  };
  for (const auto& r : refused) {
    EXPECT_ERROR(parse(fmt::format(R"("model_type": "{}", {}, {})", r.type, r.moe ? moe : shape,
                                   r.extra)),
                 "c/config.json", r.message);
  }
  EXPECT_EQ(parse(R"("model_type": "qwen2", )" + shape + R"(, "attention_dropout": 0)").dim, 64);
  EXPECT_EQ(parse(R"("model_type": "mistral", "sliding_window": 4096, )" + shape).sliding_window, 4096);
  EXPECT_EQ(parse(R"("model_type": "mistral", "sliding_window": null, )" + shape).sliding_window, 0);
  ModelConfig windowed_qwen = qwen2;
  windowed_qwen.sliding_window = 8;  // Qwen2's window starts at max_window_layers: not expressed
  EXPECT_ERROR(hf_config_json(windowed_qwen), "no Hugging Face architecture",
               "qwen2: it has no sliding window");
  EXPECT_ERROR(parse(R"("model_type": "deepseek_v3", )" + shape), "c/config.json",
               "model_type 'deepseek_v3' is not supported");
  const ModelConfig qwen3_read = parse(R"("model_type": "qwen3_moe", )" + moe +
                                       R"(, "head_dim": 128, "norm_topk_prob": true,
                                            "decoder_sparse_step": 2)");
  EXPECT_EQ(qwen3_read.head_dim(), 128);
  EXPECT_EQ(qwen3_read.qk_norm, QkNorm::head);
  EXPECT_TRUE(qwen3_read.moe.renormalize);
  EXPECT_EQ(qwen3_read.moe.first_dense, 1);
  EXPECT_EQ(qwen3_read.moe.every, 2);
  EXPECT_EQ(qwen3_read.moe.hidden_dim, 32);
  EXPECT_EQ(qwen3_read.hidden_dim, 96);
}

TEST(HfRope, PermutationMatchesConvertLlamaWeightsToHf) {
  // One head of dim 4, one column: meshtrain rows (x0, x1, x2, x3) pair (0,1), (2,3);
  // HF pairs (0,2), (1,3), so HF rows are (x0, x2, x1, x3).
  const float mesh[4] = {10, 11, 12, 13};
  float hf[4], back[4];
  rope_rows_to_hf(mesh, hf, 1, 4, 1);
  EXPECT_EQ(std::vector<float>(hf, hf + 4), (std::vector<float>{10, 12, 11, 13}));
  rope_rows_from_hf(hf, back, 1, 4, 1);
  EXPECT_EQ(std::vector<float>(back, back + 4), (std::vector<float>{10, 11, 12, 13}));

  // Two heads of dim 8, three columns: round trip is the identity, heads stay in place.
  std::vector<float> x(48), y(48), z(48);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i);
  rope_rows_to_hf(x.data(), y.data(), 2, 8, 3);
  rope_rows_from_hf(y.data(), z.data(), 2, 8, 3);
  EXPECT_EQ(z, x);
  EXPECT_EQ(y[(8 + 4) * 3], x[(8 + 1) * 3]);  // head 1, HF row 4 = c 1, i 0 = meshtrain row 1
}

class HfImport : public ckpt_test::CkptTest {};

TEST_F(HfImport, ExportLayoutAndBenignExtras) {
  Model model(testing::small_llama(true), Precision::fp32, ctx);
  model.init_weights(9);
  export_hf(model, dir, DType::f16);
  SafetensorsReader file(dir + "/model.safetensors");
  EXPECT_FALSE(file.contains("lm_head.weight"));  // tied: HF does not store it
  EXPECT_EQ(file.info("model.layers.0.self_attn.q_proj.weight").dtype, StDType::F16);
  EXPECT_EQ(file.metadata("format"), "pt");
  const auto config = nlohmann::json::parse(testing::read_file(dir + "/config.json"));
  EXPECT_EQ(config["torch_dtype"], "float16");

  // A stored tied lm_head and rotary buffers are ignored on import.
  SafetensorsWriter writer;
  for (const Parameter& p : model.params()) writer.add(p.spec.name, p.master);
  writer.add("lm_head.weight", model.param("model.embed_tokens.weight").master);
  float inv_freq[2] = {1, 0.1f};
  writer.add("model.layers.0.self_attn.rotary_emb.inv_freq", StDType::F32, {2}, inv_freq);
  writer.write(dir + "/model.safetensors");
  EXPECT_NO_THROW(import_hf(dir, Precision::fp32, ctx));
}

TEST_F(HfImport, Gpt2NamesWithoutTransformerPrefixAreFound) {
  Model model(testing::small_gpt2(), Precision::fp32, ctx);
  model.init_weights(4);
  SafetensorsWriter writer;  // as GPT2Model (e.g. the openai-community/gpt2 file) names them
  for (const Parameter& p : model.params()) writer.add(p.spec.name.substr(12), p.master);
  std::vector<float> mask(64, 1.0f);
  writer.add("h.0.attn.bias", StDType::F32, {1, 1, 8, 8}, mask.data());
  writer.write(dir + "/model.safetensors");
  write_file_atomic(dir + "/config.json", hf_config_json(model.config()));
  auto back = import_hf(dir, Precision::fp32, ctx);
  for (size_t i = 0; i < model.params().size(); ++i) {
    EXPECT_EQ(std::memcmp(model.params()[i].master.raw(), back->params()[i].master.raw(),
                          model.params()[i].master.bytes()), 0);
  }
}

TEST_F(HfImport, MissingAndWrongTensorsAreErrors) {
  Model model(testing::small_llama(false), Precision::fp32, ctx);
  export_hf(model, dir);
  SafetensorsWriter writer;
  for (const Parameter& p : model.params()) {
    if (p.spec.name != "lm_head.weight") writer.add(p.spec.name, p.master);
  }
  writer.write(dir + "/model.safetensors");
  EXPECT_ERROR(import_hf(dir, Precision::fp32, ctx), "model.safetensors",
               "tensor 'lm_head.weight' is missing");

  // A config that disagrees with the weights: shape mismatch, named.
  ModelConfig wider = model.config();
  wider.hidden_dim = 32;
  write_file_atomic(dir + "/config.json", hf_config_json(wider));
  EXPECT_ERROR(import_hf(dir, Precision::fp32, ctx), "model.safetensors",
               "tensor 'model.layers.0.mlp.gate_proj.weight' has shape [24, 16], expected [32, 16]");
}

TEST_F(HfImport, AnHfSourcesTokenizerAndSpecialIdsTravelWithTheExport) {
  Model model(testing::small_llama(false), Precision::fp32, ctx);
  const std::string src = dir + "/src", dst = dir + "/dst";
  export_hf(model, src);
  nlohmann::json config = nlohmann::json::parse(hf_config_json(model.config()));
  config["bos_token_id"] = 7;
  config["eos_token_id"] = 9;
  write_file_atomic(src + "/config.json", config.dump());
  write_file_atomic(src + "/tokenizer.json", "{\"model\": {}}");
  export_hf(model, dst);
  EXPECT_EQ(copy_hf_tokenizer(src, dst), std::vector<std::string>{"tokenizer.json"});
  EXPECT_TRUE(std::filesystem::exists(dst + "/tokenizer.json"));
  const ModelConfig back = read_hf_config(dst + "/config.json");
  EXPECT_EQ(back.dim, model.config().dim);
  std::ifstream in(dst + "/config.json");
  const auto written = nlohmann::json::parse(in);
  EXPECT_EQ(written["bos_token_id"], 7);
  EXPECT_EQ(written["eos_token_id"], 9);
}

TEST_F(HfImport, ShardedCheckpointsLoadThroughTheirIndex) {
  Model model(testing::small_llama(false), Precision::fp32, ctx);
  export_hf(model, dir);
  // Split the export over two files, as save_pretrained does past max_shard_size.
  SafetensorsReader whole(dir + "/model.safetensors");
  SafetensorsWriter first, second;
  nlohmann::json index = {{"metadata", {{"total_size", 0}}}, {"weight_map", nlohmann::json::object()}};
  std::vector<Tensor> copies;
  copies.reserve(whole.tensors().size());
  for (size_t i = 0; i < whole.tensors().size(); ++i) {
    const StTensorInfo& t = whole.tensors()[i];
    Tensor& copy = copies.emplace_back(t.shape, DType::f32, MemCategory::workspace, tracker);
    whole.read(t.name, copy);
    const bool in_first = i % 2 == 0;
    (in_first ? first : second).add(t.name, copy);
    index["weight_map"][t.name] = in_first ? "model-00001-of-00002.safetensors"
                                           : "model-00002-of-00002.safetensors";
  }
  first.write(dir + "/model-00001-of-00002.safetensors");
  second.write(dir + "/model-00002-of-00002.safetensors");
  std::filesystem::remove(dir + "/model.safetensors");
  write_file_atomic(dir + "/model.safetensors.index.json", index.dump());
  auto back = import_hf(dir, Precision::fp32, ctx);
  for (size_t i = 0; i < model.params().size(); ++i) {
    EXPECT_EQ(std::memcmp(model.params()[i].master.raw(), back->params()[i].master.raw(),
                          model.params()[i].master.bytes()), 0);
  }
  // An index that omits a tensor a file holds; one without a weight_map.
  nlohmann::json missing = index;
  missing["weight_map"].erase("model.embed_tokens.weight");
  write_file_atomic(dir + "/model.safetensors.index.json", missing.dump());
  EXPECT_ERROR(import_hf(dir, Precision::fp32, ctx), "model.safetensors.index.json",
               "tensor 'model.embed_tokens.weight' of");
  write_file_atomic(dir + "/model.safetensors.index.json", "{}");
  EXPECT_ERROR(import_hf(dir, Precision::fp32, ctx), "model.safetensors.index.json",
               "key 'weight_map'");
}

// A MoE model exports as save_pretrained writes Mixtral (per-expert w1 / w3 /
// w2 and block_sparse_moe.gate) and imports back bit for bit; the fused
// [E, ...] layout of transformers 5 imports too.
TEST_F(HfImport, MixtralExpertsRoundTripInBothLayouts) {
  Model model(small_mixtral(), Precision::fp32, ctx);
  model.init_weights(5);
  export_hf(model, dir);
  {
    SafetensorsReader file(dir + "/model.safetensors");
    EXPECT_EQ(file.info("model.layers.1.block_sparse_moe.experts.3.w1.weight").shape, (Shape{8, 16}));
    EXPECT_EQ(file.info("model.layers.1.block_sparse_moe.experts.3.w2.weight").shape, (Shape{16, 8}));
    EXPECT_TRUE(file.contains("model.layers.0.block_sparse_moe.gate.weight"));
    EXPECT_FALSE(file.contains("model.layers.0.mlp.experts.gate_up_proj"));
  }
  auto expect_equal = [&](const Model& back) {
    for (size_t i = 0; i < model.params().size(); ++i) {
      EXPECT_EQ(std::memcmp(model.params()[i].master.raw(), back.params()[i].master.raw(),
                            model.params()[i].master.bytes()), 0)
          << model.params()[i].spec.name;
    }
  };
  expect_equal(*import_hf(dir, Precision::fp32, ctx));
  // Expert 1's up rows are w3 of expert 1: rows [I, 2I) of gate_up_proj[1].
  SafetensorsReader file(dir + "/model.safetensors");
  Tensor w3 = file.read_tensor("model.layers.0.block_sparse_moe.experts.1.w3.weight", DType::f32,
                               MemCategory::workspace, tracker);
  const float* fused = model.param("model.layers.0.mlp.experts.gate_up_proj").master.data<float>();
  EXPECT_EQ(std::memcmp(w3.data<float>(), fused + (2 * 8 + 8) * 16, 8 * 16 * 4), 0);

  // transformers 5's in-memory names and layout for the MoE tensors, the rest as exported.
  SafetensorsWriter fused_writer;
  std::vector<Tensor> kept;
  for (const StTensorInfo& t : file.tensors()) {
    if (t.name.find("block_sparse_moe") != std::string::npos) continue;
    kept.push_back(file.read_tensor(t.name, DType::f32, MemCategory::workspace, tracker));
    fused_writer.add(t.name, kept.back());
  }
  for (const Parameter& p : model.params()) {
    if (p.spec.name.find(".mlp.") != std::string::npos) fused_writer.add(p.spec.name, p.master);
  }
  fused_writer.write(dir + "/model.safetensors");
  expect_equal(*import_hf(dir, Precision::fp32, ctx));
}

}  // namespace
}  // namespace meshtrain
