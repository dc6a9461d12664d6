#include "meshtrain/backend/ops_suite.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <regex>
#include <tuple>
#include <utility>

#include "meshtrain/backend/ops_reference.h"
#include "meshtrain/tensor/nf4.h"
#include "meshtrain/util/error.h"

namespace meshtrain {
namespace {

namespace ref = ops::reference;
using Vec = std::vector<double>;
using Outputs = std::vector<std::pair<std::string, Vec>>;

// ---- host values <-> the bytes an op reads: a DType's, or int32 ids

enum class Elem : uint8_t { f32, bf16, f16, i32 };

Elem elem(DType dtype) {
  switch (dtype) {
    case DType::bf16:
      return Elem::bf16;
    case DType::f16:
      return Elem::f16;
    case DType::i32:
      return Elem::i32;
    default:
      return Elem::f32;
  }
}

size_t elem_size(Elem e) { return e == Elem::bf16 || e == Elem::f16 ? 2 : 4; }

double read_value(Elem e, const char* p) {
  switch (e) {
    case Elem::bf16: {
      bf16 v;
      std::memcpy(&v, p, 2);
      return bf16_to_float(v);
    }
    case Elem::f16: {
      f16 v;
      std::memcpy(&v, p, 2);
      return f16_to_float(v);
    }
    case Elem::i32: {
      int32_t v;
      std::memcpy(&v, p, 4);
      return v;
    }
    default: {
      float v;
      std::memcpy(&v, p, 4);
      return v;
    }
  }
}

void write_value(Elem e, double x, char* p) {
  switch (e) {
    case Elem::bf16: {
      const bf16 v = float_to_bf16(static_cast<float>(x));
      std::memcpy(p, &v, 2);
      return;
    }
    case Elem::f16: {
      const f16 v = float_to_f16(static_cast<float>(x));
      std::memcpy(p, &v, 2);
      return;
    }
    case Elem::i32: {
      const auto v = static_cast<int32_t>(x);
      std::memcpy(p, &v, 4);
      return;
    }
    default: {
      const auto v = static_cast<float>(x);
      std::memcpy(p, &v, 4);
      return;
    }
  }
}

// What a kernel reading `dtype` sees of `values`.
Vec rounded(const Vec& values, DType dtype) {
  Vec out(values.size());
  char bytes[8];
  for (size_t i = 0; i < values.size(); ++i) {
    write_value(elem(dtype), values[i], bytes);
    out[i] = read_value(elem(dtype), bytes);
  }
  return out;
}

// ---- device buffers with guards

constexpr size_t kGuardBytes = 256;
constexpr unsigned char kGuard = 0xA5;

// One run of a case on one backend: uploads with guard bytes on both sides,
// downloads that check the guards and finiteness (the problems found go to
// `problems`).
class Probe {
 public:
  struct Buffer {
    Tensor tensor;  // guard, n elements, guard
    Elem elem;
    int64_t n;
    std::string name;
    void* data() const { return static_cast<char*>(tensor.raw()) + kGuardBytes; }
    template <typename T>
    T* as() const {
      return static_cast<T*>(data());
    }
    // The n elements between the guards, as a tensor.
    Tensor view() const {
      return tensor.view(static_cast<int64_t>(kGuardBytes / elem_size(elem)), {n});
    }
  };

  explicit Probe(Backend& backend) : backend_(backend) {}
  Backend& backend() { return backend_; }
  std::vector<std::string>& problems() { return problems_; }

  Buffer upload(const std::string& name, DType dtype, const Vec& values) {
    return upload_as(name, elem(dtype), values);
  }
  Buffer upload_ids(const std::string& name, const std::vector<int32_t>& ids) {
    return upload_as(name, Elem::i32, Vec(ids.begin(), ids.end()));
  }

  Buffer upload_as(const std::string& name, Elem e, const Vec& values) {
    const size_t esize = elem_size(e), bytes = values.size() * esize;
    std::vector<char> host(bytes + 2 * kGuardBytes, static_cast<char>(kGuard));
    for (size_t i = 0; i < values.size(); ++i)
      write_value(e, values[i], &host[kGuardBytes + i * esize]);
    // Guards and elements in one tensor of the elements' size.
    const DType storage = e == Elem::bf16 ? DType::bf16
                          : e == Elem::f16  ? DType::f16
                          : e == Elem::i32  ? DType::i32
                                            : DType::f32;
    Buffer b{backend_.allocate({static_cast<int64_t>(host.size() / esize)}, storage,
                               MemCategory::workspace),
             e, static_cast<int64_t>(values.size()), name};
    backend_.copy_from_host(host.data(), b.tensor);
    return b;
  }

  Vec download(const Buffer& b) {
    backend_.synchronize();
    std::vector<unsigned char> host(b.tensor.bytes());
    backend_.copy_to_host(b.tensor, host.data());
    const size_t end = kGuardBytes + static_cast<size_t>(b.n) * elem_size(b.elem);
    for (size_t i = 0; i < host.size(); ++i) {
      if ((i < kGuardBytes || i >= end) && host[i] != kGuard) {
        problems_.push_back(fmt::format(
            "{}: wrote {} byte {} past its {}", b.name, i < kGuardBytes ? "before" : "after",
            i < kGuardBytes ? kGuardBytes - i : i - end + 1, i < kGuardBytes ? "start" : "end"));
        break;
      }
    }
    Vec out(static_cast<size_t>(b.n));
    for (size_t i = 0; i < out.size(); ++i) {
      out[i] = read_value(
          b.elem, reinterpret_cast<const char*>(&host[kGuardBytes + i * elem_size(b.elem)]));
    }
    return out;
  }

 private:
  Backend& backend_;
  std::vector<std::string> problems_;
};

// ---- cases

struct OpCase {
  std::string op, params;
  double max_nmse;
  std::function<Outputs(Probe&)> run;  // the op on a backend
  std::function<Outputs()> reference;  // float64
};

double max_nmse(DType dtype) {
  switch (dtype) {
    case DType::bf16:
      return 1e-4;
    case DType::f16:
      return 1e-5;
    default:
      return 1e-9;
  }
}

class Random {
 public:
  explicit Random(uint32_t seed) : gen_(seed) {}
  Vec uniform(int64_t n, double lo = -1, double hi = 1) {
    std::uniform_real_distribution<double> d(lo, hi);
    Vec v(static_cast<size_t>(n));
    for (double& x : v) x = d(gen_);
    return v;
  }
  std::vector<int32_t> ints(int64_t n, int32_t lo, int32_t hi) {
    std::uniform_int_distribution<int32_t> d(lo, hi);
    std::vector<int32_t> v(static_cast<size_t>(n));
    for (int32_t& x : v) x = d(gen_);
    return v;
  }

 private:
  std::mt19937 gen_;
};

// Packed records: each row's positions restart at 0 at random record starts.
std::vector<int32_t> packed_positions(Random& rng, int64_t batch, int64_t seq) {
  std::vector<int32_t> pos(static_cast<size_t>(batch * seq));
  const std::vector<int32_t> starts = rng.ints(batch * seq, 0, 3);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t t = 0; t < seq; ++t) {
      const size_t i = static_cast<size_t>(b * seq + t);
      pos[i] = t == 0 || starts[i] == 0 ? 0 : pos[i - 1] + 1;
    }
  }
  return pos;
}

void add_matmul_cases(std::vector<OpCase>& cases, Random& rng) {
  struct Shape {
    int64_t batch, m, n, k;
    bool ta, tb, bias, acc, bcast, strided;
    float alpha;
  };
  const Shape shapes[] = {
      {1, 1, 1, 1, false, false, false, false, false, false, 1},
      {1, 7, 13, 5, false, false, false, false, false, false, 1},
      {1, 33, 65, 17, false, true, true, false, false, false, 1},
      {1, 17, 9, 31, true, false, false, true, false, false, 0.5f},
      {1, 64, 64, 64, true, true, false, false, false, false, 1},
      {3, 5, 7, 11, false, false, false, false, false, false, 1},
      {4, 9, 6, 13, false, true, false, false, true, false, 1},
      {1, 11, 6, 10, false, true, false, true, false, true, 1},
      {1, 128, 257, 96, false, true, false, false, false, false, 1},
  };
  for (const Shape& s : shapes) {
    for (DType ab : {DType::f32, DType::bf16, DType::f16}) {
      // C in f32, and in a 16-bit input's dtype where nothing accumulates into it.
      std::vector<DType> outputs{DType::f32};
      if (ab != DType::f32 && !s.acc) outputs.push_back(ab);
      for (DType c : outputs) {
        ops::MatmulDims d{.batch = s.batch,
                          .m = s.m,
                          .n = s.n,
                          .k = s.k,
                          .trans_a = s.ta,
                          .trans_b = s.tb,
                          .broadcast_b = s.bcast};
        if (s.strided) {  // rows of a wider matrix: A's and C's leading dimensions
          d.lda = s.k + 3;
          d.ldc = s.n + 5;
        }
        const int64_t a_len = s.strided ? (s.m - 1) * d.lda + s.k : s.batch * s.m * s.k;
        const int64_t b_len = (s.bcast ? 1 : s.batch) * s.k * s.n;
        const int64_t c_len = s.strided ? (s.m - 1) * d.ldc + s.n : s.batch * s.m * s.n;
        const Vec a = rounded(rng.uniform(a_len), ab), b = rounded(rng.uniform(b_len), ab);
        const Vec bias = rounded(rng.uniform(s.n), DType::f32),
                  c0 = rounded(rng.uniform(c_len), DType::f32);
        std::string params =
            fmt::format("b={} m={} n={} k={} {}{} ab={} c={}", s.batch, s.m, s.n, s.k,
                        s.ta ? "t" : "n", s.tb ? "t" : "n", dtype_name(ab), dtype_name(c));
        if (s.bias) params += " bias";
        if (s.acc) params += fmt::format(" acc alpha={}", s.alpha);
        if (s.bcast) params += " broadcast_b";
        if (s.strided) params += fmt::format(" lda={} ldc={}", d.lda, d.ldc);
        cases.push_back(OpCase{
            "matmul", params, max_nmse(c == DType::f32 ? ab : c),
            [=](Probe& p) {
              auto A = p.upload("a", ab, a), B = p.upload("b", ab, b), C = p.upload("c", c, c0);
              auto Bias = p.upload("bias", DType::f32, bias);
              p.backend().matmul(d, ab, A.data(), B.data(), c, C.data(), s.alpha, s.acc,
                                 s.bias ? Bias.as<float>() : nullptr);
              return Outputs{{"c", p.download(C)}};
            },
            [=] {
              Vec out = c0;
              ref::matmul(d, a, b, out, s.alpha, s.acc, s.bias ? bias.data() : nullptr);
              if (s.strided) {  // the gaps between C's rows stay as they were
                for (int64_t i = 0; i < c_len; ++i) {
                  if (i % d.ldc >= s.n) out[static_cast<size_t>(i)] = c0[static_cast<size_t>(i)];
                }
              }
              return Outputs{{"c", out}};
            }});
        // matmul_add: C = addend + op(A) op(B) (+ bias), the addend left as it
        // was; dense f32 C only (the residual stream).
        if (c != DType::f32 || s.strided || s.alpha != 1.0f) continue;
      const Vec addend = rounded(rng.uniform(c_len), DType::f32);
      cases.push_back(OpCase{
          "matmul_add", fmt::format("b={} m={} n={} k={} {}{} ab={}{}{}", s.batch, s.m, s.n, s.k,
                                    s.ta ? "t" : "n", s.tb ? "t" : "n", dtype_name(ab),
                                    s.bias ? " bias" : "", s.bcast ? " broadcast_b" : ""),
          max_nmse(ab),
          [=](Probe& p) {
            auto A = p.upload("a", ab, a), B = p.upload("b", ab, b);
            auto R = p.upload("addend", DType::f32, addend), C = p.upload("c", DType::f32, c0);
            auto Bias = p.upload("bias", DType::f32, bias);
            p.backend().matmul_add(d, ab, A.data(), B.data(), R.as<float>(), C.as<float>(),
                                   s.bias ? Bias.as<float>() : nullptr);
            return Outputs{{"c", p.download(C)}, {"addend", p.download(R)}};
          },
          [=] {
            Vec out = addend;
            ref::matmul(d, a, b, out, 1.0, true, s.bias ? bias.data() : nullptr);
            return Outputs{{"c", out}, {"addend", addend}};
          }});
      }
    }
  }
}

