#include "meshtrain/ckpt/llmc.h"

#include <array>
#include <filesystem>
#include <fstream>
#include <map>
#include <vector>

#include "meshtrain/ckpt/atomic_file.h"
#include "meshtrain/ckpt/tokenizer_files.h"
#include "meshtrain/util/error.h"

namespace meshtrain {

namespace {

constexpr int64_t kHeaderWords = 256;
constexpr int64_t kHeaderBytes = kHeaderWords * 4;
constexpr float kNormEps = 1e-5f;

// One llm.c tensor: the registry parameter it holds and whether it is stored
// as the transpose ([out, in]) of the registry's Conv1D [in, out] layout.
struct FileTensor {
  std::string name;
  bool transposed = false;
};

// Every tensor in file order (wte first, padded to Vp rows in the file).
std::vector<FileTensor> file_order(const ModelConfig& c) {
  constexpr std::array<std::pair<const char*, bool>, 12> kLayer = {{
      {"ln_1.weight", false},      {"ln_1.bias", false},
      {"attn.c_attn.weight", true}, {"attn.c_attn.bias", false},
      {"attn.c_proj.weight", true}, {"attn.c_proj.bias", false},
      {"ln_2.weight", false},      {"ln_2.bias", false},
      {"mlp.c_fc.weight", true},   {"mlp.c_fc.bias", false},
      {"mlp.c_proj.weight", true}, {"mlp.c_proj.bias", false},
  }};
  std::vector<FileTensor> order = {{"transformer.wte.weight"}, {"transformer.wpe.weight"}};
  for (const auto& [suffix, transposed] : kLayer) {
    for (int64_t l = 0; l < c.n_layers; ++l) {
      order.push_back({fmt::format("transformer.h.{}.{}", l, suffix), transposed});
    }
  }
  order.push_back({"transformer.ln_f.weight"});
  order.push_back({"transformer.ln_f.bias"});
  return order;
}

// dst [cols, rows] = transpose of src [rows, cols].
void transpose(const float* src, float* dst, int64_t rows, int64_t cols) {
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) dst[j * rows + i] = src[i * cols + j];
  }
}

DType file_dtype(int32_t version) {
  return version == kLlmcVersionBf16 ? DType::bf16 : DType::f32;
}

}  // namespace

int64_t llmc_padded_vocab(int64_t vocab) { return (vocab + 127) / 128 * 128; }

