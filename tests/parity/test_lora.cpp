// LoRA on the reference models: the adapters' gradients (with and without
// dropout) against the float64 PyTorch reference
// (tests/reference/generate_fixtures.py lora_case), the base
// frozen (no gradient, no optimizer state, never written), step 0 equal to the
// base model, and what a frozen bf16 base holds. QLoRA (lora.quantize_base =
// nf4) against lora_case's twin qlora_case: the base's NF4 values bit for bit,
// the adapters' gradients on that base, and packed weights training never writes.
#include <gtest/gtest.h>

#include <cstring>

#include "fixtures.h"
#include "meshtrain/backend/cpu/cpu_backend.h"
#include "meshtrain/optim/adamw.h"
#include "meshtrain/tensor/dtype.h"
#include "meshtrain/util/error.h"

namespace meshtrain::parity {
namespace {

constexpr double kTol = 1e-5;

class Lora : public ::testing::TestWithParam<const char*> {};

// A case's reference tokens and targets, and a model's mean loss over them
// (its gradients left in the grad buffer).
struct ReferenceBatch {
  SafetensorsReader ref;
  int64_t batch = 0, seq = 0, n = 0;
  std::vector<int32_t> tokens, targets;

  explicit ReferenceBatch(const std::string& case_name)
      : ref(fixture_path(case_name + ".reference.safetensors")) {
    const auto& shape = ref.info("tokens").shape;
    batch = shape[0], seq = shape[1], n = batch * seq;
    tokens = to_i32(ref.read_ints("tokens"));
    targets = to_i32(ref.read_ints("targets"));
  }
  double mean_loss_and_grads(Model& model) {
    model.zero_grads();
    return model.forward_backward(tokens.data(), targets.data(), batch, seq,
                                  1.0f / static_cast<float>(n)) /
           static_cast<double>(n);
  }
};

// One case's fp32 LoRA model (dropout p) on the reference's tokens.
struct LoraCase : ReferenceBatch {
  std::string name;
  SafetensorsReader lora;
  MemoryTracker tracker;
  cpu::CpuBackend ctx{0, tracker};
  std::unique_ptr<Model> model;