// Groups of rows with empty ones among them, split along m (B per group,
// [n, k] or [k, n], C dense or strided) and along k (C per group, accumulated).
void add_grouped_matmul_cases(std::vector<OpCase>& cases, Random& rng) {
  struct Shape {
    std::vector<int32_t> sizes;
    bool along_k, trans_b;
    int64_t m, n, k, ldc, spare;  // spare: max_rows beyond the groups' rows
    bool acc;
    float alpha;
  };
  const Shape shapes[] = {
      {{3, 0, 5, 1}, false, true, 0, 6, 7, 0, 2, false, 1},
      {{17, 9, 0, 33}, false, false, 0, 13, 20, 16, 0, false, 1},
      {{64, 1, 30}, false, true, 0, 65, 48, 0, 0, false, 1},
      {{4, 0, 11, 6}, true, false, 5, 9, 0, 0, 3, true, 0.5f},
      {{40, 23, 0, 8, 1}, true, false, 33, 17, 0, 0, 0, true, 1},
      {{0, 0}, false, true, 0, 4, 4, 0, 1, false, 1},
  };
  for (const Shape& s : shapes) {
    int64_t rows = 0;
    for (const int32_t r : s.sizes) rows += r;
    const auto groups = static_cast<int64_t>(s.sizes.size());
    for (DType ab : {DType::f32, DType::bf16, DType::f16}) {
      std::vector<DType> outputs{DType::f32};
      if (ab != DType::f32 && !s.acc) outputs.push_back(ab);
      for (DType c : outputs) {
        const ops::GroupedMatmulDims d{.sizes = s.sizes, .along_k = s.along_k, .m = s.m, .n = s.n,
                                       .k = s.k, .trans_b = s.trans_b, .ldc = s.ldc,
                                       .max_rows = rows + s.spare};
        const int64_t ldc = s.ldc > 0 ? s.ldc : s.n;
        const int64_t a_len = rows * (s.along_k ? s.m : s.k);
        const int64_t b_len = s.along_k ? rows * s.n : groups * s.k * s.n;
        const int64_t c_len = s.along_k ? groups * s.m * s.n : rows * ldc;
        const Vec a = rounded(rng.uniform(a_len), ab), b = rounded(rng.uniform(b_len), ab);
        const Vec c0 = rounded(rng.uniform(c_len), c);
        std::string sizes;
        for (const int32_t r : s.sizes) sizes += fmt::format("{}{}", sizes.empty() ? "" : ",", r);
        std::string params = fmt::format(
            "sizes={} {} max_rows={}{} ab={} c={}", sizes,
            s.along_k ? fmt::format("along_k m={} n={}", s.m, s.n)
                      : fmt::format("along_m n={} k={}", s.n, s.k),
            d.max_rows, s.trans_b ? " trans_b" : "", dtype_name(ab), dtype_name(c));
        if (s.ldc > 0) params += fmt::format(" ldc={}", s.ldc);
        if (s.acc) params += fmt::format(" acc alpha={}", s.alpha);
        cases.push_back(OpCase{
            "grouped_matmul", params, max_nmse(c == DType::f32 ? ab : c),
            [=](Probe& p) {
              auto A = p.upload("a", ab, a), B = p.upload("b", ab, b), C = p.upload("c", c, c0);
              p.backend().grouped_matmul(d, ab, A.data(), B.data(), c, C.data(), s.alpha, s.acc);
              return Outputs{{"c", p.download(C)}};
            },
            [=] {
              Vec out = c0;
              ref::grouped_matmul(d, a, b, out, s.alpha, s.acc);
              if (s.ldc > 0) {  // the gaps between C's rows stay as they were
                for (int64_t i = 0; i < c_len; ++i) {
                  if (i % s.ldc >= s.n) out[static_cast<size_t>(i)] = c0[static_cast<size_t>(i)];
                }
              }
              return Outputs{{"c", out}};
            }});
      }
    }
  }
}

void add_norm_cases(std::vector<OpCase>& cases, Random& rng) {
  const std::pair<int64_t, int64_t> shapes[] = {{1, 1}, {5, 7}, {33, 64}, {3, 4099}};
  const double eps = 1e-5;
  for (auto [rows, dim] : shapes) {
    const Vec x = rounded(rng.uniform(rows * dim, -2, 2), DType::f32);
    const Vec w = rounded(rng.uniform(dim, 0.5, 1.5), DType::f32),
              b = rounded(rng.uniform(dim), DType::f32);
    const Vec dy = rounded(rng.uniform(rows * dim), DType::f32);
    const Vec dx0 = rounded(rng.uniform(rows * dim), DType::f32),
              dw0 = rounded(rng.uniform(dim), DType::f32);
    const Vec db0 = rounded(rng.uniform(dim), DType::f32);
    for (DType out : {DType::f32, DType::bf16, DType::f16}) {
      const std::string params = fmt::format("rows={} dim={} out={}", rows, dim, dtype_name(out));
      cases.push_back(
          OpCase{"rmsnorm_forward", params, max_nmse(out),
                 [=](Probe& p) {
                   auto X = p.upload("x", DType::f32, x), W = p.upload("w", DType::f32, w);
                   auto Y = p.upload("y", out, Vec(x.size())),
                        R = p.upload("rstd", DType::f32, Vec(static_cast<size_t>(rows)));
                   p.backend().rmsnorm_forward(X.as<float>(), W.as<float>(), out, Y.data(),
                                               R.as<float>(), rows, dim, static_cast<float>(eps));
                   return Outputs{{"y", p.download(Y)}, {"rstd", p.download(R)}};
                 },
                 [=] {
                   Vec y(x.size()), r(static_cast<size_t>(rows));
                   ref::rmsnorm_forward(x, w, y, r, rows, dim, eps);
                   return Outputs{{"y", y}, {"rstd", r}};
                 }});
      cases.push_back(OpCase{
          "layernorm_forward", params, max_nmse(out),
          [=](Probe& p) {
            auto X = p.upload("x", DType::f32, x), W = p.upload("w", DType::f32, w),
                 Bb = p.upload("b", DType::f32, b);
            auto Y = p.upload("y", out, Vec(x.size()));
            auto M = p.upload("mean", DType::f32, Vec(static_cast<size_t>(rows)));
            auto R = p.upload("rstd", DType::f32, Vec(static_cast<size_t>(rows)));
            p.backend().layernorm_forward(X.as<float>(), W.as<float>(), Bb.as<float>(), out,
                                          Y.data(), M.as<float>(), R.as<float>(), rows, dim,
                                          static_cast<float>(eps));
            return Outputs{{"y", p.download(Y)}, {"mean", p.download(M)}, {"rstd", p.download(R)}};
          },
          [=] {
            Vec y(x.size()), m(static_cast<size_t>(rows)), r(static_cast<size_t>(rows));
            ref::layernorm_forward(x, w, b, y, m, r, rows, dim, eps);
            return Outputs{{"y", y}, {"mean", m}, {"rstd", r}};
          }});
      // Fused with the residual add before it: the norm of residual + (y + bias).
      for (bool layer : {false, true}) {
        const bool with_bias = layer;  // GPT-2's projections have one, Llama's do not
        const Vec res = rounded(rng.uniform(rows * dim, -2, 2), DType::f32);
        const Vec add = rounded(rng.uniform(rows * dim), DType::f32);
        const Vec bias = rounded(rng.uniform(dim), DType::f32);
        cases.push_back(OpCase{
            "residual_add_norm", fmt::format("{} {}{}", params, layer ? "layernorm" : "rmsnorm",
                                             with_bias ? " bias" : ""),
            max_nmse(out),
            [=](Probe& p) {
              auto R = p.upload("residual", DType::f32, res), Y = p.upload("y", DType::f32, add);
              auto Bias = p.upload("bias", DType::f32, bias), W = p.upload("w", DType::f32, w),
                   Bb = p.upload("b", DType::f32, b);
              auto S = p.upload("sum", DType::f32, Vec(x.size())),
                   O = p.upload("out", out, Vec(x.size()));
              auto M = p.upload("mean", DType::f32, Vec(static_cast<size_t>(rows))),
                   Rs = p.upload("rstd", DType::f32, Vec(static_cast<size_t>(rows)));
              const ops::NormArgs norm{.layer_norm = layer,
                                       .w = W.as<float>(),
                                       .b = layer ? Bb.as<float>() : nullptr,
                                       .mean = layer ? M.as<float>() : nullptr,
                                       .rstd = Rs.as<float>(),
                                       .eps = static_cast<float>(eps)};
              p.backend().residual_add_norm(R.as<float>(), Y.as<float>(),
                                            with_bias ? Bias.as<float>() : nullptr, S.as<float>(),
                                            norm, out, O.data(), rows, dim);
              Outputs o{{"sum", p.download(S)}, {"out", p.download(O)}, {"rstd", p.download(Rs)}};
              if (layer) o.emplace_back("mean", p.download(M));
              return o;
            },
            [=] {
              Vec sum(x.size()), y(x.size()), m(static_cast<size_t>(rows)),
                  r(static_cast<size_t>(rows));
              for (size_t i = 0; i < sum.size(); ++i) {
                sum[i] = res[i] + add[i] + (with_bias ? bias[i % static_cast<size_t>(dim)] : 0.0);
              }
              if (layer) {
                ref::layernorm_forward(sum, w, b, y, m, r, rows, dim, eps);
              } else {
                ref::rmsnorm_forward(sum, w, y, r, rows, dim, eps);
              }
              Outputs o{{"sum", sum}, {"out", y}, {"rstd", r}};
              if (layer) o.emplace_back("mean", m);
              return o;
            }});
      }
      if (out != DType::f32) continue;  // backward: f32 in and out
      const std::string bparams = fmt::format("rows={} dim={}", rows, dim);
      // The saved statistics as a forward pass leaves them (f32).
      Vec y(x.size()), mean(static_cast<size_t>(rows)), rstd(static_cast<size_t>(rows));
      ref::rmsnorm_forward(x, w, y, rstd, rows, dim, eps);
      const Vec rms_rstd = rounded(rstd, DType::f32);
      ref::layernorm_forward(x, w, b, y, mean, rstd, rows, dim, eps);
      const Vec ln_mean = rounded(mean, DType::f32), ln_rstd = rounded(rstd, DType::f32);
      cases.push_back(OpCase{
          "rmsnorm_backward", bparams, max_nmse(DType::f32),
          [=](Probe& p) {
            auto X = p.upload("x", DType::f32, x), W = p.upload("w", DType::f32, w);
            auto R = p.upload("rstd", DType::f32, rms_rstd), DY = p.upload("dy", DType::f32, dy);
            auto DX = p.upload("dx", DType::f32, dx0), DW = p.upload("dw", DType::f32, dw0);
            p.backend().rmsnorm_backward(X.as<float>(), W.as<float>(), R.as<float>(),
                                         DY.as<float>(), DX.as<float>(), DW.as<float>(), rows, dim);
            return Outputs{{"dx", p.download(DX)}, {"dw", p.download(DW)}};
          },
          [=] {
            Vec dx = dx0, dw = dw0;
            ref::rmsnorm_backward(x, w, dy, dx, dw, rows, dim, eps);
            return Outputs{{"dx", dx}, {"dw", dw}};
          }});
      cases.push_back(OpCase{
          "layernorm_backward", bparams, max_nmse(DType::f32),
          [=](Probe& p) {
            auto X = p.upload("x", DType::f32, x), W = p.upload("w", DType::f32, w);
            auto M = p.upload("mean", DType::f32, ln_mean),
                 R = p.upload("rstd", DType::f32, ln_rstd);
            auto DY = p.upload("dy", DType::f32, dy), DX = p.upload("dx", DType::f32, dx0);
            auto DW = p.upload("dw", DType::f32, dw0), DB = p.upload("db", DType::f32, db0);
            p.backend().layernorm_backward(X.as<float>(), W.as<float>(), M.as<float>(),
                                           R.as<float>(), DY.as<float>(), DX.as<float>(),
                                           DW.as<float>(), DB.as<float>(), rows, dim);
            return Outputs{{"dx", p.download(DX)}, {"dw", p.download(DW)}, {"db", p.download(DB)}};
          },
          [=] {
            Vec dx = dx0, dw = dw0, db = db0;
            ref::layernorm_backward(x, w, dy, dx, dw, db, rows, dim, eps);
            return Outputs{{"dx", dx}, {"dw", dw}, {"db", db}};
          }});
    }
  }
}