LlmcHeader read_llmc_header(const std::string& path) {
  std::error_code ec;
  const auto file_size = static_cast<int64_t>(std::filesystem::file_size(path, ec));
  MESHTRAIN_CHECK_AS(ErrorKind::io, !ec, "{}: cannot open: {}", path, ec.message());
  MESHTRAIN_CHECK(file_size >= kHeaderBytes,
                  "{}: file is {} bytes, too short for llm.c's 1024-byte header", path, file_size);
  std::ifstream in(path, std::ios::binary);
  MESHTRAIN_CHECK_AS(ErrorKind::io, in.good(), "{}: cannot open", path);
  std::array<int32_t, kHeaderWords> h{};
  in.read(reinterpret_cast<char*>(h.data()), kHeaderBytes);
  MESHTRAIN_CHECK(in.good(), "{}: cannot read the header", path);
  MESHTRAIN_CHECK(h[0] == kLlmcMagic, "{}: bad magic {} (an llm.c GPT-2 checkpoint has {})", path,
                  h[0], kLlmcMagic);
  MESHTRAIN_CHECK(h[1] == kLlmcVersionF32 || h[1] == kLlmcVersionBf16,
                  "{}: version {} is not supported (3: fp32, 5: bf16)", path, h[1]);
  const char* names[] = {"max_seq_len", "vocab_size", "num_layers", "num_heads", "channels",
                         "padded_vocab_size"};
  for (int i = 0; i < 6; ++i) {
    MESHTRAIN_CHECK(h[2 + i] > 0 && h[2 + i] <= (1 << 24), "{}: header {} = {} is out of range",
                    path, names[i], h[2 + i]);
  }
  MESHTRAIN_CHECK(h[7] >= h[3], "{}: header padded_vocab_size {} is below vocab_size {}", path,
                  h[7], h[3]);
  // The matrices alone (12 C^2 per layer, the embeddings) must fit in the file:
  // checked in double before num_params() builds a registry of every layer and
  // sums it in int64 (2^24 layers of 2^24 channels took seconds and overflowed).
  const double matrix_bytes =
      4.0 * (12.0 * h[4] * h[6] * h[6] + (static_cast<double>(h[7]) + h[2]) * h[6]);
  MESHTRAIN_CHECK_AS(ErrorKind::corrupt, matrix_bytes / (h[1] == kLlmcVersionBf16 ? 2 : 1) <=
                                             static_cast<double>(file_size - kHeaderBytes),
                     "{}: file is {} bytes, too short for its header's {} layers of {} channels "
                     "(vocab {}): truncated or not an llm.c GPT-2 checkpoint",
                     path, file_size, h[4], h[6], h[7]);
  LlmcHeader header;
  header.version = h[1];
  header.padded_vocab = h[7];
  header.config = gpt2_shape(h[6], h[4], h[5], h[3], h[2]);
  header.config.norm_eps = kNormEps;
  try {
    header.config.validate();
  } catch (const Error& e) {
    fail("{}: header describes an invalid model: {}", path, e.what());
  }
  const ModelConfig& c = header.config;
  const int64_t elements = c.num_params() + (header.padded_vocab - c.vocab_size) * c.dim;
  const int64_t expected =
      kHeaderBytes + elements * static_cast<int64_t>(dtype_size(file_dtype(header.version)));
  MESHTRAIN_CHECK_AS(ErrorKind::corrupt, file_size == expected,
                     "{}: file is {} bytes but its header (version {}, seq {}, vocab {} padded to "
                     "{}, layers {}, heads {}, channels {}) implies {} bytes: truncated or not an "
                     "llm.c GPT-2 checkpoint",
                     path, file_size, header.version, c.max_seq_len, c.vocab_size,
                     header.padded_vocab, c.n_layers, c.n_heads, c.dim, expected);
  return header;
}

std::unique_ptr<Model> import_llmc(const std::string& path, Precision precision, Backend& backend) {
  const LlmcHeader header = read_llmc_header(path);
  const ModelConfig& c = header.config;
  auto model = std::make_unique<Model>(c, precision, backend);
  const DType dtype = file_dtype(header.version);
  std::ifstream in(path, std::ios::binary);
  MESHTRAIN_CHECK_AS(ErrorKind::io, in.good(), "{}: cannot open", path);
  in.seekg(kHeaderBytes);
  std::vector<char> raw;
  std::vector<float> values, host;
  for (const FileTensor& t : file_order(c)) {
    Parameter& p = model->param(t.name);
    const auto n = static_cast<size_t>(p.master.numel());
    raw.resize(n * dtype_size(dtype));
    in.read(raw.data(), static_cast<std::streamsize>(raw.size()));
    MESHTRAIN_CHECK(in.good(), "{}: unexpected end of file in tensor '{}'", path, t.name);
    host.resize(n);
    float* dst = host.data();
    if (!t.transposed) {
      convert(dtype, raw.data(), DType::f32, dst, n);
    } else {
      values.resize(n);
      convert(dtype, raw.data(), DType::f32, values.data(), n);
      transpose(values.data(), dst, p.spec.shape[1], p.spec.shape[0]);  // [out, in] -> [in, out]
    }
    model->copy_master_from_host(p, dst);
    if (t.name == "transformer.wte.weight") {  // skip the padding rows
      in.seekg((header.padded_vocab - c.vocab_size) * c.dim *
                   static_cast<int64_t>(dtype_size(dtype)),
               std::ios::cur);
    }
  }
  model->sync_compute_weights();
  return model;
}

