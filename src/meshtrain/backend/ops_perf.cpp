#include "meshtrain/backend/ops_perf.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <regex>

#include "meshtrain/tensor/nf4.h"

namespace meshtrain {
namespace {

// A device buffer of random values in [-1, 1) (bf16 or f16 tensors hold the
// same values rounded), made once per case.
Tensor random_tensor(Backend& backend, Shape shape, DType dtype, uint32_t seed) {
  Tensor host(shape, dtype, MemCategory::workspace, backend.tracker());
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  Tensor f32(shape, DType::f32, MemCategory::workspace, backend.tracker());
  for (int64_t i = 0; i < f32.numel(); ++i) f32.data<float>()[i] = dist(gen);
  host.copy_from(f32);
  Tensor device = backend.allocate(std::move(shape), dtype, MemCategory::workspace);
  backend.copy_from_host(host.raw(), device);
  return device;
}

struct PerfCase {
  std::string op, params;
  double flops = 0, bytes = 0;  // per call; flops > 0: matmul-bound
  DType dtype = DType::f32;     // whose matmul peak bounds it
  std::function<void()> call;
};

double median_ms(Backend& backend, const std::function<void()>& call, double seconds) {
  using Clock = std::chrono::steady_clock;
  call();  // warm-up: primitives created, pages touched
  backend.synchronize();
  std::vector<double> ms;
  const auto until = Clock::now() + std::chrono::duration<double>(seconds);
  do {
    const auto start = Clock::now();
    call();
    backend.synchronize();
    ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count());
  } while (Clock::now() < until || ms.size() < 3);
  std::nth_element(ms.begin(), ms.begin() + static_cast<std::ptrdiff_t>(ms.size() / 2), ms.end());
  return ms[ms.size() / 2];
}

// The cases of one training step at `s` in compute dtype `dt`; the tensors
// live in `keep` for the cases' lifetime.
void add_cases(Backend& be, const OpsPerfShape& s, DType dt, std::vector<PerfCase>& cases,
               std::deque<Tensor>& keep, std::vector<std::shared_ptr<void>>& state) {
  const int64_t rows = s.batch * s.seq, d = s.dim, hd = d / s.heads;
  const int64_t qkv = (s.heads + 2 * s.kv_heads) * hd;
  const std::string name(dtype_name(dt));
  const double esize = static_cast<double>(dtype_size(dt));
  auto t = [&](Shape shape, DType dtype) -> const Tensor& {
    keep.push_back(
        random_tensor(be, std::move(shape), dtype, static_cast<uint32_t>(keep.size() + 1)));
    return keep.back();
  };
  // QLoRA: the widest block weight (gate|up) dequantised from NF4 before its GEMMs.
  {
    const int64_t n = 2 * s.hidden * d;
    const Tensor& w = t({n}, DType::f32);
    std::vector<float> values(static_cast<size_t>(n));
    be.copy_to_host(w, values.data());
    const nf4::Layout l = nf4::layout(n);
    std::vector<uint8_t> bytes(static_cast<size_t>(l.bytes));
    nf4::quantize(values, bytes);
    keep.push_back(be.allocate({l.bytes / 4}, DType::i32, MemCategory::workspace));
    const Tensor& packed = keep.back();
    be.copy_from_host(bytes.data(), packed);
    const Tensor& out = t({n}, dt);
    cases.push_back({"dequantize_nf4", fmt::format("n={} ({}x{}) -> {}", n, 2 * s.hidden, d, name),
                     0, static_cast<double>(l.bytes) + esize * static_cast<double>(n), dt,
                     [&be, &packed, &out, n, dt] {
                       be.dequantize_nf4(packed.raw(), n, dt, out.raw());
                     }});
  }
  // The block's GEMMs: forward, input gradient, weight gradient.
  struct Gemm {
    const char* what;
    int64_t out, in;
  };
  for (const Gemm& g : {Gemm{"qkv", qkv, d}, Gemm{"proj", d, d}, Gemm{"ff_in", 2 * s.hidden, d},
                        Gemm{"ff_out", d, s.hidden}}) {
    const Tensor& x = t({rows, g.in}, dt);
    const Tensor& w = t({g.out, g.in}, dt);
    const Tensor& dy = t({rows, g.out}, dt);
    const Tensor& y = t({rows, g.out}, DType::f32);
    const Tensor& dx = t({rows, g.in}, DType::f32);
    const Tensor& dw = t({g.out, g.in}, DType::f32);
    const double flops = 2.0 * static_cast<double>(rows * g.out * g.in);
    const std::string shape =
        fmt::format("{} [{}x{}]x[{}x{}]^T {}", g.what, rows, g.in, g.out, g.in, name);
    cases.push_back({"matmul", shape + " fwd", flops, 0, dt, [&be, &x, &w, &y, rows, g, dt] {
                       be.matmul({.m = rows, .n = g.out, .k = g.in, .trans_b = true}, dt, x.raw(),
                                 w.raw(), DType::f32, y.raw());
                     }});
    cases.push_back({"matmul", shape + " dgrad", flops, 0, dt, [&be, &dy, &w, &dx, rows, g, dt] {
                       be.matmul({.m = rows, .n = g.in, .k = g.out}, dt, dy.raw(), w.raw(),
                                 DType::f32, dx.raw());
                     }});
    cases.push_back({"matmul", shape + " wgrad", flops, 0, dt, [&be, &dy, &x, &dw, rows, g, dt] {
                       be.matmul({.m = g.out, .n = g.in, .k = rows, .trans_a = true}, dt, dy.raw(),
                                 x.raw(), DType::f32, dw.raw(), 1.0f, true);
                     }});
  }
  // The fused classifier's GEMMs on one chunk of 256 rows: logits, dh, dw (accumulated).
  {
    const int64_t n = 256, v = s.vocab;
    const Tensor& h = t({n, d}, dt);
    const Tensor& w = t({v, d}, dt);
    const Tensor& logits = t({n, v}, DType::f32);
    const Tensor& dl = t({n, v}, dt);
    const Tensor& dh = t({n, d}, DType::f32);
    const Tensor& dw = t({v, d}, DType::f32);
    const double flops = 2.0 * static_cast<double>(n * v * d);
    const std::string shape = fmt::format("classifier chunk {}x{}x{} {}", n, v, d, name);
    cases.push_back(
        {"matmul", shape + " logits", flops, 0, dt, [&be, &h, &w, &logits, n, v, d, dt] {
           be.matmul({.m = n, .n = v, .k = d, .trans_b = true}, dt, h.raw(), w.raw(), DType::f32,
                     logits.raw());
         }});
    cases.push_back({"matmul", shape + " dh", flops, 0, dt, [&be, &dl, &w, &dh, n, v, d, dt] {
                       be.matmul({.m = n, .n = d, .k = v}, dt, dl.raw(), w.raw(), DType::f32,
                                 dh.raw());
                     }});
    cases.push_back({"matmul", shape + " dw", flops, 0, dt, [&be, &dl, &h, &dw, n, v, d, dt] {
                       be.matmul({.m = v, .n = d, .k = n, .trans_a = true}, dt, dl.raw(), h.raw(),
                                 DType::f32, dw.raw(), 1.0f, true);
                     }});
  }
  // An MoE layer's experts as grouped GEMMs: 16 experts of width `hidden`,
  // top 2 of the step's rows, loads from 0.5x to 1.5x the mean (fwd gate|up,
  // dgrad, and the wgrad split along k), against one GEMM of all the rows.
  {
    const int64_t E = 16, slots = 2 * rows, f = s.hidden;
    std::vector<int32_t> sizes(static_cast<size_t>(E));
    int64_t given = 0;
    for (int64_t e = 0; e < E; ++e) {
      const double share = (0.5 + static_cast<double>(e) / static_cast<double>(E - 1)) / E;
      sizes[static_cast<size_t>(e)] = static_cast<int32_t>(share * static_cast<double>(slots));
      given += sizes[static_cast<size_t>(e)];
    }
    sizes.back() += static_cast<int32_t>(slots - given);
    const Tensor& x = t({slots, d}, dt);
    const Tensor& w = t({E, 2 * f, d}, dt);
    const Tensor& y = t({slots, 2 * f}, DType::f32);
    const Tensor& dy = t({slots, 2 * f}, dt);
    const Tensor& dx = t({slots, d}, DType::f32);
    const Tensor& dw = t({E, 2 * f, d}, DType::f32);
    const double flops = 2.0 * static_cast<double>(slots * 2 * f * d);
    const std::string shape = fmt::format("{} experts [{}x{}]x[{}x{}]^T {}", E, slots, d, 2 * f, d, name);
    const ops::GroupedMatmulDims fwd{.sizes = sizes, .n = 2 * f, .k = d, .trans_b = true, .max_rows = slots};
    const ops::GroupedMatmulDims dgrad{.sizes = sizes, .n = d, .k = 2 * f, .max_rows = slots};
    const ops::GroupedMatmulDims wgrad{.sizes = sizes, .along_k = true, .m = 2 * f, .n = d,
                                       .max_rows = slots};
    cases.push_back({"grouped_matmul", shape + " fwd", flops, 0, dt, [&be, &x, &w, &y, fwd, dt] {
                       be.grouped_matmul(fwd, dt, x.raw(), w.raw(), DType::f32, y.raw());
                     }});
    cases.push_back({"grouped_matmul", shape + " dgrad", flops, 0, dt,
                     [&be, &dy, &w, &dx, dgrad, dt] {
                       be.grouped_matmul(dgrad, dt, dy.raw(), w.raw(), DType::f32, dx.raw());
                     }});
    cases.push_back({"grouped_matmul", shape + " wgrad", flops, 0, dt,
                     [&be, &dy, &x, &dw, wgrad, dt] {
                       be.grouped_matmul(wgrad, dt, dy.raw(), x.raw(), DType::f32, dw.raw(), 1.0f,
                                         true);
                     }});
  }
  // Attention: causal, half of the T x T scores.
  {
    const Tensor& in = t({rows, qkv}, DType::f32);
    const Tensor& out = t({rows, d}, dt);
    const Tensor& dout = t({rows, d}, DType::f32);
    const Tensor& dqkv = t({rows, qkv}, dt);
    auto rope = std::make_shared<ops::RopeTable>(
        be.make_rope_table(hd, s.seq, ops::rope_inv_freq(hd, 10000.0f)));
    auto saved = std::make_shared<ops::AttentionSaved>();
    state.push_back(rope);
    state.push_back(saved);
    const ops::AttentionDims dims{s.batch, s.seq, s.heads, s.kv_heads, hd, nullptr};
    const double fwd =
        2.0 * static_cast<double>(s.batch * s.heads * s.seq * s.seq * hd);  // 2 GEMMs x half
    const std::string shape =
        fmt::format("b={} t={} h={} kv={} d={} {}", s.batch, s.seq, s.heads, s.kv_heads, hd, name);
    cases.push_back(
        {"attention_forward", shape, fwd, 0, dt, [&be, dims, rope, saved, &in, &out, dt] {
           be.attention_forward(dims, rope.get(), dt, in.data<float>(), out.raw(), *saved);
         }});
    cases.push_back(
        {"attention_backward", shape, 2 * fwd, 0, dt, [&be, dims, rope, saved, &dout, &dqkv, dt] {
           be.attention_backward(dims, rope.get(), dt, *saved, dout.data<float>(), dqkv.raw());
         }});
  }
  // Norms and activations (memory-bound).
  {
    const double n = static_cast<double>(rows * d);
    const Tensor& x = t({rows, d}, DType::f32);
    const Tensor& w = t({d}, DType::f32);
    const Tensor& b = t({d}, DType::f32);
    const Tensor& y = t({rows, d}, dt);
    const Tensor& stats = t({2, rows}, DType::f32);
    const Tensor& dy = t({rows, d}, DType::f32);
    const Tensor& dx = t({rows, d}, DType::f32);
    const Tensor& dw = t({2, d}, DType::f32);
    const std::string shape = fmt::format("rows={} dim={} {}", rows, d, name);
    float* mean = stats.data<float>();
    float* rstd = stats.data<float>() + rows;
    cases.push_back(
        {"rmsnorm_forward", shape, 0, n * (4 + esize), dt, [&be, &x, &w, &y, rstd, rows, d, dt] {
           be.rmsnorm_forward(x.data<float>(), w.data<float>(), dt, y.raw(), rstd, rows, d, 1e-5f);
         }});
    cases.push_back({"rmsnorm_backward",
                     "rows=" + std::to_string(rows) + " dim=" + std::to_string(d), 0, n * 16, dt,
                     [&be, &x, &w, &dy, &dx, &dw, rstd, rows, d] {
                       be.rmsnorm_backward(x.data<float>(), w.data<float>(), rstd, dy.data<float>(),
                                           dx.data<float>(), dw.data<float>(), rows, d);
                     }});
    cases.push_back({"layernorm_forward", shape, 0, n * (4 + esize), dt,
                     [&be, &x, &w, &b, &y, mean, rstd, rows, d, dt] {
                       be.layernorm_forward(x.data<float>(), w.data<float>(), b.data<float>(), dt,
                                            y.raw(), mean, rstd, rows, d, 1e-5f);
                     }});
    cases.push_back(
        {"layernorm_backward", "rows=" + std::to_string(rows) + " dim=" + std::to_string(d), 0,
         n * 16, dt, [&be, &x, &w, &dy, &dx, &dw, mean, rstd, rows, d] {
           be.layernorm_backward(x.data<float>(), w.data<float>(), mean, rstd, dy.data<float>(),
                                 dx.data<float>(), dw.data<float>(), dw.data<float>() + d, rows, d);
         }});
    cases.push_back(
        {"add_inplace", "n=" + std::to_string(rows * d), 0, n * 12, dt, [&be, &dx, &dy, rows, d] {
           be.add_inplace(dx.data<float>(), dy.data<float>(), rows * d);
         }});
    cases.push_back({"residual_add", "rows=" + std::to_string(rows) + " dim=" + std::to_string(d),
                     0, n * 12, dt, [&be, &x, &dy, &w, &dx, rows, d] {
                       be.residual_add(x.data<float>(), dy.data<float>(), w.data<float>(),
                                       dx.data<float>(), rows, d);
                     }});
    // The add and the norm after it in one pass: reads residual and y, writes
    // the sum and the normalised rows (residual_add then rmsnorm_forward move
    // the sum twice more).
    cases.push_back({"residual_add_norm", shape + " rmsnorm", 0, n * (12 + esize), dt,
                     [&be, &x, &dy, &dx, &w, &y, rstd, rows, d, dt] {
                       const ops::NormArgs norm{.w = w.data<float>(), .rstd = rstd, .eps = 1e-5f};
                       be.residual_add_norm(x.data<float>(), dy.data<float>(), nullptr,
                                            dx.data<float>(), norm, dt, y.raw(), rows, d);
                     }});
    cases.push_back({"convert", "n=" + std::to_string(rows * d) + " f32->" + name, 0,
                     n * (4 + esize), dt, [&be, &x, &y, rows, d, dt] {
                       be.convert(DType::f32, x.raw(), dt, y.raw(), rows * d);
                     }});
  }
  {
    const int64_t h = s.hidden;
    const double n = static_cast<double>(rows * h);
    const Tensor& gu = t({rows, 2 * h}, DType::f32);
    const Tensor& act = t({rows, h}, dt);
    const Tensor& dact = t({rows, h}, DType::f32);
    const Tensor& dgu = t({rows, 2 * h}, dt);
    const std::string shape = fmt::format("rows={} hidden={} {}", rows, h, name);
    cases.push_back(
        {"swiglu_forward", shape, 0, n * (8 + esize), dt, [&be, &gu, &act, rows, h, dt] {
           be.swiglu_forward(gu.data<float>(), dt, act.raw(), rows, h);
         }});
    cases.push_back({"swiglu_backward", shape, 0, n * (12 + 2 * esize), dt,
                     [&be, &gu, &dact, &dgu, rows, h, dt] {
                       be.swiglu_backward(gu.data<float>(), dact.data<float>(), dt, dgu.raw(), rows,
                                          h);
                     }});
    cases.push_back({"gelu_forward", fmt::format("n={} {}", rows * h, name), 0, n * (4 + esize), dt,
                     [&be, &gu, &act, rows, h, dt] {
                       be.gelu_forward(gu.data<float>(), dt, act.raw(), rows * h);
                     }});
    cases.push_back({"gelu_backward", fmt::format("n={} {}", rows * h, name), 0, n * (8 + esize),
                     dt, [&be, &gu, &dact, &dgu, rows, h, dt] {
                       be.gelu_backward(gu.data<float>(), dact.data<float>(), dt, dgu.raw(),
                                        rows * h);
                     }});
    cases.push_back({"bias_backward", fmt::format("rows={} n={}", rows, h), 0, n * 4, dt,
                     [&be, &dact, &gu, rows, h] {
                       be.bias_backward(dact.data<float>(), gu.data<float>(), rows, h);
                     }});
  }
  // Embedding and the fused classifier over the vocabulary.
  {
    const Tensor& table = t({s.vocab, d}, DType::f32);
    const Tensor& out = t({rows, d}, DType::f32);
    const Tensor& dtable = t({s.vocab, d}, DType::f32);
    Tensor ids_host({rows}, DType::f32, MemCategory::workspace, be.tracker());  // 4-byte ids
    auto* ids = reinterpret_cast<int32_t*>(ids_host.data<float>());
    std::mt19937 gen(7);
    for (int64_t i = 0; i < rows; ++i)
      ids[i] = static_cast<int32_t>(gen() % static_cast<uint32_t>(s.vocab));
    const Tensor& ids_dev = t({rows}, DType::f32);
    be.copy_from_host(ids_host.raw(), ids_dev);
    const auto* dev_ids = reinterpret_cast<const int32_t*>(ids_dev.raw());
    const double n = static_cast<double>(rows * d);
    const std::string shape = fmt::format("vocab={} rows={} dim={}", s.vocab, rows, d);
    cases.push_back({"embedding_forward", shape, 0, n * 8, dt, [&be, &table, &out, dev_ids, s] {
                       be.embedding_forward({.batch = s.batch, .seq = s.seq, .dim = s.dim},
                                            table.raw(), DType::f32, nullptr, dev_ids,
                                            out.data<float>());
                     }});
    cases.push_back({"embedding_backward", shape, 0, n * 12, dt, [&be, &out, &dtable, dev_ids, s] {
                       be.embedding_backward({.batch = s.batch, .seq = s.seq, .dim = s.dim},
                                             dev_ids, out.data<float>(), dtable.data<float>(),
                                             nullptr);
                     }});
    const Tensor& h = t({rows, d}, dt);
    const Tensor& w = t({s.vocab, d}, dt);
    const Tensor& dh = t({rows, d}, DType::f32);
    const double flops = 3 * 2.0 * static_cast<double>(rows * s.vocab * d);  // logits, dh, dw
    // The loss alone (evaluation: the logits GEMM and the softmax passes).
    cases.push_back({"fused_classifier", fmt::format("{} {} fwd", shape, name), flops / 3, 0, dt,
                     [&be, &h, &w, dev_ids, rows, s, dt] {
                       ops::ClassifierArgs a;
                       a.rows = rows, a.dim = s.dim, a.vocab = s.vocab, a.compute = dt;
                       a.h = h.raw(), a.w = w.raw(), a.targets = dev_ids;
                       be.fused_classifier(a);
                     }});
    // The backend's default chunk of rows, then larger ones (the dw GEMM's k).
    for (int64_t chunk : {int64_t{0}, int64_t{512}, int64_t{1024}}) {
      cases.push_back({"fused_classifier",
                       fmt::format("{} {} fwd+bwd{}", shape, name,
                                   chunk ? fmt::format(" chunk={}", chunk) : ""),
                       flops, 0, dt, [&be, &h, &w, &dh, &dtable, dev_ids, rows, s, dt, chunk] {
                         ops::ClassifierArgs a;
                         a.rows = rows, a.dim = s.dim, a.vocab = s.vocab, a.compute = dt;
                         a.h = h.raw(), a.w = w.raw(), a.targets = dev_ids;
                         a.grad_scale = 1.0f / static_cast<float>(rows);
                         a.dh = dh.data<float>(), a.dw = dtable.data<float>(), a.chunk_rows = chunk;
                         be.fused_classifier(a);
                       }});
    }
  }
  // The optimizer over a 16M-parameter buffer.
  {
    const int64_t n = int64_t{16} << 20;
    const Tensor& p = t({n}, DType::f32);
    const Tensor& g = t({n}, DType::f32);
    const Tensor& m = t({n}, DType::f32);
    const Tensor& v = t({n}, DType::f32);
    const Tensor& copy = t({n}, dt);
    ops::AdamWHyper hyper;
    hyper.lr = 1e-4f, hyper.weight_decay = 0.1f;
    const double bytes = static_cast<double>(n) * (28 + (dt == DType::f32 ? 0 : esize));
    cases.push_back({"adamw_update", fmt::format("n={} compute={}", n, name), 0, bytes, dt,
                     [&be, &p, &g, &m, &v, &copy, hyper, n, dt] {
                       be.adamw_update(hyper, p.data<float>(), g.data<float>(), m.data<float>(),
                                       v.data<float>(), ops::ComputeCopy(copy.raw(), dt), n);
                     }});
    cases.push_back({"sum_squares", fmt::format("n={}", n), 0, static_cast<double>(n) * 4, dt,
                     [&be, &g, n] { be.sum_squares(g.data<float>(), n); }});
  }
  // MoE routing (f32 whatever the precision): OLMoE's 64 experts top-8
  // softmax, DeepSeek-V3's 256 top-8 sigmoid with groups, bias and scaling.
  if (dt != DType::f32) return;
  for (const ops::RouterDims& shape :
       {ops::RouterDims{.experts = 64, .top_k = 8},
        ops::RouterDims{.experts = 256, .top_k = 8, .score = ops::RouterScore::sigmoid,
                        .renormalize = true, .scaling = 2.5f, .n_groups = 8, .topk_groups = 4}}) {
    ops::RouterDims dims = shape;
    dims.tokens = rows;
    const int64_t E = dims.experts, k = dims.top_k;
    const Tensor& logits = t({rows, E}, DType::f32);
    const Tensor& probs = t({rows, E}, DType::f32);
    const Tensor& dlogits = t({rows, E}, DType::f32);
    const Tensor& weights = t({rows, k}, DType::f32);
    const Tensor& dweights = t({rows, k}, DType::f32);
    const Tensor& bias = t({E}, DType::f32);
    keep.push_back(be.allocate({rows, k}, DType::i32, MemCategory::workspace));
    const Tensor& indices = keep.back();
    if (dims.score == ops::RouterScore::sigmoid) dims.bias = bias.data<float>();
    // The backward reads the forward's choice.
    be.router_forward(dims, logits.data<float>(), probs.data<float>(), indices.data<int32_t>(),
                      weights.data<float>(), nullptr);
    const std::string params = fmt::format(
        "tokens={} experts={} k={} {}", rows, E, k,
        dims.score == ops::RouterScore::softmax ? "softmax" : "sigmoid groups=4/8");
    const auto te = static_cast<double>(rows * E), tk = static_cast<double>(rows * k);
    cases.push_back({"router_forward", params, 0, 8 * te + 8 * tk, dt,
                     [&be, dims, &logits, &probs, &indices, &weights] {
                       be.router_forward(dims, logits.data<float>(), probs.data<float>(),
                                         indices.data<int32_t>(), weights.data<float>(), nullptr);
                     }});
    cases.push_back({"router_backward", params, 0, 8 * te + 8 * tk, dt,
                     [&be, dims, &probs, &indices, &dweights, &dlogits] {
                       be.router_backward(dims, probs.data<float>(), indices.data<int32_t>(),
                                          dweights.data<float>(), ops::RouterAuxGrad{},
                                          dlogits.data<float>());
                     }});
    if (dims.score != ops::RouterScore::softmax) continue;
    // Dispatch and combine of the first router's choices.
    const ops::DispatchDims dd{.tokens = rows, .top_k = k, .experts = E, .dim = d};
    const int64_t n = dd.slots();
    keep.push_back(be.allocate({2 * n + E}, DType::i32, MemCategory::workspace));
    int32_t* order = keep.back().data<int32_t>();  // slots, rows, counts
    be.moe_sort(dd, indices.data<int32_t>(), order, order + n, order + 2 * n);
    const Tensor& x = t({rows, d}, DType::f32);
    const Tensor& permuted = t({n, d}, DType::f32);
    const Tensor& out = t({rows, d}, DType::f32);
    const Tensor& d_permuted = t({n, d}, DType::f32);
    const std::string moe = fmt::format("tokens={} k={} experts={} dim={}", rows, k, E, d);
    const double moved = 8.0 * static_cast<double>(n * d);
    cases.push_back({"moe_sort", moe, 0, 4.0 * 3 * static_cast<double>(n), dt,
                     [&be, dd, &indices, order, n] {
                       be.moe_sort(dd, indices.data<int32_t>(), order, order + n, order + 2 * n);
                     }});
    cases.push_back({"moe_permute", moe, 0, moved, dt, [&be, dd, order, &x, &permuted] {
                       be.moe_permute(dd, order, x.data<float>(), DType::f32, permuted.raw());
                     }});
    cases.push_back({"moe_combine", moe, 0, moved, dt, [&be, dd, order, n, &weights, &permuted,
                                                          &out] {
                       be.moe_combine(dd, order + n, weights.data<float>(),
                                      permuted.data<float>(), out.data<float>());
                     }});
    cases.push_back({"moe_combine_backward", moe, 0, 2 * moved, dt,
                     [&be, dd, order, n, &weights, &permuted, &out, &d_permuted, &dweights] {
                       be.moe_combine_backward(dd, order + n, weights.data<float>(),
                                               permuted.data<float>(), out.data<float>(),
                                               DType::f32, d_permuted.raw(),
                                               dweights.data<float>());
                     }});
  }
}

}  // namespace