// The (row, group) blocks of a strided matrix as contiguous rows of `width`,
// and back (the group RMSNorm's reference runs ref::rmsnorm on them).
Vec gather_groups(const Vec& x, const ops::GroupNormDims& d) {
  Vec out(static_cast<size_t>(d.rows * d.count));
  for (int64_t r = 0; r < d.rows; ++r) {
    for (int64_t i = 0; i < d.count; ++i) {
      out[static_cast<size_t>(r * d.count + i)] = x[static_cast<size_t>(r * d.stride + i)];
    }
  }
  return out;
}

void scatter_groups(const Vec& groups, const ops::GroupNormDims& d, Vec& x) {
  for (int64_t r = 0; r < d.rows; ++r) {
    for (int64_t i = 0; i < d.count; ++i) {
      x[static_cast<size_t>(r * d.stride + i)] = groups[static_cast<size_t>(r * d.count + i)];
    }
  }
}

// QK-norm: per head (width < count) and over the whole projection, inside
// rows with other columns after them (which must stay untouched).
void add_group_norm_cases(std::vector<OpCase>& cases, Random& rng) {
  const ops::GroupNormDims shapes[] = {{.rows = 1, .stride = 4, .count = 2, .width = 2},
                                       {.rows = 7, .stride = 48, .count = 32, .width = 8},
                                       {.rows = 5, .stride = 40, .count = 24, .width = 24},
                                       {.rows = 33, .stride = 320, .count = 256, .width = 128}};
  for (ops::GroupNormDims d : shapes) {
    d.eps = 1e-6f;
    const int64_t n = d.rows * d.stride, stats = d.rows * d.groups();
    const Vec x = rounded(rng.uniform(n, -2, 2), DType::f32);
    const Vec w = rounded(rng.uniform(d.width, 0.5, 1.5), DType::f32);
    const Vec dw0 = rounded(rng.uniform(d.width), DType::f32);
    const std::string shape = fmt::format("rows={} stride={} count={} width={}", d.rows, d.stride,
                                          d.count, d.width);
    // The reference on the groups as rows.
    const Vec xg = gather_groups(x, d);
    Vec yg(xg.size()), rstd(static_cast<size_t>(stats));
    ref::rmsnorm_forward(xg, w, yg, rstd, stats, d.width, d.eps);
    cases.push_back(OpCase{"group_rmsnorm_forward", shape, max_nmse(DType::f32),
                           [=](Probe& p) {
                             auto X = p.upload("x", DType::f32, x), W = p.upload("w", DType::f32, w);
                             auto S = p.upload("saved", DType::f32, Vec(xg.size()));
                             auto R = p.upload("rstd", DType::f32, Vec(rstd.size()));
                             p.backend().group_rmsnorm_forward(d, X.as<float>(), W.as<float>(),
                                                               S.as<float>(), R.as<float>());
                             return Outputs{{"x", p.download(X)},
                                            {"saved", p.download(S)},
                                            {"rstd", p.download(R)}};
                           },
                           [=] {
                             Vec y = x;
                             scatter_groups(yg, d, y);
                             return Outputs{{"x", y}, {"saved", xg}, {"rstd", rstd}};
                           }});
    const Vec saved_rstd = rounded(rstd, DType::f32);
    for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
      const Vec dy = rounded(rng.uniform(n), dt);
      cases.push_back(OpCase{
          "group_rmsnorm_backward", fmt::format("{} {}", shape, dtype_name(dt)), max_nmse(dt),
          [=](Probe& p) {
            auto S = p.upload("saved", DType::f32, xg), W = p.upload("w", DType::f32, w);
            auto R = p.upload("rstd", DType::f32, saved_rstd), DY = p.upload("dy", dt, dy);
            auto DW = p.upload("dw", DType::f32, dw0);
            p.backend().group_rmsnorm_backward(d, S.as<float>(), W.as<float>(), R.as<float>(), dt,
                                               DY.data(), DW.as<float>());
            return Outputs{{"dx", p.download(DY)}, {"dw", p.download(DW)}};
          },
          [=] {
            const Vec dyg = gather_groups(dy, d);
            Vec dxg(dyg.size(), 0.0), dw = dw0, dx = dy;
            ref::rmsnorm_backward(xg, w, dyg, dxg, dw, stats, d.width, d.eps);
            scatter_groups(dxg, d, dx);
            return Outputs{{"dx", dx}, {"dw", dw}};
          }});
    }
  }
}

void add_elementwise_cases(std::vector<OpCase>& cases, Random& rng) {
  const std::pair<int64_t, int64_t> shapes[] = {{1, 1}, {5, 7}, {17, 96}, {3, 1031}};
  for (auto [rows, hidden] : shapes) {
    const Vec gu = rounded(rng.uniform(rows * 2 * hidden, -4, 4), DType::f32);
    const Vec dout = rounded(rng.uniform(rows * hidden), DType::f32);
    const int64_t n = rows * hidden;
    const Vec x = rounded(rng.uniform(n, -4, 4), DType::f32);
    for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
      const std::string params = fmt::format("rows={} hidden={} {}", rows, hidden, dtype_name(dt));
      cases.push_back(OpCase{"swiglu_forward", params, max_nmse(dt),
                             [=](Probe& p) {
                               auto G = p.upload("gate_up", DType::f32, gu),
                                    O = p.upload("out", dt, Vec(static_cast<size_t>(n)));
                               p.backend().swiglu_forward(G.as<float>(), dt, O.data(), rows,
                                                          hidden);
                               return Outputs{{"out", p.download(O)}};
                             },
                             [=] {
                               Vec o(static_cast<size_t>(n));
                               ref::swiglu_forward(gu, o, rows, hidden);
                               return Outputs{{"out", o}};
                             }});
      cases.push_back(OpCase{
          "swiglu_backward", params, max_nmse(dt),
          [=](Probe& p) {
            auto G = p.upload("gate_up", DType::f32, gu), D = p.upload("d_out", DType::f32, dout);
            auto DG = p.upload("d_gate_up", dt, Vec(gu.size()));
            p.backend().swiglu_backward(G.as<float>(), D.as<float>(), dt, DG.data(), rows, hidden);
            return Outputs{{"d_gate_up", p.download(DG)}};
          },
          [=] {
            Vec dg(gu.size());
            ref::swiglu_backward(gu, dout, dg, rows, hidden);
            return Outputs{{"d_gate_up", dg}};
          }});
      const std::string gparams = fmt::format("n={} {}", n, dtype_name(dt));
      cases.push_back(OpCase{"gelu_forward", gparams, max_nmse(dt),
                             [=](Probe& p) {
                               auto X = p.upload("x", DType::f32, x),
                                    Y = p.upload("y", dt, Vec(x.size()));
                               p.backend().gelu_forward(X.as<float>(), dt, Y.data(), n);
                               return Outputs{{"y", p.download(Y)}};
                             },
                             [=] {
                               Vec y(x.size());
                               ref::gelu_forward(x, y);
                               return Outputs{{"y", y}};
                             }});
      cases.push_back(
          OpCase{"gelu_backward", gparams, max_nmse(dt),
                 [=](Probe& p) {
                   auto X = p.upload("x", DType::f32, x), DY = p.upload("dy", DType::f32, dout);
                   auto DX = p.upload("dx", dt, Vec(x.size()));
                   p.backend().gelu_backward(X.as<float>(), DY.as<float>(), dt, DX.data(), n);
                   return Outputs{{"dx", p.download(DX)}};
                 },
                 [=] {
                   Vec dx(x.size());
                   ref::gelu_backward(x, dout, dx);
                   return Outputs{{"dx", dx}};
                 }});
    }
    const std::string params = fmt::format("rows={} n={}", rows, hidden);
    const Vec x0 = rounded(rng.uniform(n), DType::f32),
              bias0 = rounded(rng.uniform(hidden), DType::f32);
    cases.push_back(OpCase{"add_inplace", fmt::format("n={}", n), max_nmse(DType::f32),
                           [=](Probe& p) {
                             auto X = p.upload("x", DType::f32, x0),
                                  Y = p.upload("y", DType::f32, dout);
                             p.backend().add_inplace(X.as<float>(), Y.as<float>(), n);
                             return Outputs{{"x", p.download(X)}};
                           },
                           [=] {
                             Vec out = x0;
                             for (size_t i = 0; i < out.size(); ++i) out[i] += dout[i];
                             return Outputs{{"x", out}};
                           }});
    const Vec mask = rounded(rng.uniform(n, 0, 2), DType::f32);
    cases.push_back(OpCase{"mul_inplace", fmt::format("n={}", n), max_nmse(DType::f32),
                           [=](Probe& p) {
                             auto X = p.upload("x", DType::f32, x0),
                                  Y = p.upload("y", DType::f32, mask);
                             p.backend().mul_inplace(X.as<float>(), Y.as<float>(), n);
                             return Outputs{{"x", p.download(X)}};
                           },
                           [=] {
                             Vec out = x0;
                             for (size_t i = 0; i < out.size(); ++i) out[i] *= mask[i];
                             return Outputs{{"x", out}};
                           }});
    cases.push_back(OpCase{"add_product", fmt::format("n={}", n), max_nmse(DType::f32),
                           [=](Probe& p) {
                             auto X = p.upload("x", DType::f32, x0),
                                  A = p.upload("a", DType::f32, mask),
                                  B = p.upload("b", DType::f32, dout);
                             p.backend().add_product(X.as<float>(), A.as<float>(), B.as<float>(),
                                                     n);
                             return Outputs{{"x", p.download(X)}};
                           },
                           [=] {
                             Vec out = x0;
                             for (size_t i = 0; i < out.size(); ++i) out[i] += mask[i] * dout[i];
                             return Outputs{{"x", out}};
                           }});
    for (bool with_bias : {false, true}) {
      cases.push_back(OpCase{
          "residual_add", fmt::format("rows={} n={}{}", rows, hidden, with_bias ? " bias" : ""),
          max_nmse(DType::f32),
          [=](Probe& p) {
            auto R = p.upload("residual", DType::f32, x0), Y = p.upload("y", DType::f32, dout);
            auto B = p.upload("bias", DType::f32, bias0), O = p.upload("out", DType::f32, Vec(x0.size()));
            p.backend().residual_add(R.as<float>(), Y.as<float>(),
                                     with_bias ? B.as<float>() : nullptr, O.as<float>(), rows,
                                     hidden);
            return Outputs{{"out", p.download(O)}};
          },
          [=] {
            Vec out(x0.size());
            for (int64_t r = 0; r < rows; ++r) {
              for (int64_t j = 0; j < hidden; ++j) {
                const auto i = static_cast<size_t>(r * hidden + j);
                out[i] = x0[i] + dout[i] + (with_bias ? bias0[static_cast<size_t>(j)] : 0.0);
              }
            }
            return Outputs{{"out", out}};
          }});
    }
    // The allocator's moves: copy within the device, converting between every
    // pair of dtypes (the reference rounds once, to the destination), and zero;
    // the same conversion as the backend's convert op on raw pointers.
    for (DType from : {DType::f32, DType::bf16, DType::f16}) {
      for (DType to : {DType::f32, DType::bf16, DType::f16}) {
        const Vec src = rounded(x0, from);
        const std::string pair = fmt::format("n={} {}->{}", n, dtype_name(from), dtype_name(to));
        for (bool op : {false, true}) {
          cases.push_back(OpCase{op ? "convert" : "copy", pair, max_nmse(DType::f32),
                                 [=](Probe& p) {
                                   auto S = p.upload("src", from, src);
                                   auto D = p.upload("dst", to, Vec(src.size()));
                                   if (op) {
                                     p.backend().convert(from, S.data(), to, D.data(), n);
                                   } else {
                                     D.view().copy_from(S.view());
                                   }
                                   return Outputs{{"dst", p.download(D)}};
                                 },
                                 [=] { return Outputs{{"dst", rounded(src, to)}}; }});
        }
      }
    }
    cases.push_back(OpCase{"zero", fmt::format("n={}", n), max_nmse(DType::f32),
                           [=](Probe& p) {
                             auto X = p.upload("x", DType::bf16, x0);
                             X.view().zero();
                             return Outputs{{"x", p.download(X)}};
                           },
                           [=] { return Outputs{{"x", Vec(x0.size())}}; }});
    cases.push_back(OpCase{
        "bias_backward", params, max_nmse(DType::f32),
        [=](Probe& p) {
          auto DY = p.upload("dy", DType::f32, dout), DB = p.upload("dbias", DType::f32, bias0);
          p.backend().bias_backward(DY.as<float>(), DB.as<float>(), rows, hidden);
          return Outputs{{"dbias", p.download(DB)}};
        },
        [=] {
          Vec db = bias0;
          for (int64_t r = 0; r < rows; ++r) {
            for (int64_t j = 0; j < hidden; ++j)
              db[static_cast<size_t>(j)] += dout[static_cast<size_t>(r * hidden + j)];
          }
          return Outputs{{"dbias", db}};
        }});
  }
}