std::string llmc_tokenizer_path(const std::string& model_path) {
  return (std::filesystem::path(model_path).parent_path() / "gpt2_tokenizer.bin").string();
}

void export_llmc(const Model& model, const std::string& path, DType dtype,
                 const Tokenizer* tokenizer) {
  export_llmc(model.config(), model_tensors(model), path, dtype, tokenizer);
}

void export_llmc(const ModelConfig& c, const TensorSource& source, const std::string& path,
                 DType dtype, const Tokenizer* tokenizer) {
  MESHTRAIN_CHECK(tokenizer == nullptr || std::filesystem::path(path).filename() !=
                                              "gpt2_tokenizer.bin",
                  "{}: the tokenizer is written as gpt2_tokenizer.bin beside the model; name the "
                  "model file otherwise", path);
  MESHTRAIN_CHECK(tokenizer == nullptr || tokenizer->vocab_size() <= c.vocab_size,
                  "{}: tokenizer '{}' has {} ids, the model only {}", path, tokenizer->name(),
                  tokenizer->vocab_size(), c.vocab_size);
  MESHTRAIN_CHECK(c.family == Family::gpt2, "{}: llm.c export needs a gpt2 model, not {}", path,
                  family_name(c.family));
  MESHTRAIN_CHECK(c.hidden_dim == 4 * c.dim && c.norm_eps == kNormEps,
                  "{}: the llm.c format fixes the MLP width 4 * dim and LayerNorm eps 1e-5; this "
                  "model has {} and {}", path, c.hidden_dim, c.norm_eps);
  MESHTRAIN_CHECK(dtype == DType::f32 || dtype == DType::bf16,
                  "{}: llm.c checkpoints hold f32 or bf16 weights, not {}", path, dtype_name(dtype));
  const int64_t padded = llmc_padded_vocab(c.vocab_size);
  MESHTRAIN_CHECK(padded <= INT32_MAX && c.max_seq_len <= INT32_MAX && c.dim <= INT32_MAX,
                  "{}: model too large for llm.c's int32 header", path);
  std::array<int32_t, kHeaderWords> header{};
  header[0] = kLlmcMagic;
  header[1] = dtype == DType::bf16 ? kLlmcVersionBf16 : kLlmcVersionF32;
  header[2] = static_cast<int32_t>(c.max_seq_len);
  header[3] = static_cast<int32_t>(c.vocab_size);
  header[4] = static_cast<int32_t>(c.n_layers);
  header[5] = static_cast<int32_t>(c.n_heads);
  header[6] = static_cast<int32_t>(c.dim);
  header[7] = static_cast<int32_t>(padded);
  AtomicFile file(path);
  file.write(header.data(), kHeaderBytes);
  std::map<std::string, ParamSpec> specs;
  for (ParamSpec& spec : build_param_specs(c)) specs.emplace(spec.name, std::move(spec));
  std::vector<float> values, transposed;
  std::vector<char> raw;
  const auto write = [&](const float* data, size_t n) {
    raw.resize(n * dtype_size(dtype));
    convert(DType::f32, data, dtype, raw.data(), n);
    file.write(raw.data(), raw.size());
  };
  for (const FileTensor& t : file_order(c)) {
    const ParamSpec& spec = specs.at(t.name);
    const auto n = static_cast<size_t>(spec.numel());
    values.resize(n);
    source(spec, values.data());
    const float* src = values.data();
    if (t.transposed) {
      transposed.resize(n);
      transpose(values.data(), transposed.data(), spec.shape[0], spec.shape[1]);
      src = transposed.data();
    }
    write(src, n);
    if (t.name == "transformer.wte.weight") {
      const std::vector<float> zeros(static_cast<size_t>((padded - c.vocab_size) * c.dim), 0.0f);
      write(zeros.data(), zeros.size());
    }
  }
  file.commit();
  if (tokenizer != nullptr) write_llmc_tokenizer(*tokenizer, llmc_tokenizer_path(path));
}

}  // namespace meshtrain
