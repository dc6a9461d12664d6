// The safetensors reader and writer: round trips, dtype conversion, and one
// clear Error (naming file and tensor) for every kind of malformed file.
#include <gtest/gtest.h>

#include <cstring>

#include "meshtrain/ckpt/safetensors.h"
#include "meshtrain/ckpt/weights.h"
#include "util.h"

namespace meshtrain {
namespace {

using testing::read_file;
using testing::scratch_dir;
using testing::write_file;

// A file from a header text and a data section, length prefix included.
std::string st_file(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<char>(n >> (8 * i));
  return out + header + data;
}

TEST(Safetensors, RoundTripWithConversionAndMetadata) {
  MemoryTracker tracker;
  Tensor a({2, 3}, DType::f32, MemCategory::workspace, tracker);
  for (int i = 0; i < 6; ++i) a.data<float>()[i] = 0.1f * static_cast<float>(i) - 0.2f;
  const std::vector<int64_t> counters = {7, -3, int64_t{1} << 40};
  const std::vector<int32_t> ids = {1, 2, 3};
  SafetensorsWriter writer;
  writer.add("a", a);
  writer.add("a_bf16", a, DType::bf16);
  writer.add("a_f16", a, DType::f16);
  writer.add("empty", StDType::F32, {0, 4}, nullptr);
  writer.add("counters", StDType::I64, {3}, counters.data());
  writer.add("ids", StDType::I32, {3}, ids.data());
  writer.set_metadata("step", "12");
  const std::string path = scratch_dir() + "/t.safetensors";
  writer.write(path);
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp." + std::to_string(::getpid())));

  // Data section 8-byte aligned, as the reference writer does.
  const std::string bytes = read_file(path);
  uint64_t header_len = 0;
  std::memcpy(&header_len, bytes.data(), 8);
  EXPECT_EQ(header_len % 8, 0u);

  SafetensorsReader reader(path);
  EXPECT_EQ(reader.metadata("step"), "12");
  EXPECT_EQ(reader.tensors().size(), 6u);
  EXPECT_EQ(reader.info("a_bf16").dtype, StDType::BF16);
  EXPECT_EQ(reader.info("a_bf16").shape, (Shape{2, 3}));
  Tensor back = reader.read_tensor("a", DType::f32, MemCategory::workspace, tracker);
  EXPECT_EQ(std::memcmp(back.raw(), a.raw(), a.bytes()), 0);
  Tensor from_bf16 = reader.read_tensor("a_bf16", DType::f32, MemCategory::workspace, tracker);
  Tensor from_f16 = reader.read_tensor("a_f16", DType::f32, MemCategory::workspace, tracker);
  for (int i = 0; i < 6; ++i) {
    const float x = a.data<float>()[i];
    EXPECT_EQ(from_bf16.data<float>()[i], bf16_to_float(float_to_bf16(x)));
    EXPECT_EQ(from_f16.data<float>()[i], f16_to_float(float_to_f16(x)));
  }
  Tensor as_bf16 = reader.read_tensor("a", DType::bf16, MemCategory::workspace, tracker);
  EXPECT_EQ(as_bf16.data<bf16>()[5].bits, float_to_bf16(a.data<float>()[5]).bits);
  EXPECT_EQ(reader.read_ints("counters"), counters);
  EXPECT_EQ(reader.read_ints("ids"), (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(reader.read_tensor("empty", DType::f32, MemCategory::workspace, tracker).numel(), 0);
}

TEST(Safetensors, ReadsF64AndLargeTensorsInChunks) {
  MemoryTracker tracker;
  const int64_t n = 200000;  // more than one conversion chunk
  std::vector<double> values(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) values[static_cast<size_t>(i)] = 1.0 + 1e-3 * static_cast<double>(i);
  SafetensorsWriter writer;
  writer.add("x", StDType::F64, {n}, values.data());
  const std::string path = scratch_dir() + "/f64.safetensors";
  writer.write(path);
  Tensor x = SafetensorsReader(path).read_tensor("x", DType::f32, MemCategory::workspace, tracker);
  for (int64_t i = 0; i < n; i += 997) {
    EXPECT_EQ(x.data<float>()[i], static_cast<float>(values[static_cast<size_t>(i)]));
  }
  EXPECT_EQ(x.data<float>()[n - 1], static_cast<float>(values.back()));
}

TEST(Safetensors, WriterRejectsDuplicateNames) {
  float x = 1;
  SafetensorsWriter writer;
  writer.add("x", StDType::F32, {1}, &x);
  EXPECT_THROW(writer.add("x", StDType::F32, {1}, &x), Error);
}

struct Malformed {
  const char* label;
  std::string bytes;
  const char* message;
};

class MalformedFile : public ::testing::TestWithParam<Malformed> {};

TEST_P(MalformedFile, GivesOneClearError) {
  const std::string path = scratch_dir() + "/bad.safetensors";
  write_file(path, GetParam().bytes);
  EXPECT_ERROR(SafetensorsReader reader(path), "bad.safetensors", GetParam().message);
}

const std::string k16(16, '\0');
const std::string x_f32_2x2 = R"("x":{"dtype":"F32","shape":[2,2],"data_offsets":)";

INSTANTIATE_TEST_SUITE_P(
    Cases, MalformedFile,
    ::testing::Values(
        Malformed{"empty", "", "too short for the 8-byte"},
        Malformed{"truncated_length", std::string(5, '\x10'), "too short for the 8-byte"},
        Malformed{"header_longer_than_file", st_file("{}", "").substr(0, 8) + "{", "exceeds the file size"},
        Malformed{"huge_header_length", std::string(8, '\xff') + "{}", "exceeds the file size"},
        Malformed{"bad_json", st_file("{\"x\": ", ""), "not valid JSON"},
        Malformed{"not_an_object", st_file("[1, 2]", ""), "not a JSON object"},
        Malformed{"entry_not_object", st_file(R"({"x": 3})", ""), "tensor 'x': entry is not an object"},
        Malformed{"missing_dtype", st_file(R"({"x":{"shape":[1],"data_offsets":[0,4]}})", std::string(4, '\0')), "tensor 'x': field 'dtype' is missing"},
        Malformed{"missing_offsets", st_file(R"({"x":{"dtype":"F32","shape":[1]}})", std::string(4, '\0')), "field 'data_offsets' is missing"},
        Malformed{"bad_dtype", st_file(R"({"x":{"dtype":"Q8","shape":[1],"data_offsets":[0,1]}})", std::string(1, '\0')), "tensor 'x': unsupported dtype 'Q8'"},
        Malformed{"negative_shape", st_file(R"({"x":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", std::string(4, '\0')), "not a list of non-negative integers"},
        Malformed{"float_offsets", st_file("{" + x_f32_2x2 + "[0.5,16]}}", k16), "not a pair of non-negative integers"},
        Malformed{"offsets_out_of_range", st_file("{" + x_f32_2x2 + "[0,32]}}", k16), "tensor 'x': data_offsets [0, 32] lie outside the data section (16 bytes)"},
        Malformed{"offsets_reversed", st_file("{" + x_f32_2x2 + "[16,0]}}", k16), "lie outside"},
        Malformed{"size_mismatch", st_file("{" + x_f32_2x2 + "[0,12]}}", std::string(12, '\0')), "tensor 'x': data_offsets [0, 12] do not match shape [2, 2] of F32 (16 bytes)"},
        Malformed{"duplicate_tensor", st_file("{" + x_f32_2x2 + "[0,16]}," + x_f32_2x2 + "[0,16]}}", k16), "tensor 'x' appears twice"},
        Malformed{"duplicate_field", st_file(R"({"x":{"dtype":"F32","dtype":"F16","shape":[1],"data_offsets":[0,4]}})", std::string(4, '\0')), "tensor 'x': field 'dtype' appears twice"},
        Malformed{"overlap", st_file("{" + x_f32_2x2 + R"([0,16]},"y":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})", k16), "overlap"},
        Malformed{"hole", st_file(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})", k16), "leave bytes [0, 8) unused"},
        Malformed{"trailing_bytes", st_file("{" + x_f32_2x2 + "[0,16]}}", k16 + "abcd"), "trailing bytes"},
        Malformed{"truncated_data", st_file("{" + x_f32_2x2 + "[0,16]}}", std::string(10, '\0')), "lie outside the data section (10 bytes)"},
        Malformed{"metadata_not_string", st_file(R"({"__metadata__":{"step":3}})", ""), "__metadata__ 'step' is not a string"}),
    [](const auto& test) { return std::string(test.param.label); });

class LoadWeights : public ckpt_test::CkptTest {
 protected:
  Model model{testing::small_llama(false), Precision::fp32, ctx};
  std::string path = dir + "/model.safetensors";
};

TEST_F(LoadWeights, SaveLoadRoundTripIsExact) {
  model.init_weights(3);
  save_model_weights(model, path, DType::f32, {{"step", "5"}});
  Model other(model.config(), Precision::bf16, ctx);
  load_model_weights(other, path);
  for (size_t i = 0; i < model.params().size(); ++i) {
    EXPECT_EQ(std::memcmp(model.params()[i].master.raw(), other.params()[i].master.raw(),
                          model.params()[i].master.bytes()), 0);
    if (other.params()[i].compute.defined()) {  // compute copies refreshed
      EXPECT_EQ(other.params()[i].compute.data<bf16>()[0].bits,
                float_to_bf16(other.params()[i].master.data<float>()[0]).bits);
    }
  }
  EXPECT_EQ(SafetensorsReader(path).metadata("step"), "5");
}

TEST_F(LoadWeights, MissingTensorIsAnError) {
  SafetensorsWriter writer;
  for (const Parameter& p : model.params()) {
    if (p.spec.name != "model.norm.weight") writer.add(p.spec.name, p.master);
  }
  writer.write(path);
  EXPECT_ERROR(load_model_weights(model, path), "model.safetensors",
               "tensor 'model.norm.weight' is missing");
}

TEST_F(LoadWeights, ShapeMismatchIsAnError) {
  Tensor wrong({16, 2}, DType::f32, MemCategory::workspace, tracker);
  SafetensorsWriter writer;
  for (const Parameter& p : model.params()) {
    if (p.spec.name == "model.layers.1.self_attn.k_proj.weight") {
      writer.add(p.spec.name, wrong);
    } else {
      writer.add(p.spec.name, p.master);
    }
  }
  writer.write(path);
  EXPECT_ERROR(load_model_weights(model, path), "model.safetensors",
               "tensor 'model.layers.1.self_attn.k_proj.weight' has shape [16, 2], expected [8, 16]");
}

TEST_F(LoadWeights, UnknownTensorIsAnError) {
  float x = 0;
  SafetensorsWriter writer;
  for (const Parameter& p : model.params()) writer.add(p.spec.name, p.master);
  writer.add("model.layers.9.mlp.up_proj.weight", StDType::F32, {1}, &x);
  writer.write(path);
  EXPECT_ERROR(load_model_weights(model, path), "model.safetensors",
               "tensor 'model.layers.9.mlp.up_proj.weight' is not a parameter");
}

TEST_F(LoadWeights, IntegerTensorIsNotAWeight) {
  std::vector<int32_t> ids(16);
  SafetensorsWriter writer;
  for (const Parameter& p : model.params()) {
    if (p.spec.name == "model.norm.weight") {
      writer.add(p.spec.name, StDType::I32, {16}, ids.data());
    } else {
      writer.add(p.spec.name, p.master);
    }
  }
  writer.write(path);
  EXPECT_ERROR(load_model_weights(model, path), "model.safetensors",
               "'model.norm.weight' has dtype I32, expected a float type");
}

}  // namespace
}  // namespace meshtrain