  LoraCase(const std::string& case_name, float dropout)
      : ReferenceBatch(case_name), name(case_name),
        lora(fixture_path(case_name + ".lora.safetensors")) {
    ModelConfig config = lora_config(name, lora);
    config.lora.dropout = dropout;
    model = std::make_unique<Model>(config, Precision::fp32, ctx);
    load_base_and_adapters(*model, name, lora);
  }
  double mean_loss_and_grads() { return ReferenceBatch::mean_loss_and_grads(*model); }
  float stored(const std::string& key) {
    return lora.read_tensor(key, DType::f32, MemCategory::workspace, tracker).data<float>()[0];
  }
  // Every adapter's gradient against prefix + "grad/<name>"; returns the worst error.
  double check_adapter_grads(const std::string& prefix) {
    double worst = 0;
    for (const Parameter& p : model->params()) {
      if (!p.spec.trainable) continue;
      Tensor g = lora.read_tensor(prefix + "grad/" + p.spec.name, DType::f32,
                                  MemCategory::workspace, tracker);
      EXPECT_EQ(g.shape(), p.spec.shape) << p.spec.name;
      const double err = rel_error(p.grad.data<float>(), g.data<float>(), g.numel());
      EXPECT_LE(err, kTol) << prefix << "gradient of " << p.spec.name;
      worst = std::max(worst, err);
    }
    return worst;
  }
};

TEST_P(Lora, AdapterGradientsMatchFloat64ReferenceAndTheBaseGetsNone) {
  LoraCase c(GetParam(), 0.0f);
  const double loss = c.mean_loss_and_grads();
  const float base_loss =
      c.ref.read_tensor("loss", DType::f32, MemCategory::workspace, c.tracker).data<float>()[0];
  EXPECT_LE(std::abs(loss - c.stored("loss")) / c.stored("loss"), kTol);
  // The adapters matter: the loss differs from the base model's.
  EXPECT_GT(std::abs(loss - base_loss), 1e-3);
  const double worst = c.check_adapter_grads("");
  int64_t adapters = 0, trainable = 0;
  for (const Parameter& p : c.model->params()) {
    EXPECT_EQ(p.spec.trainable, p.spec.lora_adapter) << p.spec.name;
    if (!p.spec.trainable) {
      EXPECT_FALSE(p.grad.defined()) << p.spec.name << ": a frozen parameter has no gradient";
      continue;
    }
    ++adapters;
    trainable += p.spec.numel();
  }
  // Each adapter: values, gradient, gradient with dropout; + the losses and the samples.
  EXPECT_EQ(3 * adapters + 3, static_cast<int64_t>(c.lora.tensors().size()));
  EXPECT_EQ(c.model->num_trainable(), trainable);
  std::printf("%s lora: %lld adapter tensors, worst gradient rel err %.2e\n", c.name.c_str(),
              static_cast<long long>(adapters), worst);
}

// With adapter dropout: the reference applies meshtrain's counter-based mask
// (reference_model.lora_dropout, a port of util/rng.h) to each adapter's input.
TEST_P(Lora, DropoutGradientsMatchFloat64Reference) {
  const std::string name = GetParam();
  SafetensorsReader meta(fixture_path(name + ".lora.safetensors"));
  LoraCase c(name, std::stof(meta.metadata("dropout")));
  Model& model = *c.model;
  EXPECT_THROW(model.forward_backward(c.tokens.data(), c.targets.data(), c.batch, c.seq, 1.0f),
               Error)
      << "dropout without the rows' samples";
  model.set_lora_dropout(std::stoull(meta.metadata("dropout_seed")),
                         std::stoll(meta.metadata("dropout_step")),
                         c.lora.read_ints("dropout/samples"));
  const double loss = c.mean_loss_and_grads();
  EXPECT_LE(std::abs(loss - c.stored("dropout/loss")) / c.stored("dropout/loss"), kTol);
  EXPECT_GT(std::abs(loss - c.stored("loss")), 1e-4) << "the mask changes the loss";
  const double worst = c.check_adapter_grads("dropout/");
  // Evaluation never drops: the loss is the no-dropout one.
  const double eval =
      model.forward_loss(c.tokens.data(), c.targets.data(), c.batch, c.seq) / c.n;
  EXPECT_LE(std::abs(eval - c.stored("loss")) / c.stored("loss"), kTol);
  std::printf("%s lora dropout: worst gradient rel err %.2e\n", name.c_str(), worst);
}

TEST_P(Lora, StepZeroIsTheBaseModelAndTrainingNeverWritesTheBase) {
  const std::string name = GetParam();
  SafetensorsReader lora(fixture_path(name + ".lora.safetensors"));
  SafetensorsReader ref(fixture_path(name + ".reference.safetensors"));
  const auto& shape = ref.info("tokens").shape;
  const int64_t batch = shape[0], seq = shape[1], n = batch * seq;
  const auto tokens = to_i32(ref.read_ints("tokens"));
  const auto targets = to_i32(ref.read_ints("targets"));
  ModelConfig config = lora_config(name, lora);
  for (Precision precision : {Precision::fp32, Precision::bf16}) {
    SCOPED_TRACE(std::string(precision_name(precision)));
    MemoryTracker tracker;
    cpu::CpuBackend ctx(0, tracker);
    ModelConfig base_config = config;
    base_config.lora = {};
    Model base(base_config, precision, ctx);
    Model tuned(config, precision, ctx);
    base.init_weights(7);
    tuned.init_weights(7);  // same base values (keyed by name), B = 0
    // A frozen tied bf16 embedding is held as bf16 only, so the lookup reads
    // it rounded: the base model, rounded alike, is then the same model.
    Parameter& embedding = base.params()[0];
    if (precision != Precision::fp32 && embedding.compute.defined()) {
      embedding.master.copy_from(embedding.compute);
    }
    EXPECT_EQ(base.forward_loss(tokens.data(), targets.data(), batch, seq),
              tuned.forward_loss(tokens.data(), targets.data(), batch, seq));

    std::vector<float> before(static_cast<size_t>(tuned.num_params()));
    tuned.read_values(0, tuned.num_params(), before.data());
    AdamW opt(tuned, AdamWConfig{});
    for (int step = 0; step < 3; ++step) {
      tuned.zero_grads();
      tuned.forward_backward(tokens.data(), targets.data(), batch, seq, 1.0f / n);
      opt.step(1e-2f);
    }
    std::vector<float> after(before.size());
    tuned.read_values(0, tuned.num_params(), after.data());
    int64_t changed_adapters = 0;
    for (const Parameter& p : tuned.params()) {
      const auto first = before.begin() + p.offset, last = first + p.spec.numel();
      const bool same = std::equal(first, last, after.begin() + p.offset);
      if (!p.spec.trainable) {
        EXPECT_TRUE(same) << p.spec.name << " is frozen but changed";
      } else {
        changed_adapters += same ? 0 : 1;
      }
      // Mixed precision: a frozen matmul weight is its compute copy only.
      const bool compute_only = precision != Precision::fp32 && !p.spec.trainable &&
                                p.spec.matmul_weight;
      EXPECT_EQ(p.master.defined(), !compute_only) << p.spec.name;
    }
    EXPECT_GT(changed_adapters, 0);
    EXPECT_NE(tuned.forward_loss(tokens.data(), targets.data(), batch, seq),
              base.forward_loss(tokens.data(), targets.data(), batch, seq));
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, Lora, ::testing::Values("llama_gqa", "gpt2"));

// ---- QLoRA: <case>.qlora.safetensors (generate_fixtures.py qlora_case) holds
// the adapters, the NF4 round trip of every block linear by the Python
// definition (tests/tensor/nf4_reference.py) as nf4/<name> (f32 values) and
// nf4_packed/<name> (the packed bytes as i32 words), and the float64 loss and
// adapter gradients on that base.

// The bf16 model against the float64 reference (bf16 operands and activations,
// the NF4 values rounded to bf16 before the GEMMs): stated bounds, about 4x
// and 2x what it measures (loss <= 2.5e-4, gradients <= 2.2e-2 relative). What
// the quantisation itself moves is larger (the unquantised base's loss is
// ~1.6e-3 relative away, its adapter gradients 0.2 to 0.7), and each bf16
// result must also lie closer to the NF4 reference than to the unquantised one.
constexpr double kQloraBf16LossTol = 1e-3;
constexpr double kQloraBf16GradTol = 5e-2;

std::vector<uint8_t> packed_bytes(Backend& backend, const Parameter& p) {
  std::vector<uint8_t> out(p.nf4.bytes());
  backend.copy_to_host(p.nf4, out.data());
  return out;
}

// Elements whose f32 bits differ.
int64_t bit_mismatches(const float* a, const float* b, int64_t n) {
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) bad += std::memcmp(a + i, b + i, 4) != 0 ? 1 : 0;
  return bad;
}

class Qlora : public ::testing::TestWithParam<const char*> {};

// One case's QLoRA model: base weights from the weights file through the value
// path (copy_master_from_host quantises an NF4 weight; `pieces` > 0: the whole
// state through write_values in runs of that many elements instead, which
// split NF4 weights), adapters from the qlora file.
struct QloraCase : ReferenceBatch {
  std::string name;
  SafetensorsReader qlora, base;
  MemoryTracker tracker;
  cpu::CpuBackend ctx{0, tracker};
  std::unique_ptr<Model> model;