// Whole-sequence float64 attention: its output, or (backward) d_qkv from d_out.
Outputs reference_attention(ops::AttentionDims dims, const int32_t* positions,
                            const std::vector<float>& inv_freq, const Vec& qkv, const Vec& dout,
                            bool backward) {
  dims.positions = positions;
  if (!backward) {
    Vec out(dout.size());
    ref::attention_forward(dims, inv_freq, qkv, out);
    return Outputs{{"out", out}};
  }
  Vec dq(qkv.size());
  ref::attention_backward(dims, inv_freq, qkv, dout, dq);
  return Outputs{{"d_qkv", dq}};
}

void add_attention_cases(std::vector<OpCase>& cases, Random& rng) {
  struct Shape {
    int64_t batch, seq, heads, kv, dim;
    bool rope, packed, recompute;
    int64_t window = 0;  // sliding window (0: none)
  };
  const Shape shapes[] = {
      {1, 1, 1, 1, 2, true, false, false},   {2, 7, 4, 4, 8, true, false, false},
      {2, 13, 4, 2, 16, true, false, true},  {1, 33, 8, 2, 16, true, true, false},
      {3, 9, 4, 1, 8, false, false, false},  {2, 17, 6, 3, 32, true, true, true},
      {1, 64, 2, 1, 64, true, false, false},
      // Windows: shorter than a record, across key blocks (blocks of 64), with recompute.
      {2, 13, 4, 2, 16, true, false, false, 4}, {1, 33, 8, 2, 16, true, true, true, 5},
      {1, 200, 2, 1, 16, true, false, false, 70}, {2, 150, 4, 2, 8, true, true, true, 33},
  };
  for (const Shape& s : shapes) {
    ops::AttentionDims d{s.batch, s.seq, s.heads, s.kv, s.dim, nullptr, s.window};
    const Vec qkv = rounded(rng.uniform(s.batch * s.seq * d.qkv_width()), DType::f32);
    const Vec dout = rounded(rng.uniform(s.batch * s.seq * s.heads * s.dim), DType::f32);
    const auto positions = std::make_shared<std::vector<int32_t>>(
        s.packed ? packed_positions(rng, s.batch, s.seq) : std::vector<int32_t>());
    const auto inv_freq = std::make_shared<std::vector<float>>(
        s.rope ? ops::rope_inv_freq(s.dim, 10000.0f) : std::vector<float>());
    for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
      std::string params = fmt::format("b={} t={} h={} kv={} d={} {}", s.batch, s.seq, s.heads,
                                       s.kv, s.dim, dtype_name(dt));
      if (!s.rope) params += " no-rope";
      if (s.packed) params += " packed";
      if (s.recompute) params += " recompute";
      if (s.window > 0) params += fmt::format(" window={}", s.window);
      // Forward, and backward from the forward's saved state, on a backend.
      auto run = [=](Probe& p, bool backward) {
        ops::AttentionDims dims = d;
        auto Pos = p.upload_ids("positions", *positions);
        if (s.packed) dims.positions = Pos.as<int32_t>();
        ops::RopeTable table;
        if (s.rope) table = p.backend().make_rope_table(s.dim, s.seq, *inv_freq);
        auto QKV = p.upload("qkv", DType::f32, qkv);
        auto O = p.upload("out", dt, Vec(dout.size()));
        ops::AttentionSaved saved;
        saved.recompute_probs = s.recompute;
        p.backend().attention_forward(dims, s.rope ? &table : nullptr, dt, QKV.as<float>(),
                                      O.data(), saved);
        if (!backward) return Outputs{{"out", p.download(O)}};
        auto DO = p.upload("d_out", DType::f32, dout);
        auto DQKV = p.upload("d_qkv", dt, Vec(qkv.size()));
        p.backend().attention_backward(dims, s.rope ? &table : nullptr, dt, saved, DO.as<float>(),
                                       DQKV.data());
        return Outputs{{"d_qkv", p.download(DQKV)}};
      };
      auto reference = [=](bool backward) {
        return reference_attention(d, s.packed ? positions->data() : nullptr, *inv_freq, qkv,
                                   dout, backward);
      };
      // Probabilities and q, k, v held in 16 bits: looser than one rounding.
      const double tol = dt == DType::f32 ? 1e-9 : max_nmse(dt) * 4;
      cases.push_back(OpCase{"attention_forward", params, tol,
                             [=](Probe& p) { return run(p, false); },
                             [=] { return reference(false); }});
      cases.push_back(OpCase{"attention_backward", params, tol,
                             [=](Probe& p) { return run(p, true); },
                             [=] { return reference(true); }});
    }
  }
  // Decoding: a prompt, then new tokens against the cache.
  struct Decode {
    int64_t batch, prompt, fresh, heads, kv, dim;
    bool rope;
    int64_t window = 0;
  };
  for (const Decode& s : {Decode{1, 1, 1, 2, 1, 4, true}, Decode{2, 5, 3, 4, 2, 8, true},
                          Decode{2, 9, 1, 6, 3, 16, false}, Decode{2, 9, 4, 4, 2, 8, true, 3}}) {
    const int64_t total = s.prompt + s.fresh;
    ops::AttentionDims whole{s.batch, total, s.heads, s.kv, s.dim, nullptr, s.window};
    const int64_t W = whole.qkv_width();
    const Vec qkv = rounded(rng.uniform(s.batch * total * W), DType::f32);
    const auto inv_freq = std::make_shared<std::vector<float>>(
        s.rope ? ops::rope_inv_freq(s.dim, 10000.0f) : std::vector<float>());
    // Rows [t0, t0 + n) of every batch.
    auto part = [=](const Vec& v, int64_t t0, int64_t n, int64_t width) {
      Vec out;
      for (int64_t b = 0; b < s.batch; ++b) {
        out.insert(out.end(), v.begin() + (b * total + t0) * width,
                   v.begin() + (b * total + t0 + n) * width);
      }
      return out;
    };
    const std::string params =
        fmt::format("b={} prompt={} new={} h={} kv={} d={}{}{}", s.batch, s.prompt, s.fresh,
                    s.heads, s.kv, s.dim, s.rope ? "" : " no-rope",
                    s.window > 0 ? fmt::format(" window={}", s.window) : "");
    cases.push_back(OpCase{
        "attention_decode", params, max_nmse(DType::f32),
        [=](Probe& p) {
          ops::RopeTable table;
          if (s.rope) table = p.backend().make_rope_table(s.dim, total, *inv_freq);
          ops::KVCacheLayer cache;
          cache.k = p.backend().allocate({s.batch, s.kv, total, s.dim}, DType::f32,
                                         MemCategory::activations);
          cache.v = p.backend().allocate({s.batch, s.kv, total, s.dim}, DType::f32,
                                         MemCategory::activations);
          Outputs outs;
          for (auto [t0, n] : {std::pair{int64_t{0}, s.prompt}, std::pair{s.prompt, s.fresh}}) {
            ops::AttentionDims dims{s.batch, n, s.heads, s.kv, s.dim, nullptr, s.window};
            auto Q = p.upload("qkv", DType::f32, part(qkv, t0, n, W));
            auto O = p.upload("out", DType::f32,
                              Vec(static_cast<size_t>(s.batch * n * s.heads * s.dim)));
            p.backend().attention_decode(dims, s.rope ? &table : nullptr, Q.as<float>(), t0, cache,
                                         O.as<float>());
            outs.emplace_back(t0 == 0 ? "out(prompt)" : "out(new)", p.download(O));
          }
          return outs;
        },
        [=] {
          Vec out(static_cast<size_t>(s.batch * total * s.heads * s.dim));
          ref::attention_forward(whole, *inv_freq, qkv, out);
          const int64_t width = s.heads * s.dim;
          return Outputs{{"out(prompt)", part(out, 0, s.prompt, width)},
                         {"out(new)", part(out, s.prompt, s.fresh, width)}};
        }});
  }
}