std::vector<OpsPerfRow> run_ops_perf(Backend& backend, const OpsPerfOptions& options,
                                     std::FILE* out) {
  std::map<DType, double> peak;
  for (DType dt : {DType::f32, DType::bf16}) peak[dt] = backend.measure_matmul_peak_flops(dt, 1.0);
  // A memory-bound op's roofline: a copy moving as many bytes (half read, half
  // written), so a working set in cache is held to the cache's rate.
  std::map<double, double> bandwidth;
  auto copy_rate = [&](double bytes) {
    auto [it, fresh] = bandwidth.try_emplace(bytes, 0.0);
    if (fresh) it->second = backend.measure_copy_bandwidth(static_cast<size_t>(bytes / 2), 0.2);
    return it->second;
  };
  std::fprintf(out,
               "peaks: matmul f32 %.1f GFLOP/s, bf16 %.1f GFLOP/s; copy bandwidth %.1f GB/s (256 "
               "MiB moved)\n",
               peak[DType::f32] / 1e9, peak[DType::bf16] / 1e9, copy_rate(256.0 * (1 << 20)) / 1e9);
  std::fprintf(out, "%-20s %-52s %10s %12s %9s\n", "op", "shape", "ms", "rate", "roofline");
  const std::regex filter(options.op_regex);
  std::vector<OpsPerfRow> rows;
  for (DType dt : {DType::f32, DType::bf16}) {
    std::vector<PerfCase> cases;
    std::deque<Tensor> keep;  // the cases hold references: a deque never moves its elements
    std::vector<std::shared_ptr<void>> state;
    add_cases(backend, options.shape, dt, cases, keep, state);
    for (const PerfCase& c : cases) {
      if (!options.op_regex.empty() && !std::regex_search(c.op, filter)) continue;
      if (dt != DType::f32 && c.params.find("bf16") == std::string::npos)
        continue;  // dtype-free: once
      OpsPerfRow r{c.op, c.params};
      r.ms = median_ms(backend, c.call, options.seconds);
      r.flops = c.flops > 0;
      r.rate = (r.flops ? c.flops : c.bytes) / (r.ms * 1e-3) / 1e9;
      r.roofline = r.rate * 1e9 / (r.flops ? peak[c.dtype] : copy_rate(c.bytes));
      std::fprintf(out, "%-20s %-52s %10.3f %7.1f %-4s %8.0f%%\n", r.op.c_str(), r.params.c_str(),
                   r.ms, r.rate, r.flops ? "GF/s" : "GB/s", 100 * r.roofline);
      std::fflush(out);
      rows.push_back(r);
    }
  }
  return rows;
}

}  // namespace meshtrain
