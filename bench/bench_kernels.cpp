// Per-kernel timings on the target configuration (Llama dim 512, 8 heads,
// SwiGLU hidden 1536, vocab 50257, batch 8 x seq 256 = 2048 tokens), so the
// time of every non-GEMM kernel can be compared with the GEMMs of a layer.
//   build-*/bench/bench_kernels --benchmark_min_time=0.2
#include <benchmark/benchmark.h>

#include <algorithm>
#include <vector>

#include "meshtrain/backend/cpu/activation.h"
#include "meshtrain/backend/cpu/adamw.h"
#include "meshtrain/backend/cpu/attention.h"
#include "meshtrain/backend/cpu/cross_entropy.h"
#include "meshtrain/backend/cpu/embedding.h"
#include "meshtrain/backend/cpu/matmul.h"
#include "meshtrain/backend/cpu/norm.h"

namespace {

using namespace meshtrain;

constexpr int64_t kBatch = 8, kSeq = 256, kTokens = kBatch * kSeq, kDim = 512, kHeads = 8;
constexpr int64_t kHeadDim = kDim / kHeads, kHidden = 1536, kVocab = 50257;

struct Env {
  MemoryTracker tracker;
  cpu::CpuContext ctx{0, tracker};
};
Env& env() {
  static Env e;  // one context for the whole benchmark binary
  return e;
}

Tensor filled(Shape shape, DType dtype, float scale = 0.05f) {
  Tensor t(std::move(shape), DType::f32, MemCategory::workspace, env().tracker);
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = scale * static_cast<float>((i * 7919) % 201 - 100) / 100.0f;
  if (dtype == DType::f32) return t;
  Tensor out(t.shape(), dtype, MemCategory::workspace, env().tracker);
  out.copy_from(t);
  return out;
}

DType dtype_arg(const benchmark::State& state) { return state.range(0) ? DType::bf16 : DType::f32; }

void set_flops(benchmark::State& state, double flops) {
  state.counters["GFLOP/s"] =
      benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

// The three GEMMs of a linear layer y = x w^T with x [rows, k], w [n, k]:
// pass 0 forward, 1 dx = dy w, 2 dw += dy^T x (accumulating, as the model does).
void linear_gemm(int64_t pass, DType dt, int64_t rows, int64_t n, int64_t k, const Tensor& x,
                 const Tensor& w, const Tensor& dy, Tensor& out) {
  auto& ctx = env().ctx;
  if (pass == 0) {
    cpu::matmul(ctx, {1, rows, n, k, false, true, false}, dt, x.raw(), w.raw(), DType::f32, out.raw());
  } else if (pass == 1) {
    cpu::matmul(ctx, {1, rows, k, n, false, false, false}, dt, dy.raw(), w.raw(), DType::f32, out.raw());
  } else {
    cpu::matmul(ctx, {1, n, k, rows, true, false, false}, dt, dy.raw(), x.raw(), DType::f32,
                out.raw(), 1.0f, true);
  }
}

void BM_Matmul(benchmark::State& state) {
  const DType dt = dtype_arg(state);
  const int64_t n = state.range(1), k = state.range(2), pass = state.range(3);
  Tensor x = filled({kTokens, k}, dt), w = filled({n, k}, dt), dy = filled({kTokens, n}, dt);
  Tensor out({kTokens * std::max(n, k) + n * k}, DType::f32, MemCategory::workspace, env().tracker);
  for (auto _ : state) linear_gemm(pass, dt, kTokens, n, k, x, w, dy, out);
  set_flops(state, 2.0 * kTokens * n * k);
}
BENCHMARK(BM_Matmul)
    ->ArgNames({"bf16", "n", "k", "pass"})
    ->ArgsProduct({{0, 1}, {512}, {512}, {0, 1, 2}})
    ->ArgsProduct({{0, 1}, {1536}, {512}, {0, 1, 2}})
    ->ArgsProduct({{0, 1}, {3072}, {512}, {0, 1, 2}})
    ->ArgsProduct({{0, 1}, {512}, {1536}, {0, 1, 2}})
    ->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_Classifier(benchmark::State& state) {
  const DType dt = dtype_arg(state);
  Tensor h = filled({kTokens, kDim}, dt, 1.0f), w = filled({kVocab, kDim}, dt);
  Tensor dh({kTokens, kDim}, DType::f32, MemCategory::workspace, env().tracker);
  Tensor dw({kVocab, kDim}, DType::f32, MemCategory::workspace, env().tracker);
  std::vector<int32_t> targets(kTokens);
  for (int64_t i = 0; i < kTokens; ++i) targets[i] = static_cast<int32_t>((i * 31) % kVocab);
  cpu::ClassifierArgs args{.rows = kTokens, .dim = kDim, .vocab = kVocab, .compute = dt, .h = h.raw(),
                           .w = w.raw(), .targets = targets.data(), .grad_scale = 1.0f / kTokens,
                           .dh = dh.data<float>(), .dw = dw.data<float>(), .chunk_rows = state.range(1)};
  for (auto _ : state) benchmark::DoNotOptimize(cpu::fused_classifier(env().ctx, args));
  set_flops(state, 6.0 * kTokens * kDim * kVocab);
}
BENCHMARK(BM_Classifier)
    ->ArgNames({"bf16", "chunk"})
    ->ArgsProduct({{0, 1}, {0, 128, 512}})
    ->Unit(benchmark::kMillisecond)
    ->Iterations(2)->UseRealTime();

// The classifier's three GEMMs for one chunk of rows: 0 logits = h w^T,
// 1 dh = dlogits w, 2 dw += dlogits^T h. Alternatives for the slow pass 2 (oneDNN
// copies the transposed A): 3 dw^T += h^T dlogits, 4 dw += dlogits^T h from a
// pre-transposed [vocab, rows] dlogits. Alone they ran 0-18% (3) and 0-10% (4)
// faster than 2; inside fused_classifier (3 with a [dim, vocab] buffer added
// into dw once per call: +98 MiB) the paired A/B ratio was 0.94-1.07, noise.
void BM_ClassifierGemm(benchmark::State& state) {
  const DType dt = dtype_arg(state);
  const int64_t rows = state.range(1), pass = state.range(2);
  Tensor h = filled({rows, kDim}, dt), w = filled({kVocab, kDim}, dt), dl = filled({rows, kVocab}, dt);
  Tensor out({rows * kVocab + kVocab * kDim}, DType::f32, MemCategory::workspace, env().tracker);
  for (auto _ : state) {
    if (pass < 3) {
      linear_gemm(pass, dt, rows, kVocab, kDim, h, w, dl, out);
    } else if (pass == 3) {
      cpu::matmul(env().ctx, {1, kDim, kVocab, rows, true, false, false}, dt, h.raw(), dl.raw(),
                  DType::f32, out.raw(), 1.0f, true);
    } else {  // dw += (dlogits^T stored [vocab, rows]) h: A not transposed
      cpu::matmul(env().ctx, {1, kVocab, kDim, rows, false, false, false}, dt, dl.raw(), h.raw(),
                  DType::f32, out.raw(), 1.0f, true);
    }
  }
  set_flops(state, 2.0 * rows * kDim * kVocab);
}
BENCHMARK(BM_ClassifierGemm)
    ->ArgNames({"bf16", "rows", "pass"})
    ->ArgsProduct({{0, 1}, {256}, {0, 1, 2, 3, 4}})
    ->Unit(benchmark::kMillisecond)->UseRealTime();

// Attention FLOPs counted as the model does: causal half of the 4 T^2 D GEMMs
// per head forward (QK^T, PV), twice that backward. Args: bf16, recompute
// (selective activation checkpointing: probabilities not kept, recomputed in
// backward; the FLOPs counted stay the model's), seq (batch = kTokens / seq).
double attention_flops(int64_t seq) {
  return 2.0 * static_cast<double>(kTokens / seq) * kHeads * static_cast<double>(seq * seq) * kHeadDim;
}

struct AttentionBench {
  explicit AttentionBench(const benchmark::State& state)
      : dt(dtype_arg(state)),
        seq(state.range(2)),
        dims{kTokens / seq, seq, kHeads, kHeads, kHeadDim},
        rope(cpu::make_rope_table(kHeadDim, seq, 10000.0f, env().tracker)) {
    saved.recompute_probs = state.range(1) != 0;
  }
  DType dt;
  int64_t seq;
  cpu::AttentionDims dims;
  cpu::RopeTable rope;
  Tensor qkv = filled({kTokens, dims.qkv_width()}, DType::f32, 1.0f);
  Tensor out{{kTokens, kDim}, dt, MemCategory::workspace, env().tracker};
  cpu::AttentionSaved saved;
};

void BM_AttentionForward(benchmark::State& state) {
  AttentionBench b(state);
  for (auto _ : state)
    cpu::attention_forward(env().ctx, b.dims, &b.rope, b.dt, b.qkv.data<float>(), b.out.raw(), b.saved);
  set_flops(state, attention_flops(b.seq));
}
BENCHMARK(BM_AttentionForward)->ArgNames({"bf16", "recompute", "seq"})
    ->ArgsProduct({{0, 1}, {0}, {kSeq}})->ArgsProduct({{1}, {0, 1}, {2048}})
    ->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_AttentionBackward(benchmark::State& state) {
  AttentionBench b(state);
  Tensor dout = filled({kTokens, kDim}, DType::f32);
  Tensor dqkv({kTokens, b.dims.qkv_width()}, b.dt, MemCategory::workspace, env().tracker);
  cpu::attention_forward(env().ctx, b.dims, &b.rope, b.dt, b.qkv.data<float>(), b.out.raw(), b.saved);
  for (auto _ : state)
    cpu::attention_backward(env().ctx, b.dims, &b.rope, b.dt, b.saved, dout.data<float>(), dqkv.raw());
  set_flops(state, 2.0 * attention_flops(b.seq));
}
BENCHMARK(BM_AttentionBackward)->ArgNames({"bf16", "recompute", "seq"})
    ->ArgsProduct({{0, 1}, {0}, {kSeq}})->ArgsProduct({{1}, {0, 1}, {2048}})
    ->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_RmsNormForward(benchmark::State& state) {
  const DType dt = dtype_arg(state);
  Tensor x = filled({kTokens, kDim}, DType::f32, 1.0f), w = filled({kDim}, DType::f32, 1.0f);
  Tensor y({kTokens, kDim}, dt, MemCategory::workspace, env().tracker);
  std::vector<float> rstd(kTokens);
  for (auto _ : state)
    cpu::rmsnorm_forward(x.data<float>(), w.data<float>(), dt, y.raw(), rstd.data(), kTokens, kDim, 1e-5f);
}
BENCHMARK(BM_RmsNormForward)->ArgNames({"bf16"})->Arg(0)->Arg(1)->Unit(benchmark::kMicrosecond)->UseRealTime();

void BM_RmsNormBackward(benchmark::State& state) {
  Tensor x = filled({kTokens, kDim}, DType::f32, 1.0f), w = filled({kDim}, DType::f32, 1.0f);
  Tensor dy = filled({kTokens, kDim}, DType::f32), dx = filled({kTokens, kDim}, DType::f32);
  Tensor dw({kDim}, DType::f32, MemCategory::workspace, env().tracker);
  std::vector<float> rstd(kTokens, 1.0f);
  for (auto _ : state)
    cpu::rmsnorm_backward(x.data<float>(), w.data<float>(), rstd.data(), dy.data<float>(),
                          dx.data<float>(), dw.data<float>(), kTokens, kDim);
}
BENCHMARK(BM_RmsNormBackward)->Unit(benchmark::kMicrosecond)->UseRealTime();

void BM_SwigluForward(benchmark::State& state) {
  const DType dt = dtype_arg(state);
  Tensor gu = filled({kTokens, 2 * kHidden}, DType::f32, 3.0f);
  Tensor out({kTokens, kHidden}, dt, MemCategory::workspace, env().tracker);
  for (auto _ : state) cpu::swiglu_forward(gu.data<float>(), dt, out.raw(), kTokens, kHidden);
}
BENCHMARK(BM_SwigluForward)->ArgNames({"bf16"})->Arg(0)->Arg(1)->Unit(benchmark::kMicrosecond)->UseRealTime();

void BM_SwigluBackward(benchmark::State& state) {
  const DType dt = dtype_arg(state);
  Tensor gu = filled({kTokens, 2 * kHidden}, DType::f32, 3.0f), d = filled({kTokens, kHidden}, DType::f32);
  Tensor dgu({kTokens, 2 * kHidden}, dt, MemCategory::workspace, env().tracker);
  for (auto _ : state)
    cpu::swiglu_backward(gu.data<float>(), d.data<float>(), dt, dgu.raw(), kTokens, kHidden);
}
BENCHMARK(BM_SwigluBackward)->ArgNames({"bf16"})->Arg(0)->Arg(1)->Unit(benchmark::kMicrosecond)->UseRealTime();

void BM_AddInplace(benchmark::State& state) {
  Tensor x = filled({kTokens, kDim}, DType::f32), y = filled({kTokens, kDim}, DType::f32);
  for (auto _ : state) cpu::add_inplace(x.data<float>(), y.data<float>(), kTokens * kDim);
}
BENCHMARK(BM_AddInplace)->Unit(benchmark::kMicrosecond)->UseRealTime();

void BM_EmbeddingBackward(benchmark::State& state) {
  Tensor dout = filled({kTokens, kDim}, DType::f32);
  Tensor dtable({kVocab, kDim}, DType::f32, MemCategory::workspace, env().tracker);
  std::vector<int32_t> ids(kTokens);
  for (int64_t i = 0; i < kTokens; ++i) ids[i] = static_cast<int32_t>((i * 7919) % kVocab);
  for (auto _ : state)
    cpu::embedding_backward({.batch = kBatch, .seq = kSeq, .dim = kDim}, ids.data(),
                            dout.data<float>(), dtable.data<float>(), nullptr);
}
BENCHMARK(BM_EmbeddingBackward)->Unit(benchmark::kMicrosecond)->UseRealTime();

// The whole model's parameters (~53M) in one AdamW update with bf16 copies.
void BM_AdamW(benchmark::State& state) {
  const int64_t n = 53'000'000;
  Tensor p = filled({n}, DType::f32), g = filled({n}, DType::f32);
  Tensor m({n}, DType::f32, MemCategory::workspace, env().tracker), v({n}, DType::f32, MemCategory::workspace, env().tracker);
  Tensor c({n}, DType::bf16, MemCategory::workspace, env().tracker);
  cpu::AdamWHyper hyper;
  hyper.lr = 1e-4f;
  hyper.weight_decay = 0.1f;
  for (auto _ : state)
    cpu::adamw_update(hyper, p.data<float>(), g.data<float>(), m.data<float>(), v.data<float>(),
                      c.data<bf16>(), n);
}
BENCHMARK(BM_AdamW)->Unit(benchmark::kMillisecond)->Iterations(3)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