// Context-parallel attention: every rank of a cp group simulated on one
// backend (the all-gather and reduce-scatter done by the probe), the ranks'
// rows put back in sequence order and compared with whole-sequence attention.
void add_context_attention_cases(std::vector<OpCase>& cases, Random& rng) {
  struct Shape {
    int64_t batch, seq, heads, kv, dim, cp;
    bool rope, packed, recompute;
  };
  const Shape shapes[] = {
      {1, 4, 1, 1, 2, 2, true, false, false},    {2, 16, 4, 2, 8, 2, true, false, false},
      {2, 24, 4, 1, 16, 3, true, true, true},    {1, 32, 6, 3, 8, 4, false, false, false},
      {2, 40, 4, 2, 16, 2, true, true, false},   {1, 256, 2, 1, 32, 4, true, false, true},
      {1, 200, 2, 1, 16, 2, true, true, false},  // the ring's row tiles: 128 + 72 rows
      // Tiles of one chunk each (chunks of 128): the ring skips a block's
      // chunks after a tile's queries.
      {1, 512, 2, 2, 16, 2, true, false, false}, {1, 512, 4, 2, 8, 2, true, true, false},
  };
  for (const Shape& s : shapes) {
    const ops::AttentionDims whole{s.batch, s.seq, s.heads, s.kv, s.dim, nullptr};
    const int64_t W = whole.qkv_width(), L = s.seq / s.cp, HD = s.heads * s.dim;
    const Vec qkv = rounded(rng.uniform(s.batch * s.seq * W), DType::f32);
    const Vec dout = rounded(rng.uniform(s.batch * s.seq * HD), DType::f32);
    std::vector<int32_t> global_pos = packed_positions(rng, s.batch, s.seq);
    if (!s.packed) {
      for (size_t i = 0; i < global_pos.size(); ++i)
        global_pos[i] = static_cast<int32_t>(static_cast<int64_t>(i) % s.seq);
    }
    const auto positions = std::make_shared<std::vector<int32_t>>(global_pos);
    const auto inv_freq = std::make_shared<std::vector<float>>(
        s.rope ? ops::rope_inv_freq(s.dim, 10000.0f) : std::vector<float>());
    // Rank r's rows of a [batch, seq, width] tensor, and back.
    auto cut = [=](const auto& v, int64_t r, int64_t width) {
      std::remove_cvref_t<decltype(v)> out(static_cast<size_t>(s.batch * L * width));
      const ContextSplit split{r, s.cp};
      for (int64_t b = 0; b < s.batch; ++b)
        for (int64_t i = 0; i < L; ++i)
          std::copy_n(v.begin() + (b * s.seq + split.global(s.seq, i)) * width, width,
                      out.begin() + (b * L + i) * width);
      return out;
    };
    auto paste = [=](Vec& v, const Vec& part, int64_t r, int64_t width) {
      const ContextSplit split{r, s.cp};
      for (int64_t b = 0; b < s.batch; ++b)
        for (int64_t i = 0; i < L; ++i)
          std::copy_n(part.begin() + (b * L + i) * width, width,
                      v.begin() + (b * s.seq + split.global(s.seq, i)) * width);
    };
    for (DType dt : {DType::f32, DType::bf16}) {
      std::string params = fmt::format("b={} t={} h={} kv={} d={} cp={} {}", s.batch, s.seq,
                                       s.heads, s.kv, s.dim, s.cp, dtype_name(dt));
      if (!s.rope) params += " no-rope";
      if (s.packed) params += " packed";
      const std::string ring_params = params;
      if (s.recompute) params += " recompute";
      // The ring: each rank's queries against every rank's block in ring
      // order (r, r - 1, ...), merged by log-sum-exp; backward block by
      // block, the blocks' k/v gradients summed over the ranks.
      auto ring = [=](Probe& p, bool backward) {
        ops::RopeTable table;
        if (s.rope) table = p.backend().make_rope_table(s.dim, s.seq, *inv_freq);
        const ops::RopeTable* rope = s.rope ? &table : nullptr;
        std::vector<ops::ContextDims> dims(static_cast<size_t>(s.cp));
        std::vector<Probe::Buffer> pos, kv, out_bufs;
        std::vector<ops::AttentionSaved> saved(static_cast<size_t>(s.cp));
        for (int64_t r = 0; r < s.cp; ++r) {
          const auto ur = static_cast<size_t>(r);
          pos.push_back(p.upload_ids("positions", cut(*positions, r, 1)));
          dims[ur] = ops::ContextDims{s.batch, L, s.heads, s.kv, s.dim, ContextSplit{r, s.cp},
                                      pos.back().as<int32_t>()};
          auto QKV = p.upload("qkv", DType::f32, cut(qkv, r, W));
          kv.push_back(p.upload("kv_block", dt, Vec(static_cast<size_t>(dims[ur].kv_block()))));
          p.backend().context_attention_project(dims[ur], rope, dt, QKV.as<float>(), saved[ur],
                                                kv.back().data());
        }
        Vec out(static_cast<size_t>(s.batch * s.seq * HD));
        for (int64_t r = 0; r < s.cp; ++r) {
          const auto ur = static_cast<size_t>(r);
          ops::RingState state;
          for (int64_t step = 0; step < s.cp; ++step) {
            const int64_t owner = (r - step + s.cp) % s.cp;
            p.backend().ring_attention_forward_block(dims[ur], dt, owner,
                                                     kv[static_cast<size_t>(owner)].data(),
                                                     saved[ur], state, step == 0);
          }
          out_bufs.push_back(p.upload("out", dt, Vec(static_cast<size_t>(s.batch * L * HD))));
          p.backend().ring_attention_forward_finish(dims[ur], dt, state, saved[ur],
                                                    out_bufs.back().data());
          paste(out, p.download(out_bufs.back()), r, HD);
        }
        if (!backward) return Outputs{{"out", out}};
        const auto block = static_cast<size_t>(dims[0].kv_block());
        std::vector<Vec> dkv(static_cast<size_t>(s.cp), Vec(block, 0.0));
        std::vector<Vec> dq(static_cast<size_t>(s.cp));
        for (int64_t r = 0; r < s.cp; ++r) {
          const auto ur = static_cast<size_t>(r);
          auto DO = p.upload("d_out", DType::f32, cut(dout, r, HD));
          auto DQ = p.upload("dq", DType::f32, Vec(static_cast<size_t>(s.batch * L * HD)));
          for (int64_t owner = 0; owner < s.cp; ++owner) {
            auto DKV = p.upload("dkv_block", DType::f32, Vec(block));
            p.backend().ring_attention_backward_block(
                dims[ur], dt, owner, kv[static_cast<size_t>(owner)].data(), saved[ur],
                DO.as<float>(), out_bufs[ur].data(), DQ.as<float>(), DKV.as<float>());
            const Vec part = p.download(DKV);
            for (size_t i = 0; i < block; ++i) dkv[static_cast<size_t>(owner)][i] += part[i];
          }
          dq[ur] = p.download(DQ);
        }
        Vec dqkv(qkv.size());
        for (int64_t r = 0; r < s.cp; ++r) {
          const auto ur = static_cast<size_t>(r);
          auto DKV = p.upload("dkv", DType::f32, dkv[ur]);
          auto DQ = p.upload("dq", DType::f32, dq[ur]);
          auto DQKV = p.upload("d_qkv", dt, Vec(static_cast<size_t>(s.batch * L * W)));
          p.backend().context_attention_finish(dims[ur], rope, dt, DKV.as<float>(),
                                               DQ.as<float>(), DQKV.data());
          paste(dqkv, p.download(DQKV), r, W);
        }
        return Outputs{{"d_qkv", dqkv}};
      };
      auto run = [=](Probe& p, bool backward) {
        ops::RopeTable table;
        if (s.rope) table = p.backend().make_rope_table(s.dim, s.seq, *inv_freq);
        const ops::RopeTable* rope = s.rope ? &table : nullptr;
        std::vector<ops::ContextDims> dims(static_cast<size_t>(s.cp));
        std::vector<Probe::Buffer> pos;
        std::vector<ops::AttentionSaved> saved(static_cast<size_t>(s.cp));
        Vec gathered;
        for (int64_t r = 0; r < s.cp; ++r) {
          const auto ur = static_cast<size_t>(r);
          pos.push_back(p.upload_ids("positions", cut(*positions, r, 1)));
          dims[ur] = ops::ContextDims{s.batch, L, s.heads, s.kv, s.dim, ContextSplit{r, s.cp},
                                      pos.back().as<int32_t>()};
          saved[ur].recompute_probs = s.recompute;
          auto QKV = p.upload("qkv", DType::f32, cut(qkv, r, W));
          auto KV = p.upload("kv_send", dt, Vec(static_cast<size_t>(dims[ur].kv_block())));
          p.backend().context_attention_project(dims[ur], rope, dt, QKV.as<float>(), saved[ur],
                                                KV.data());
          const Vec mine = p.download(KV);
          gathered.insert(gathered.end(), mine.begin(), mine.end());
        }
        auto ALL = p.upload("kv_all", dt, gathered);
        Vec out(static_cast<size_t>(s.batch * s.seq * HD)), dkv_sum(gathered.size(), 0.0);
        std::vector<Vec> dq(static_cast<size_t>(s.cp));
        for (int64_t r = 0; r < s.cp; ++r) {
          const auto ur = static_cast<size_t>(r);
          auto O = p.upload("out", dt, Vec(static_cast<size_t>(s.batch * L * HD)));
          p.backend().context_attention_forward(dims[ur], dt, ALL.data(), saved[ur], O.data());
          paste(out, p.download(O), r, HD);
          if (!backward) continue;
          auto DO = p.upload("d_out", DType::f32, cut(dout, r, HD));
          auto DQKV = p.upload("d_qkv", dt, Vec(static_cast<size_t>(s.batch * L * W)));
          auto DKV = p.upload("dkv_all", DType::f32, Vec(gathered.size()));
          p.backend().context_attention_backward(dims[ur], rope, dt, saved[ur], DO.as<float>(),
                                                 DQKV.data(), DKV.as<float>());
          const Vec part = p.download(DKV);
          for (size_t i = 0; i < part.size(); ++i) dkv_sum[i] += part[i];
          dq[ur] = p.download(DQKV);
        }
        if (!backward) return Outputs{{"out", out}};
        // The reduce-scatter's result: rank r's block of the sum, then finish.
        Vec dqkv(qkv.size());
        const int64_t block = dims[0].kv_block();
        for (int64_t r = 0; r < s.cp; ++r) {
          const auto ur = static_cast<size_t>(r);
          auto DKV = p.upload("dkv", DType::f32,
                              Vec(dkv_sum.begin() + r * block, dkv_sum.begin() + (r + 1) * block));
          auto DQKV = p.upload("d_qkv", dt, dq[ur]);
          p.backend().context_attention_finish(dims[ur], rope, dt, DKV.as<float>(), nullptr,
                                               DQKV.data());
          paste(dqkv, p.download(DQKV), r, W);
        }
        return Outputs{{"d_qkv", dqkv}};
      };
      auto reference = [=](bool backward) {
        return reference_attention(whole, s.packed ? positions->data() : nullptr, *inv_freq, qkv,
                                   dout, backward);
      };
      const double tol = dt == DType::f32 ? 1e-9 : max_nmse(dt) * 4;
      cases.push_back(OpCase{"context_attention_forward", params, tol,
                             [=](Probe& p) { return run(p, false); },
                             [=] { return reference(false); }});
      cases.push_back(OpCase{"context_attention_backward", params, tol,
                             [=](Probe& p) { return run(p, true); },
                             [=] { return reference(true); }});
      // 16-bit probabilities rounded per block, and dS from the 16-bit output.
      const double ring_tol = dt == DType::f32 ? 1e-9 : max_nmse(dt) * 8;
      cases.push_back(OpCase{"ring_attention_forward", ring_params, ring_tol,
                             [=](Probe& p) { return ring(p, false); },
                             [=] { return reference(false); }});
      cases.push_back(OpCase{"ring_attention_backward", ring_params, ring_tol,
                             [=](Probe& p) { return ring(p, true); },
                             [=] { return reference(true); }});
    }
  }
}

