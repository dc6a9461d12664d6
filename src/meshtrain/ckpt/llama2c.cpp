#include "meshtrain/ckpt/llama2c.h"

#include <array>
#include <map>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <vector>

#include "meshtrain/ckpt/atomic_file.h"
#include "meshtrain/ckpt/tokenizer_files.h"
#include "meshtrain/util/error.h"

namespace meshtrain {

namespace {

constexpr int64_t kHeaderBytes = 7 * 4;
constexpr int32_t kVersionedMagic = 0x616b3432;  // "ak42": llama2.c's version 1+ files
constexpr float kNormEps = 1e-5f, kRopeTheta = 10000.0f;

// The order in which the per-layer tensors appear, as registry name suffixes.
constexpr std::array<const char*, 9> kLayerTensors = {
    "input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
    "self_attn.v_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight",
    "mlp.gate_proj.weight", "mlp.down_proj.weight", "mlp.up_proj.weight"};

std::string layer_name(int64_t layer, const char* suffix) {
  return fmt::format("model.layers.{}.{}", layer, suffix);
}

int64_t rope_table_floats(const ModelConfig& c) { return c.max_seq_len * c.head_dim(); }

// Every tensor in file order, with the RoPE tables as an unnamed gap.
template <typename OnParam, typename OnRopeTables>
void for_each_in_file_order(const ModelConfig& c, OnParam on_param, OnRopeTables on_rope_tables) {
  on_param(std::string("model.embed_tokens.weight"));
  for (const char* suffix : kLayerTensors) {
    for (int64_t l = 0; l < c.n_layers; ++l) on_param(layer_name(l, suffix));
  }
  on_param(std::string("model.norm.weight"));
  on_rope_tables();
  if (!c.tie_embeddings) on_param(std::string("lm_head.weight"));
}

}  // namespace

ModelConfig read_llama2c_config(const std::string& path) {
  std::error_code ec;
  const auto file_size = static_cast<int64_t>(std::filesystem::file_size(path, ec));
  MESHTRAIN_CHECK_AS(ErrorKind::io, !ec, "{}: cannot open: {}", path, ec.message());
  MESHTRAIN_CHECK(file_size >= kHeaderBytes,
                  "{}: file is {} bytes, too short for the 28-byte llama2.c header", path,
                  file_size);
  std::ifstream in(path, std::ios::binary);
  MESHTRAIN_CHECK_AS(ErrorKind::io, in.good(), "{}: cannot open", path);
  std::array<int32_t, 7> h{};
  in.read(reinterpret_cast<char*>(h.data()), kHeaderBytes);
  MESHTRAIN_CHECK(in.good(), "{}: cannot read the header", path);
  MESHTRAIN_CHECK(h[0] != kVersionedMagic,
                  "{}: a llama2.c version 1+ file (magic 'ak42'); only the legacy version 0 "
                  "format is supported (export.py --version 0)", path);
  const char* names[] = {"dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads"};
  for (int i = 0; i < 5; ++i) {
    MESHTRAIN_CHECK(h[i] > 0 && h[i] <= (1 << 20), "{}: header {} = {} is out of range", path,
                    names[i], h[i]);
  }
  MESHTRAIN_CHECK(h[5] != 0 && std::abs(static_cast<int64_t>(h[5])) <= (1 << 24),
                  "{}: header vocab_size = {} is out of range", path, h[5]);
  MESHTRAIN_CHECK(h[6] > 0 && h[6] <= (1 << 24), "{}: header max_seq_len = {} is out of range",
                  path, h[6]);

  // The layers' matrices alone (q and o at least, and the FFN's three) must fit
  // in the file: checked in double before validate() and num_params() build a
  // registry of every layer (2^20 layers in a tiny file took seconds).
  const double matrix_bytes = 4.0 * h[2] * (2.0 * h[0] * h[0] + 3.0 * h[0] * h[1]);
  MESHTRAIN_CHECK_AS(ErrorKind::corrupt,
                     matrix_bytes <= static_cast<double>(file_size - kHeaderBytes),
                     "{}: file is {} bytes, too short for its header's {} layers of dim {} "
                     "(hidden {}): truncated or not a llama2.c v0 checkpoint",
                     path, file_size, h[2], h[0], h[1]);
  ModelConfig c;
  c.family = Family::llama;
  c.dim = h[0];
  c.hidden_dim = h[1];
  c.n_layers = h[2];
  c.n_heads = h[3];
  c.n_kv_heads = h[4];
  c.vocab_size = std::abs(static_cast<int64_t>(h[5]));
  c.tie_embeddings = h[5] > 0;
  c.max_seq_len = h[6];
  c.norm_eps = kNormEps;
  c.rope_theta = kRopeTheta;
  try {
    c.validate();
  } catch (const Error& e) {
    fail("{}: header describes an invalid model: {}", path, e.what());
  }
  MESHTRAIN_CHECK(c.dim % c.n_heads == 0 && c.head_dim() % 2 == 0,
                  "{}: header dim {} / n_heads {} is not an even head size", path, c.dim,
                  c.n_heads);

  const int64_t expected =
      kHeaderBytes + 4 * (c.num_params() + rope_table_floats(c));
  MESHTRAIN_CHECK_AS(ErrorKind::corrupt, file_size == expected,
                     "{}: file is {} bytes but its header (dim {}, hidden {}, layers {}, heads {}, "
                     "kv_heads {}, vocab {}, seq {}, {}) implies {} bytes: truncated or not a "
                     "llama2.c v0 checkpoint",
                     path, file_size, c.dim, c.hidden_dim, c.n_layers, c.n_heads, c.n_kv_heads,
                     c.vocab_size, c.max_seq_len, c.tie_embeddings ? "tied" : "untied", expected);
  return c;
}

void load_llama2c_weights(Model& model, const std::string& path) {
  const ModelConfig file_config = read_llama2c_config(path);
  const ModelConfig& c = model.config();
  MESHTRAIN_CHECK(c.family == Family::llama && c.dim == file_config.dim &&
                      c.hidden_dim == file_config.hidden_dim && c.n_layers == file_config.n_layers &&
                      c.n_heads == file_config.n_heads && c.n_kv_heads == file_config.n_kv_heads &&
                      c.vocab_size == file_config.vocab_size &&
                      c.tie_embeddings == file_config.tie_embeddings,
                  "{}: checkpoint shape does not match the model", path);
  std::ifstream in(path, std::ios::binary);
  MESHTRAIN_CHECK_AS(ErrorKind::io, in.good(), "{}: cannot open", path);
  in.seekg(kHeaderBytes);
  std::vector<float> host;
  for_each_in_file_order(
      file_config,
      [&](const std::string& name) {
        Parameter& p = model.param(name);
        host.resize(static_cast<size_t>(p.master.numel()));
        in.read(reinterpret_cast<char*>(host.data()),
                static_cast<std::streamsize>(p.master.bytes()));
        MESHTRAIN_CHECK(in.good(), "{}: unexpected end of file in tensor '{}'", path, name);
        model.copy_master_from_host(p, host.data());
      },
      [&] { in.seekg(4 * rope_table_floats(file_config), std::ios::cur); });
  model.sync_compute_weights();
}

std::unique_ptr<Model> import_llama2c(const std::string& path, Precision precision,
                                      Backend& backend) {
  auto model = std::make_unique<Model>(read_llama2c_config(path), precision, backend);
  load_llama2c_weights(*model, path);
  return model;
}

std::string llama2c_tokenizer_path(const std::string& model_path) {
  return (std::filesystem::path(model_path).parent_path() / "tokenizer.bin").string();
}

void export_llama2c(const Model& model, const std::string& path, const Tokenizer* tokenizer) {
  export_llama2c(model.config(), model_tensors(model), path, tokenizer);
}

void export_llama2c(const ModelConfig& c, const TensorSource& source, const std::string& path,
                    const Tokenizer* tokenizer) {
  MESHTRAIN_CHECK(tokenizer == nullptr || std::filesystem::path(path).filename() != "tokenizer.bin",
                  "{}: the tokenizer is written as tokenizer.bin beside the model; name the model "
                  "file otherwise", path);
  MESHTRAIN_CHECK(c.family == Family::llama, "{}: llama2.c export needs a llama model, not {}",
                  path, family_name(c.family));
  MESHTRAIN_CHECK(c.norm_eps == kNormEps && c.rope_theta == kRopeTheta,
                  "{}: the llama2.c format fixes norm_eps 1e-5 and rope_theta 10000; this model "
                  "has {} and {}", path, c.norm_eps, c.rope_theta);
  MESHTRAIN_CHECK(c.rope_scaling.type == RopeType::none,
                  "{}: the llama2.c format has no RoPE scaling; this model has rope_type {}", path,
                  rope_type_name(c.rope_scaling.type));
  MESHTRAIN_CHECK(!c.qkv_bias && c.qk_norm == QkNorm::none && c.head_dim() * c.n_heads == c.dim &&
                      !c.moe.enabled(),
                  "{}: the llama2.c format has no q/k/v biases, QK-norm, head_dim of its own or "
                  "experts (model.qkv_bias, model.qk_norm, model.head_dim, moe.experts)", path);
  MESHTRAIN_CHECK(c.max_seq_len <= INT32_MAX && c.vocab_size <= INT32_MAX && c.dim <= INT32_MAX &&
                      c.hidden_dim <= INT32_MAX,
                  "{}: model too large for llama2.c's int32 header", path);
  const int32_t vocab = static_cast<int32_t>(c.tie_embeddings ? c.vocab_size : -c.vocab_size);
  const std::array<int32_t, 7> header = {
      static_cast<int32_t>(c.dim),        static_cast<int32_t>(c.hidden_dim),
      static_cast<int32_t>(c.n_layers),   static_cast<int32_t>(c.n_heads),
      static_cast<int32_t>(c.n_kv_heads), vocab,
      static_cast<int32_t>(c.max_seq_len)};
  std::map<std::string, ParamSpec> specs;
  for (ParamSpec& spec : build_param_specs(c)) specs.emplace(spec.name, std::move(spec));
  std::vector<float> values;
  AtomicFile file(path);
  file.write(header.data(), kHeaderBytes);
  for_each_in_file_order(
      c,
      [&](const std::string& name) {
        const ParamSpec& spec = specs.at(name);
        values.resize(static_cast<size_t>(spec.numel()));
        source(spec, values.data());
        file.write(values.data(), values.size() * sizeof(float));
      },
      [&] {
        // llama2.c's precompute_freqs_cis: cos, then sin, of pos * theta^(-2i/hd).
        const int64_t hd = c.head_dim(), half = hd / 2;
        std::vector<float> row(static_cast<size_t>(half));
        for (int table = 0; table < 2; ++table) {
          for (int64_t pos = 0; pos < c.max_seq_len; ++pos) {
            for (int64_t i = 0; i < half; ++i) {
              const float freq = 1.0f / std::pow(kRopeTheta, static_cast<float>(2 * i) /
                                                                 static_cast<float>(hd));
              const float angle = static_cast<float>(pos) * freq;
              row[static_cast<size_t>(i)] = table == 0 ? std::cos(angle) : std::sin(angle);
            }
            file.write(row.data(), row.size() * sizeof(float));
          }
        }
      });
  file.commit();
  if (tokenizer != nullptr) write_llama2c_tokenizer(*tokenizer, c.vocab_size, llama2c_tokenizer_path(path));
}

}  // namespace meshtrain