  QloraCase(const std::string& case_name, Precision precision, int64_t pieces = 0)
      : ReferenceBatch(case_name), name(case_name),
        qlora(fixture_path(case_name + ".qlora.safetensors")),
        base(fixture_path(case_name + ".weights.safetensors")) {
    ModelConfig config = lora_config(name, qlora);
    config.lora.quantize_base = parse_base_quant(qlora.metadata("quantize_base"));
    EXPECT_EQ(config.lora.quantize_base, BaseQuant::nf4);
    model = std::make_unique<Model>(config, precision, ctx);
    EXPECT_TRUE(model->holds_nf4());
    std::vector<float> state(static_cast<size_t>(model->num_params()));
    for (Parameter& p : model->params()) {
      Tensor t = (p.spec.lora_adapter ? qlora : base)
                     .read_tensor(p.spec.name, DType::f32, MemCategory::workspace, tracker);
      EXPECT_EQ(t.shape(), p.spec.shape) << p.spec.name;
      std::copy_n(t.data<float>(), p.spec.numel(), state.begin() + p.offset);
      if (pieces == 0 && (p.spec.nf4 || p.master.defined())) {
        model->copy_master_from_host(p, t.data<float>());
      } else if (pieces == 0) {
        model->write_values(p.offset, p.spec.numel(), t.data<float>());  // bf16 compute only
      }
    }
    for (int64_t at = 0; pieces > 0 && at < model->num_params(); at += pieces) {
      const int64_t count = std::min(pieces, model->num_params() - at);
      model->write_values(at, count, state.data() + at);
    }
    model->sync_compute_weights();
  }
  double mean_loss_and_grads() { return ReferenceBatch::mean_loss_and_grads(*model); }
  double stored_loss() {
    return qlora.read_tensor("loss", DType::f32, MemCategory::workspace, tracker).data<float>()[0];
  }
  Tensor stored(const std::string& key) {
    return qlora.read_tensor(key, DType::f32, MemCategory::workspace, tracker);
  }
};

// What lora.quantize_base = nf4 stores as NF4 (every block linear LoRA can
// target, and only those), and each one's values: the host read
// (copy_master_to_host), the packed bytes and the backend's dequantize_nf4
// (what the GEMMs read: f32, and bf16 rounded once) equal the Python
// definition's bit for bit; write_values in pieces quantises the same.
TEST_P(Qlora, Nf4BaseEqualsTheDefinitionBitForBit) {
  const std::string name = GetParam();
  for (Precision precision : {Precision::fp32, Precision::bf16}) {
    SCOPED_TRACE(std::string(precision_name(precision)));
    QloraCase c(name, precision);
    QloraCase pieces(name, precision, 100);  // 100: never a whole NF4 weight per call
    int64_t nf4_params = 0;
    for (const Parameter& p : c.model->params()) {
      const std::string key = "nf4/" + p.spec.name;
      EXPECT_EQ(p.spec.nf4, c.qlora.contains(key)) << p.spec.name;
      if (!p.spec.nf4) {
        EXPECT_FALSE(p.nf4.defined()) << p.spec.name;
        continue;
      }
      ++nf4_params;
      EXPECT_FALSE(p.spec.trainable) << p.spec.name;
      EXPECT_FALSE(p.grad.defined()) << p.spec.name;
      EXPECT_FALSE(p.master.defined()) << p.spec.name;
      EXPECT_FALSE(p.compute.defined()) << p.spec.name;
      const int64_t numel = p.spec.numel();
      Tensor want = c.stored(key);
      ASSERT_EQ(want.numel(), numel) << p.spec.name;
      std::vector<float> host(static_cast<size_t>(numel));
      c.model->copy_master_to_host(p, host.data());
      EXPECT_EQ(bit_mismatches(host.data(), want.data<float>(), numel), 0)
          << p.spec.name << ": copy_master_to_host";
      // The packed bytes: the definition's, and the same through write_values in pieces.
      const std::vector<uint8_t> packed = packed_bytes(c.ctx, p);
      const std::vector<int64_t> words = c.qlora.read_ints("nf4_packed/" + p.spec.name);
      ASSERT_EQ(static_cast<size_t>(4 * words.size()), packed.size()) << p.spec.name;
      std::vector<uint8_t> want_packed(packed.size());
      for (size_t i = 0; i < words.size(); ++i) {
        const auto word = static_cast<uint32_t>(static_cast<int32_t>(words[i]));
        for (size_t b = 0; b < 4; ++b) {
          want_packed[4 * i + b] = static_cast<uint8_t>(word >> (8 * b));
        }
      }
      EXPECT_TRUE(packed == want_packed) << p.spec.name << ": packed bytes";
      EXPECT_TRUE(packed_bytes(pieces.ctx, pieces.model->param(p.spec.name)) == want_packed)
          << p.spec.name << ": packed bytes after write_values in pieces";
      // The backend's dequantisation, f32 and bf16.
      Tensor y32 = c.ctx.allocate({numel}, DType::f32, MemCategory::workspace);
      Tensor y16 = c.ctx.allocate({numel}, DType::bf16, MemCategory::workspace);
      c.ctx.dequantize_nf4(p.nf4.raw(), numel, DType::f32, y32.raw());
      c.ctx.dequantize_nf4(p.nf4.raw(), numel, DType::bf16, y16.raw());
      std::vector<float> got32(static_cast<size_t>(numel));
      std::vector<uint16_t> got16(static_cast<size_t>(numel));
      c.ctx.copy_to_host(y32, got32.data());
      c.ctx.copy_to_host(y16, got16.data());
      EXPECT_EQ(bit_mismatches(got32.data(), want.data<float>(), numel), 0)
          << p.spec.name << ": backend dequantize_nf4 f32";
      int64_t bad16 = 0;
      for (int64_t i = 0; i < numel; ++i) {
        bad16 += got16[static_cast<size_t>(i)] != float_to_bf16(want.data<float>()[i]).bits;
      }
      EXPECT_EQ(bad16, 0) << p.spec.name << ": backend dequantize_nf4 bf16";
    }
    int64_t in_file = 0;
    for (const StTensorInfo& t : c.qlora.tensors()) in_file += t.name.rfind("nf4/", 0) == 0;
    EXPECT_EQ(nf4_params, in_file);
    EXPECT_GT(nf4_params, 0);
  }
}

TEST_P(Qlora, AdapterGradientsMatchFloat64Reference) {
  const std::string name = GetParam();
  for (Precision precision : {Precision::fp32, Precision::bf16}) {
    SCOPED_TRACE(std::string(precision_name(precision)));
    const bool fp32 = precision == Precision::fp32;
    QloraCase c(name, precision);
    // lora_case: the same adapters on the unquantised base.
    SafetensorsReader lora(fixture_path(name + ".lora.safetensors"));
    const double lora_loss =
        lora.read_tensor("loss", DType::f32, MemCategory::workspace, c.tracker).data<float>()[0];
    const double loss = c.mean_loss_and_grads();
    const double loss_err = std::abs(loss - c.stored_loss()) / c.stored_loss();
    EXPECT_LE(loss_err, fp32 ? kTol : kQloraBf16LossTol);
    // The quantisation matters, and the model computed with it.
    EXPECT_GT(std::abs(c.stored_loss() - lora_loss), 1e-3);
    EXPECT_LT(std::abs(loss - c.stored_loss()), std::abs(loss - lora_loss));
    double worst = 0;
    int64_t adapters = 0;
    for (const Parameter& p : c.model->params()) {
      EXPECT_EQ(p.spec.trainable, p.spec.lora_adapter) << p.spec.name;
      if (!p.spec.trainable) {
        EXPECT_FALSE(p.grad.defined()) << p.spec.name;
        continue;
      }
      ++adapters;
      Tensor g = c.stored("grad/" + p.spec.name);
      EXPECT_EQ(g.shape(), p.spec.shape) << p.spec.name;
      const double err = rel_error(p.grad.data<float>(), g.data<float>(), g.numel());
      EXPECT_LE(err, fp32 ? kTol : kQloraBf16GradTol) << "gradient of " << p.spec.name;
      worst = std::max(worst, err);
      Tensor unquantised =
          lora.read_tensor("grad/" + p.spec.name, DType::f32, MemCategory::workspace, c.tracker);
      EXPECT_LT(err, rel_error(p.grad.data<float>(), unquantised.data<float>(), g.numel()))
          << "gradient of " << p.spec.name << " is closer to the unquantised base's";
    }
    EXPECT_GT(adapters, 0);
    std::printf("%s qlora %s: loss rel err %.2e, %lld adapter tensors, worst gradient rel err "
                "%.2e\n",
                name.c_str(), std::string(precision_name(precision)).c_str(), loss_err,
                static_cast<long long>(adapters), worst);
  }
}

// AdamW trains the adapters only: the packed NF4 bytes (and every other frozen
// value) are the same after a few steps, the adapters and the loss are not.
TEST_P(Qlora, TrainingNeverWritesTheNf4Weights) {
  const std::string name = GetParam();
  for (Precision precision : {Precision::fp32, Precision::bf16}) {
    SCOPED_TRACE(std::string(precision_name(precision)));
    QloraCase c(name, precision);
    Model& model = *c.model;
    std::vector<std::vector<uint8_t>> packed;
    int64_t trainable = 0;
    for (const Parameter& p : model.params()) {
      if (p.spec.nf4) packed.push_back(packed_bytes(c.ctx, p));
      EXPECT_EQ(p.spec.trainable, p.spec.lora_adapter) << p.spec.name;
      if (p.spec.trainable) trainable += p.spec.numel();
    }
    EXPECT_EQ(model.num_trainable(), trainable);
    std::vector<float> before(static_cast<size_t>(model.num_params()));
    model.read_values(0, model.num_params(), before.data());
    const double loss_before =
        model.forward_loss(c.tokens.data(), c.targets.data(), c.batch, c.seq);
    AdamW opt(model, AdamWConfig{});
    for (int step = 0; step < 3; ++step) {
      c.mean_loss_and_grads();
      opt.step(1e-2f);
    }
    std::vector<float> after(before.size());
    model.read_values(0, model.num_params(), after.data());
    size_t k = 0;
    int64_t changed_adapters = 0;
    for (const Parameter& p : model.params()) {
      const auto first = before.begin() + p.offset, last = first + p.spec.numel();
      const bool same = std::equal(first, last, after.begin() + p.offset);
      if (p.spec.nf4) {
        EXPECT_TRUE(packed_bytes(c.ctx, p) == packed[k++]) << p.spec.name << ": packed bytes";
        EXPECT_FALSE(p.grad.defined()) << p.spec.name;
      }
      if (!p.spec.trainable) {
        EXPECT_TRUE(same) << p.spec.name << " is frozen but changed";
      } else {
        changed_adapters += same ? 0 : 1;
      }
    }
    EXPECT_EQ(k, packed.size());
    EXPECT_GT(changed_adapters, 0);
    EXPECT_NE(model.forward_loss(c.tokens.data(), c.targets.data(), c.batch, c.seq), loss_before);
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, Qlora, ::testing::Values("llama_gqa", "gpt2"));

}  // namespace
}  // namespace meshtrain::parity