// Ulysses' layouts: rows <-> head groups, and the cp ranks' tokens <->
// the sequence (data movement: exact), each way and back.
void add_ulysses_layout_cases(std::vector<OpCase>& cases, Random& rng) {
  struct Groups {
    int64_t rows, groups;
    std::vector<int64_t> parts;
  };
  for (const Groups& g : {Groups{3, 2, {8, 4, 4}}, Groups{5, 4, {16, 8, 8}}, Groups{7, 2, {6}}}) {
    const ops::HeadGroups hg{g.rows, g.groups, g.parts};
    const int64_t width = hg.width(), slice = width / g.groups;
    for (DType dt : {DType::f32, DType::bf16}) {
      const Vec x = rounded(rng.uniform(g.rows * width), dt);
      const std::string params = fmt::format("rows={} groups={} parts={} {}", g.rows, g.groups,
                                             g.parts.size(), dtype_name(dt));
      cases.push_back(OpCase{
          "head_groups", params, max_nmse(DType::f32),
          [=](Probe& p) {
            auto X = p.upload("rows", dt, x), G = p.upload("groups", dt, Vec(x.size()));
            auto Back = p.upload("back", dt, Vec(x.size()));
            p.backend().head_groups(hg, dt, X.data(), G.data(), true);
            p.backend().head_groups(hg, dt, Back.data(), G.data(), false);
            return Outputs{{"groups", p.download(G)}, {"back", p.download(Back)}};
          },
          [=] {
            Vec grouped(x.size());
            for (int64_t k = 0; k < g.groups; ++k) {
              for (int64_t r = 0; r < g.rows; ++r) {
                int64_t at = 0, offset = 0;
                for (int64_t part : g.parts) {
                  const int64_t w = part / g.groups;
                  for (int64_t c = 0; c < w; ++c) {
                    grouped[static_cast<size_t>((k * g.rows + r) * slice + at + c)] =
                        x[static_cast<size_t>(r * width + offset + k * w + c)];
                  }
                  at += w;
                  offset += part;
                }
              }
            }
            return Outputs{{"groups", grouped}, {"back", x}};
          }});
    }
  }
  struct Sequence {
    int64_t batch, seq, cp, width;
  };
  for (const Sequence& q : {Sequence{1, 8, 2, 3}, Sequence{2, 24, 3, 5}, Sequence{2, 32, 4, 1}}) {
    const int64_t L = q.seq / q.cp;
    const Vec by_rank = rounded(rng.uniform(q.cp * q.batch * L * q.width), DType::f32);
    const std::string params =
        fmt::format("b={} t={} cp={} width={}", q.batch, q.seq, q.cp, q.width);
    cases.push_back(OpCase{
        "context_sequence", params, max_nmse(DType::f32),
        [=](Probe& p) {
          const ops::ContextDims d{q.batch, L, 1, 1, 2, ContextSplit{0, q.cp}};
          auto R = p.upload("by_rank", DType::f32, by_rank);
          auto S = p.upload("sequence", DType::f32, Vec(by_rank.size()));
          auto Back = p.upload("back", DType::f32, Vec(by_rank.size()));
          p.backend().context_sequence(d, q.width, DType::f32, R.data(), S.data(), true);
          p.backend().context_sequence(d, q.width, DType::f32, Back.data(), S.data(), false);
          return Outputs{{"sequence", p.download(S)}, {"back", p.download(Back)}};
        },
        [=] {
          Vec seq(by_rank.size());
          for (int64_t r = 0; r < q.cp; ++r) {
            const ContextSplit split{r, q.cp};
            for (int64_t b = 0; b < q.batch; ++b) {
              for (int64_t i = 0; i < L; ++i) {
                for (int64_t c = 0; c < q.width; ++c) {
                  seq[static_cast<size_t>((b * q.seq + split.global(q.seq, i)) * q.width + c)] =
                      by_rank[static_cast<size_t>(((r * q.batch + b) * L + i) * q.width + c)];
                }
              }
            }
          }
          return Outputs{{"sequence", seq}, {"back", by_rank}};
        }});
  }
}

void add_embedding_cases(std::vector<OpCase>& cases, Random& rng) {
  struct Shape {
    int64_t vocab, batch, seq, dim, pos0;
    bool positions, pos_ids;
    int64_t vocab_begin, vocab_end;  // the table's slice (a tensor-parallel rank's)
    DType table_dtype;               // the forward's table (a frozen bf16 / f16 embedding)
  };
  for (const Shape& s : {Shape{1, 1, 1, 1, 0, false, false, 0, 1, DType::f32},
                         Shape{50, 3, 7, 13, 0, false, false, 0, 50, DType::bf16},
                         Shape{37, 2, 9, 16, 4, true, false, 10, 30, DType::f32},
                         Shape{64, 2, 8, 16, 0, true, false, 16, 48, DType::bf16},
                         Shape{300, 2, 33, 64, 0, true, true, 0, 300, DType::f16}}) {
    const int64_t max_pos = s.pos0 + s.seq, slice = s.vocab_end - s.vocab_begin;
    const Vec table = rounded(rng.uniform(slice * s.dim), s.table_dtype);
    const Vec pos = rounded(rng.uniform(max_pos * s.dim), DType::f32);
    const auto ids = std::make_shared<std::vector<int32_t>>(
        rng.ints(s.batch * s.seq, 0, static_cast<int32_t>(s.vocab - 1)));
    const auto pos_ids = std::make_shared<std::vector<int32_t>>(
        s.pos_ids ? packed_positions(rng, s.batch, s.seq) : std::vector<int32_t>());
    const Vec dout = rounded(rng.uniform(s.batch * s.seq * s.dim), DType::f32);
    const Vec dtable0 = rounded(rng.uniform(slice * s.dim), DType::f32),
              dpos0 = rounded(rng.uniform(max_pos * s.dim), DType::f32);
    // The dims, with the positions of packed records where the caller keeps them.
    auto dims = [s](const int32_t* packed) {
      return ops::EmbeddingDims{.batch = s.batch, .seq = s.seq, .dim = s.dim, .pos0 = s.pos0,
                                .pos_ids = s.pos_ids ? packed : nullptr,
                                .vocab_begin = s.vocab_begin, .vocab_end = s.vocab_end};
    };
    std::string params = fmt::format("vocab={} b={} t={} d={} slice=[{},{})", s.vocab, s.batch,
                                     s.seq, s.dim, s.vocab_begin, s.vocab_end);
    if (s.positions) params += fmt::format(" positions pos0={}", s.pos0);
    if (s.pos_ids) params += " packed";
    cases.push_back(OpCase{
        "embedding_forward", params + fmt::format(" table {}", dtype_name(s.table_dtype)),
        max_nmse(DType::f32),
        [=](Probe& p) {
          auto T = p.upload("table", s.table_dtype, table),
               P = p.upload("positions", DType::f32, pos);
          auto I = p.upload_ids("ids", *ids), PI = p.upload_ids("pos_ids", *pos_ids);
          auto O = p.upload("out", DType::f32, Vec(dout.size()));
          p.backend().embedding_forward(dims(PI.as<int32_t>()), T.data(), s.table_dtype,
                                        s.positions ? P.as<float>() : nullptr, I.as<int32_t>(),
                                        O.as<float>());
          return Outputs{{"out", p.download(O)}};
        },
        [=] {
          Vec out(dout.size());
          ref::embedding_forward(dims(pos_ids->data()), table, s.positions ? &pos : nullptr, *ids,
                                 out);
          return Outputs{{"out", out}};
        }});
    cases.push_back(OpCase{
        "embedding_backward", params, max_nmse(DType::f32),
        [=](Probe& p) {
          auto I = p.upload_ids("ids", *ids), PI = p.upload_ids("pos_ids", *pos_ids);
          auto DO = p.upload("dout", DType::f32, dout),
               DT = p.upload("dtable", DType::f32, dtable0);
          auto DP = p.upload("dpositions", DType::f32, dpos0);
          p.backend().embedding_backward(dims(PI.as<int32_t>()), I.as<int32_t>(), DO.as<float>(),
                                         DT.as<float>(), s.positions ? DP.as<float>() : nullptr);
          return Outputs{{"dtable", p.download(DT)}, {"dpositions", p.download(DP)}};
        },
        [=] {
          Vec dt = dtable0, dp = dpos0;
          ref::embedding_backward(dims(pos_ids->data()), *ids, dout, dt,
                                  s.positions ? &dp : nullptr);
          return Outputs{{"dtable", dt}, {"dpositions", dp}};
        }});
  }
}

void add_classifier_cases(std::vector<OpCase>& cases, Random& rng) {
  struct Shape {
    int64_t rows, dim, vocab, valid, chunk;
  };
  for (const Shape& s : {Shape{1, 1, 2, 2, 0}, Shape{7, 16, 50, 50, 3}, Shape{33, 24, 97, 90, 0},
                         Shape{64, 32, 300, 300, 16}}) {
    const auto targets = std::make_shared<std::vector<int32_t>>(
        rng.ints(s.rows, -1, static_cast<int32_t>(s.valid - 1)));
    // Per-row weights (preference losses): any sign, some zero.
    std::vector<float> weights;
    for (double x : rng.uniform(s.rows, -2, 2)) {
      weights.push_back(x < -1.5 ? 0.0f : static_cast<float>(x));
    }
    // sliced: the vocabulary-parallel path (per-row statistics combined by
    // the callbacks between passes) over one slice, whose combine is the identity.
    struct Variant {
      DType dt;
      bool weighted, sliced;
    };
    for (const auto [dt, weighted, sliced] :
         {Variant{DType::f32, false, false}, Variant{DType::bf16, false, false},
          Variant{DType::f16, false, false}, Variant{DType::f32, true, false},
          Variant{DType::bf16, true, false}, Variant{DType::f32, false, true},
          Variant{DType::bf16, true, true}}) {
      if (weighted && s.rows < 7) continue;
      const Vec h = rounded(rng.uniform(s.rows * s.dim, -2, 2), dt),
                w = rounded(rng.uniform(s.vocab * s.dim), dt);
      const Vec dw0 = rounded(rng.uniform(s.vocab * s.dim), DType::f32);
      const double scale = 1.0 / static_cast<double>(s.rows);
      const std::vector<float> row_weights = weighted ? weights : std::vector<float>{};
      std::string params =
          fmt::format("rows={} dim={} vocab={} {}", s.rows, s.dim, s.vocab, dtype_name(dt));
      if (s.valid < s.vocab) params += fmt::format(" padding={}", s.vocab - s.valid);
      if (s.chunk) params += fmt::format(" chunk={}", s.chunk);
      if (weighted) params += " row_weights";
      if (sliced) params += " one_vocab_slice";
      cases.push_back(
          OpCase{"fused_classifier", params, max_nmse(dt),
                 [=](Probe& p) {
                   auto H = p.upload("h", dt, h), Wt = p.upload("w", dt, w),
                        T = p.upload_ids("targets", *targets);
                   auto DH = p.upload("dh", DType::f32, Vec(h.size())),
                        DW = p.upload("dw", DType::f32, dw0);
                   auto L = p.upload("row_losses", DType::f32, Vec(static_cast<size_t>(s.rows)));
                   ops::ClassifierArgs a;
                   a.rows = s.rows, a.dim = s.dim, a.vocab = s.vocab, a.compute = dt;
                   a.h = H.data(), a.w = Wt.data(), a.targets = T.as<int32_t>();
                   a.grad_scale = static_cast<float>(scale);
                   a.dh = DH.as<float>(), a.dw = DW.as<float>(), a.row_losses = L.as<float>();
                   a.chunk_rows = s.chunk, a.vocab_valid = s.valid;
                   auto RW = p.upload("row_weights", DType::f32,
                                      Vec(row_weights.begin(), row_weights.end()));
                   if (weighted) a.row_weights = RW.as<float>();
                   if (sliced) {
                     a.vocab_total = s.vocab;
                     a.reduce_max = [](float*, int64_t) {};
                     a.reduce_sum = [](float*, int64_t) {};
                   }
                   const double loss = p.backend().fused_classifier(a);
                   return Outputs{{"loss", {loss}},
                                  {"row_losses", p.download(L)},
                                  {"dh", p.download(DH)},
                                  {"dw", p.download(DW)}};
                 },
                 [=] {
                   Vec dh(h.size()), dw = dw0, losses(static_cast<size_t>(s.rows));
                   const double loss =
                       ref::fused_classifier(h, w, *targets, s.rows, s.dim, s.vocab, s.valid,
                                             scale, &dh, &dw, &losses, row_weights);
                   return Outputs{{"loss", {loss}}, {"row_losses", losses}, {"dh", dh}, {"dw", dw}};
                 }});
    }
  }
}

void add_optimizer_cases(std::vector<OpCase>& cases, Random& rng) {
  for (int64_t n : {int64_t{1}, int64_t{17}, int64_t{10007}}) {
    const Vec param = rounded(rng.uniform(n), DType::f32),
              grad = rounded(rng.uniform(n, -0.1, 0.1), DType::f32);
    const Vec m = rounded(rng.uniform(n, -0.01, 0.01), DType::f32),
              v = rounded(rng.uniform(n, 0, 1e-4), DType::f32);
    ops::AdamWHyper hyper;
    hyper.lr = 3e-3f, hyper.weight_decay = 0.1f, hyper.step = 7, hyper.grad_scale = 0.5f;
    for (DType copy : {DType::f32, DType::bf16, DType::f16}) {
      for (const bool clear : {false, true}) {
        hyper.clear_grad = clear;
        const std::string params =
            fmt::format("n={} compute={}{}", n, dtype_name(copy), clear ? " clear_grad" : "");
        cases.push_back(OpCase{
            "adamw_update", params, max_nmse(copy),
            [=](Probe& p) {
              auto P = p.upload("param", DType::f32, param), G = p.upload("grad", DType::f32, grad);
              auto M = p.upload("m", DType::f32, m), V = p.upload("v", DType::f32, v);
              auto C = p.upload("compute", copy, Vec(static_cast<size_t>(n)));
              p.backend().adamw_update(hyper, P.as<float>(), G.as<float>(), M.as<float>(),
                                       V.as<float>(), ops::ComputeCopy(C.data(), copy), n);
              Outputs out{{"param", p.download(P)}, {"m", p.download(M)}, {"v", p.download(V)},
                          {"grad", p.download(G)}};
              if (copy != DType::f32) out.emplace_back("compute", p.download(C));
              return out;
            },
            [=] {
              Vec pp = param, gg = grad, mm = m, vv = v;
              ref::adamw_update(hyper, pp, gg, mm, vv);
              Outputs out{{"param", pp}, {"m", mm}, {"v", vv}, {"grad", gg}};
              if (copy != DType::f32) out.emplace_back("compute", pp);
              return out;
            }});
      }
    }
    cases.push_back(OpCase{"sum_squares", fmt::format("n={}", n), max_nmse(DType::f32),
                           [=](Probe& p) {
                             auto X = p.upload("x", DType::f32, grad);
                             return Outputs{{"sum", {p.backend().sum_squares(X.as<float>(), n)}}};
                           },
                           [=] {
                             double s = 0;
                             for (double x : grad) s += x * x;
                             return Outputs{{"sum", {s}}};
                           }});
  }
}

// dequantize_nf4 of one packed buffer (n elements in `form`) to every compute dtype.
void add_dequantize_cases(std::vector<OpCase>& cases, const std::string& what, int64_t n,
                          const std::vector<uint8_t>& packed, nf4::Form form) {
  std::vector<int32_t> words(packed.size() / 4);
  std::memcpy(words.data(), packed.data(), packed.size());
  for (DType to : {DType::f32, DType::bf16, DType::f16}) {
    cases.push_back(OpCase{"dequantize_nf4", fmt::format("n={}{} to={}", n, what, dtype_name(to)),
                           max_nmse(to),
                           [=](Probe& p) {
                             auto P = p.upload_ids("packed", words);
                             auto Y = p.upload("y", to, Vec(static_cast<size_t>(n)));
                             p.backend().dequantize_nf4(P.data(), n, to, Y.data(), form);
                             return Outputs{{"y", p.download(Y)}};
                           },
                           [=] {
                             Vec y;
                             ref::dequantize_nf4(packed, n, y, form);
                             return Outputs{{"y", y}};
                           }});
  }
}

// NF4 dequantisation (QLoRA's frozen base weights) to every compute dtype:
// one block, a few, a second group of one block (64 * 257) and 5 groups, whole
// and as a slice of every other block. The
// packed buffer comes from nf4::quantize on the host (weights around 0.02 with
// one outlier per tensor); its bytes, a multiple of 4, go up as i32 elements.
void add_quant_cases(std::vector<OpCase>& cases, Random& rng) {
  for (int64_t n : {int64_t{64}, int64_t{64 * 3}, int64_t{64 * 257}, int64_t{64 * 1031}}) {
    const Vec x = rounded(rng.uniform(n, -0.05, 0.05), DType::f32);
    std::vector<float> host(x.begin(), x.end());
    host[static_cast<size_t>(n / 3)] = 0.75f;
    std::vector<uint8_t> packed(static_cast<size_t>(nf4::layout(n).bytes));
    nf4::quantize(host, packed);
    add_dequantize_cases(cases, "", n, packed, nf4::Form::whole);
    // A tp rank's slice: every other block, backwards (any order is a slice).
    std::vector<int64_t> blocks;
    for (int64_t b = n / nf4::kBlock - 1; b >= 0; b -= 2) blocks.push_back(b);
    std::vector<uint8_t> sliced(
        static_cast<size_t>(nf4::layout(nf4::kBlock * static_cast<int64_t>(blocks.size()),
                                        nf4::Form::slice).bytes));
    nf4::slice(packed, n, blocks, sliced);
    add_dequantize_cases(cases, " slice", nf4::kBlock * static_cast<int64_t>(blocks.size()), sliced,
                         nf4::Form::slice);
  }
}

// Every router variant (ops::RouterDims): softmax with and without
// renormalisation, top_k = experts, one expert, DeepSeek-V3's sigmoid with a
// selection bias, groups and scaling, and exact ties (logits from two values).
void add_router_cases(std::vector<OpCase>& cases, Random& rng) {
  struct Variant {
    int64_t tokens, experts, top_k;
    ops::RouterScore score;
    bool renormalize, bias, ties;
    float scaling;
    int64_t n_groups, topk_groups;
  };
  using ops::RouterScore;
  const Variant variants[] = {
      {7, 8, 2, RouterScore::softmax, true, false, false, 1, 1, 1},     // Mixtral
      {33, 60, 4, RouterScore::softmax, false, false, false, 1, 1, 1},  // Qwen2-MoE
      {5, 8, 8, RouterScore::softmax, false, false, false, 1, 1, 1},    // top_k = experts
      {3, 1, 1, RouterScore::softmax, true, false, false, 1, 1, 1},     // one expert
      {17, 16, 4, RouterScore::sigmoid, true, true, false, 2.5f, 4, 2},  // DeepSeek-V3
      {9, 12, 3, RouterScore::sigmoid, false, true, false, 1, 6, 3},    // groups of 2
      {11, 8, 3, RouterScore::softmax, true, false, true, 1, 1, 1},     // exact ties
      {11, 16, 4, RouterScore::sigmoid, true, false, true, 1, 4, 2},    // tied groups
  };
  for (const Variant& v : variants) {
    ops::RouterDims dims{.tokens = v.tokens, .experts = v.experts, .top_k = v.top_k,
                         .score = v.score, .renormalize = v.renormalize, .scaling = v.scaling,
                         .n_groups = v.n_groups, .topk_groups = v.topk_groups};
    const int64_t n = v.tokens * v.experts, nk = v.tokens * v.top_k;
    Vec logits = rng.uniform(n, -3, 3);
    if (v.ties) {
      for (double& x : logits) x = x < 0 ? -1.0 : 0.5;
    }
    logits = rounded(logits, DType::f32);
    const Vec bias = rounded(rng.uniform(v.experts, -0.2, 0.2), DType::f32);
    const std::vector<float> host_bias(bias.begin(), bias.end());
    const Vec dw = rounded(rng.uniform(nk), DType::f32);
    const std::string params = fmt::format(
        "tokens={} experts={} k={} {}{}{}{}", v.tokens, v.experts, v.top_k,
        v.score == RouterScore::softmax ? "softmax" : "sigmoid", v.renormalize ? " renorm" : "",
        v.bias ? " bias" : "",
        v.n_groups > 1 ? fmt::format(" groups={}/{}", v.topk_groups, v.n_groups) : "");
    // The reference's forward, which the backward cases start from.
    auto forward = [=] {
      ops::RouterDims r = dims;
      r.bias = v.bias ? host_bias.data() : nullptr;
      Vec probs, weights, lse;
      std::vector<int32_t> indices;
      ref::router_forward(r, logits, probs, indices, weights, lse);
      return std::make_tuple(probs, indices, weights, lse);
    };
    cases.push_back(OpCase{
        "router_forward", params, max_nmse(DType::f32),
        [=](Probe& p) {
          auto L = p.upload("logits", DType::f32, logits), B = p.upload("bias", DType::f32, bias);
          auto P = p.upload("probs", DType::f32, Vec(logits.size()));
          auto I = p.upload_ids("indices", std::vector<int32_t>(static_cast<size_t>(nk)));
          auto W = p.upload("weights", DType::f32, Vec(static_cast<size_t>(nk)));
          auto S = p.upload("lse", DType::f32, Vec(static_cast<size_t>(v.tokens)));
          ops::RouterDims d = dims;
          d.bias = v.bias ? B.as<float>() : nullptr;
          p.backend().router_forward(d, L.as<float>(), P.as<float>(), I.as<int32_t>(),
                                     W.as<float>(), S.as<float>());
          return Outputs{{"probs", p.download(P)}, {"indices", p.download(I)},
                         {"weights", p.download(W)}, {"lse", p.download(S)}};
        },
        [=] {
          auto [probs, indices, weights, lse] = forward();
          return Outputs{{"probs", probs}, {"indices", Vec(indices.begin(), indices.end())},
                         {"weights", weights}, {"lse", lse}};
        }});
    // Without and with the auxiliary losses' terms (a per-expert score
    // gradient, as the load-balancing loss gives, and the z-loss's).
    const Vec score_grad = rounded(rng.uniform(v.experts), DType::f32);
    const double z = 0.37;
    for (const bool aux : {false, true}) {
      cases.push_back(OpCase{
          "router_backward", params + (aux ? " +aux" : ""), max_nmse(DType::f32),
          [=](Probe& p) {
            const auto fw = forward();
            auto P = p.upload("probs", DType::f32, rounded(std::get<0>(fw), DType::f32));
            auto I = p.upload_ids("indices", std::get<1>(fw));
            auto S = p.upload("lse", DType::f32, rounded(std::get<3>(fw), DType::f32));
            auto G = p.upload("score_grad", DType::f32, score_grad);
            auto DW = p.upload("d_weights", DType::f32, dw);
            auto DL = p.upload("d_logits", DType::f32, Vec(logits.size()));
            const ops::RouterAuxGrad extra =
                aux ? ops::RouterAuxGrad{G.as<float>(), S.as<float>(), static_cast<float>(z)}
                    : ops::RouterAuxGrad{};
            p.backend().router_backward(dims, P.as<float>(), I.as<int32_t>(), DW.as<float>(),
                                        extra, DL.as<float>());
            return Outputs{{"d_logits", p.download(DL)}};
          },
          [=] {
            const auto fw = forward();
            Vec dl;
            ref::router_backward(dims, rounded(std::get<0>(fw), DType::f32), std::get<1>(fw), dw,
                                 aux ? score_grad : Vec{}, logits, aux ? z : 0.0, dl);
            return Outputs{{"d_logits", dl}};
          }});
    }
  }
}

// The backend's moe_sort of `indices`: its slots, rows and counts buffers.
struct SortBuffers {
  Probe::Buffer slots, rows, counts;
};
SortBuffers run_moe_sort(Probe& p, const ops::DispatchDims& dims,
                         const std::vector<int32_t>& indices) {
  auto I = p.upload_ids("indices", indices);
  SortBuffers b{p.upload_ids("slots", std::vector<int32_t>(indices.size())),
                p.upload_ids("rows", std::vector<int32_t>(indices.size())),
                p.upload_ids("counts", std::vector<int32_t>(static_cast<size_t>(dims.experts)))};
  p.backend().moe_sort(dims, I.as<int32_t>(), b.slots.as<int32_t>(), b.rows.as<int32_t>(),
                       b.counts.as<int32_t>());
  return b;
}

// Dispatch and combine over router-like choices (top_k distinct experts per
// token), experts left empty included, and dispatch then combine with weights
// 1/top_k giving the input back.
void add_dispatch_cases(std::vector<OpCase>& cases, Random& rng) {
  const ops::DispatchDims shapes[] = {{.tokens = 1, .top_k = 1, .experts = 1, .dim = 1},
                                      {.tokens = 7, .top_k = 2, .experts = 8, .dim = 5},
                                      {.tokens = 33, .top_k = 4, .experts = 60, .dim = 17},
                                      {.tokens = 5, .top_k = 3, .experts = 16, .dim = 64}};
  for (const ops::DispatchDims& dims : shapes) {
    std::vector<int32_t> indices = rng.ints(dims.slots(), 0, static_cast<int32_t>(dims.experts - 1));
    for (int64_t t = 0; t < dims.tokens; ++t) {  // distinct within a token, as a router chooses
      for (int64_t j = 0; j < dims.top_k; ++j) {
        int32_t& e = indices[t * dims.top_k + j];
        while (std::find(&indices[t * dims.top_k], &e, e) != &e) {
          e = static_cast<int32_t>((e + 1) % dims.experts);
        }
      }
    }
    const int64_t n = dims.slots(), tokens = dims.tokens * dims.dim, rows = n * dims.dim;
    const Vec x = rounded(rng.uniform(tokens), DType::f32), y = rounded(rng.uniform(rows), DType::f32);
    const Vec dout = rounded(rng.uniform(tokens), DType::f32), drows = rounded(rng.uniform(rows), DType::f32);
    Vec weights = rounded(rng.uniform(n, 0, 1), DType::f32);
    weights[0] = weights[n - 1];  // a tie for the capacity's ranking
    auto as_vec = [](const std::vector<int32_t>& v) { return Vec(v.begin(), v.end()); };
    // Dropless, then with a capacity of a mean expert's load (some experts over it).
    for (const int64_t capacity : {int64_t{0}, std::max<int64_t>(1, n / dims.experts)}) {
      ref::Dispatch order = ref::moe_sort(dims, indices);
      const std::string params = fmt::format("tokens={} k={} experts={} dim={}{}", dims.tokens,
                                             dims.top_k, dims.experts, dims.dim,
                                             capacity > 0 ? fmt::format(" capacity={}", capacity) : "");
      if (capacity > 0) {
        const ref::Dispatch sorted = order;
        ref::moe_capacity(dims, capacity, weights, order);
        cases.push_back(OpCase{"moe_capacity", params, max_nmse(DType::f32),
                               [=](Probe& p) {
                                 const SortBuffers b = run_moe_sort(p, dims, indices);
                                 auto W = p.upload("weights", DType::f32, weights);
                                 auto K = p.upload_ids("kept", std::vector<int32_t>(sorted.counts.size()));
                                 p.backend().moe_capacity(dims, capacity, W.as<float>(),
                                                          b.counts.as<int32_t>(), b.slots.as<int32_t>(),
                                                          b.rows.as<int32_t>(), K.as<int32_t>());
                                 return Outputs{{"slots", p.download(b.slots)},
                                                {"rows", p.download(b.rows)},
                                                {"kept", p.download(K)}};
                               },
                               [=] {
                                 return Outputs{{"slots", as_vec(order.slots)},
                                                {"rows", as_vec(order.rows)},
                                                {"kept", as_vec(order.kept)}};
                               }});
      } else {
      cases.push_back(OpCase{"moe_sort", params, max_nmse(DType::f32),
                             [=](Probe& p) {
                               const SortBuffers b = run_moe_sort(p, dims, indices);
                               return Outputs{{"slots", p.download(b.slots)},
                                              {"rows", p.download(b.rows)},
                                              {"counts", p.download(b.counts)}};
                             },
                             [=] {
                               return Outputs{{"slots", as_vec(order.slots)},
                                              {"rows", as_vec(order.rows)},
                                              {"counts", as_vec(order.counts)}};
                             }});
      }
      for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
        cases.push_back(OpCase{
            "moe_permute", params + " " + std::string(dtype_name(dt)), max_nmse(dt),
            [=](Probe& p) {
              auto S = p.upload_ids("slots", order.slots);
              auto X = p.upload("x", DType::f32, x), O = p.upload("out", dt, Vec(y.size()));
              p.backend().moe_permute(dims, S.as<int32_t>(), X.as<float>(), dt, O.data());
              return Outputs{{"out", p.download(O)}};
            },
            [=] {
              Vec out;
              ref::moe_permute(dims, order, x, out);
              return Outputs{{"out", out}};
            }});
      }
      cases.push_back(OpCase{"moe_permute_backward", params, max_nmse(DType::f32),
                             [=](Probe& p) {
                               auto R = p.upload_ids("rows", order.rows);
                               auto D = p.upload("d_out", DType::f32, drows),
                                    DX = p.upload("dx", DType::f32, Vec(x.size()));
                               p.backend().moe_permute_backward(dims, R.as<int32_t>(), D.as<float>(),
                                                                DX.as<float>());
                               return Outputs{{"dx", p.download(DX)}};
                             },
                             [=] {
                               Vec dx;
                               ref::moe_permute_backward(dims, order, drows, dx);
                               return Outputs{{"dx", dx}};
                             }});
      cases.push_back(OpCase{"moe_combine", params, max_nmse(DType::f32),
                             [=](Probe& p) {
                               auto R = p.upload_ids("rows", order.rows);
                               auto W = p.upload("weights", DType::f32, weights),
                                    Y = p.upload("y", DType::f32, y),
                                    O = p.upload("out", DType::f32, Vec(x.size()));
                               p.backend().moe_combine(dims, R.as<int32_t>(), W.as<float>(),
                                                       Y.as<float>(), O.as<float>());
                               return Outputs{{"out", p.download(O)}};
                             },
                             [=] {
                               Vec out;
                               ref::moe_combine(dims, order, weights, y, out);
                               return Outputs{{"out", out}};
                             }});
      for (DType dt : {DType::f32, DType::bf16}) {
        cases.push_back(OpCase{
            "moe_combine_backward", params + " " + std::string(dtype_name(dt)), max_nmse(dt),
            [=](Probe& p) {
              auto R = p.upload_ids("rows", order.rows);
              auto W = p.upload("weights", DType::f32, weights), Y = p.upload("y", DType::f32, y);
              auto D = p.upload("d_out", DType::f32, dout);
              auto DY = p.upload("d_y", dt, Vec(y.size()));
              auto DW = p.upload("d_weights", DType::f32, Vec(weights.size()));
              p.backend().moe_combine_backward(dims, R.as<int32_t>(), W.as<float>(), Y.as<float>(),
                                               D.as<float>(), dt, DY.data(), DW.as<float>());
              return Outputs{{"d_y", p.download(DY)}, {"d_weights", p.download(DW)}};
            },
            [=] {
              Vec dy, dw;
              ref::moe_combine_backward(dims, order, weights, y, dout, dy, dw);
              return Outputs{{"d_y", dy}, {"d_weights", dw}};
            }});
      }
      if (capacity > 0) continue;
      // Dispatch, then combine with weights 1/top_k: the input again.
      const Vec mean(static_cast<size_t>(n), 1.0 / static_cast<double>(dims.top_k));
      cases.push_back(OpCase{"moe_dispatch_combine", params + " identity", max_nmse(DType::f32),
                             [=](Probe& p) {
                               const SortBuffers b = run_moe_sort(p, dims, indices);
                               auto X = p.upload("x", DType::f32, x),
                                    P = p.upload("permuted", DType::f32, Vec(y.size())),
                                    W = p.upload("weights", DType::f32, mean),
                                    O = p.upload("out", DType::f32, Vec(x.size()));
                               p.backend().moe_permute(dims, b.slots.as<int32_t>(), X.as<float>(),
                                                       DType::f32, P.data());
                               p.backend().moe_combine(dims, b.rows.as<int32_t>(), W.as<float>(),
                                                       P.as<float>(), O.as<float>());
                               return Outputs{{"out", p.download(O)}};
                             },
                             [=] { return Outputs{{"out", x}}; }});
    }
  }
}

std::vector<OpCase> all_cases(uint32_t seed) {
  Random rng(seed);
  std::vector<OpCase> cases;
  add_matmul_cases(cases, rng);
  add_grouped_matmul_cases(cases, rng);
  add_norm_cases(cases, rng);
  add_group_norm_cases(cases, rng);
  add_elementwise_cases(cases, rng);
  add_attention_cases(cases, rng);
  add_context_attention_cases(cases, rng);
  add_ulysses_layout_cases(cases, rng);
  add_embedding_cases(cases, rng);
  add_classifier_cases(cases, rng);
  add_optimizer_cases(cases, rng);
  add_router_cases(cases, rng);
  add_dispatch_cases(cases, rng);
  add_quant_cases(cases, rng);  // last: the cases above keep their inputs
  // One block per op, in the order the ops first appear.
  std::vector<std::string> order;
  for (const OpCase& c : cases) {
    if (std::find(order.begin(), order.end(), c.op) == order.end()) order.push_back(c.op);
  }
  auto rank = [&](const OpCase& c) {
    return std::find(order.begin(), order.end(), c.op) - order.begin();
  };
  std::stable_sort(cases.begin(), cases.end(),
                   [&](const OpCase& a, const OpCase& b) { return rank(a) < rank(b); });
  return cases;
}

// Normalised mean squared error of `got` against `want`, and whether `got`
// is finite wherever `want` is.
struct Comparison {
  double nmse = 0;
  bool finite = true;
};

Comparison compare(const Vec& got, const Vec& want) {
  Comparison c;
  double err = 0, norm = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::isfinite(want[i]) && !std::isfinite(got[i])) c.finite = false;
    err += (got[i] - want[i]) * (got[i] - want[i]);
    norm += want[i] * want[i];
  }
  c.nmse = norm > 0 ? err / norm : err;
  return c;
}

}  // namespace

std::vector<std::string> ops_test_names() {
  std::vector<std::string> names;
  for (const OpCase& c : all_cases(1)) {
    if (std::find(names.begin(), names.end(), c.op) == names.end()) names.push_back(c.op);
  }
  return names;
}

OpsTestResult run_ops_test(Backend& backend, Backend* reference, const OpsTestOptions& options,
                           std::FILE* out) {
  const std::regex filter(options.op_regex);
  OpsTestResult result;
  std::string op_shown;
  int op_passed = 0, op_total = 0;
  auto op_line = [&] {
    if (!op_shown.empty() && !options.verbose) {
      std::fprintf(out, "%-20s %d/%d cases passed\n", op_shown.c_str(), op_passed, op_total);
    }
  };
  for (const OpCase& c : all_cases(options.seed)) {
    if (!options.op_regex.empty() && !std::regex_search(c.op, filter)) continue;
    if (c.op != op_shown) {
      op_line();
      op_shown = c.op, op_passed = 0, op_total = 0;
    }
    ++op_total;
    Probe probe(backend);
    std::vector<std::string>& problems = probe.problems();
    Outputs got, want;
    try {
      got = c.run(probe);
      if (reference != nullptr) {
        Probe ref_probe(*reference);
        want = c.run(ref_probe);
      } else {
        want = c.reference();
      }
    } catch (const std::exception& e) {
      problems.push_back(fmt::format("threw: {}", e.what()));
    }
    double worst = 0;
    for (size_t i = 0; i < got.size() && i < want.size(); ++i) {
      const Comparison cmp = compare(got[i].second, want[i].second);
      worst = std::max(worst, cmp.nmse);
      if (!cmp.finite) problems.push_back(got[i].first + ": not finite where the reference is");
      if (!(cmp.nmse <= c.max_nmse)) {
        problems.push_back(
            fmt::format("{}: nmse {:.2e} > {:.0e}", got[i].first, cmp.nmse, c.max_nmse));
      }
    }
    const bool ok = problems.empty();
    if (ok) {
      ++result.passed, ++op_passed;
    } else {
      result.failures.push_back(
          fmt::format("{} [{}]: {}", c.op, c.params, fmt::join(problems, "; ")));
    }
    if (options.verbose || !ok) {
      std::fprintf(out, "%-20s %-58s nmse %.2e  %s\n", c.op.c_str(), c.params.c_str(), worst,
                   ok ? "OK" : fmt::format("FAIL: {}", fmt::join(problems, "; ")).c_str());
    }
  }
  op_line();
  return result;
}

}  // namespace meshtrain
