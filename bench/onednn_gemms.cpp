// The fused classifier's GEMMs (one 256-row chunk of a vocab-50257, dim-512
// model) and a square GEMM, timed on whichever oneDNN this is built against:
// Debian's 2.6 (the project's) or PyPI's 2026.1 (3.x), by bench/onednn_versions.sh.
// Prints per GEMM the implementation oneDNN picked, the best of 4 timed calls
// and GFLOP/s; a reference kernel (ref:any, far too slow to time) is named only.
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include <dnnl.hpp>

namespace {

using dnnl::matmul;
using dnnl::memory;
using dt = memory::data_type;

void time_gemm(dnnl::engine& eng, dnnl::stream& s, const memory::desc& src, const memory::desc& wei,
               const memory::desc& dst, bool accumulate, void* a, void* b, void* c, double flops,
               const std::string& label) {
  dnnl::primitive_attr attr;
  dnnl::post_ops po;
  if (accumulate) po.append_sum(1.f);
  attr.set_post_ops(po);
#if DNNL_VERSION_MAJOR >= 3
  matmul::primitive_desc pd(eng, src, wei, dst, attr);
#else
  matmul::primitive_desc pd(matmul::desc(src, wei, dst), attr, eng);
#endif
  const std::string impl = pd.impl_info_str();
  if (impl.rfind("ref", 0) == 0) {
    std::printf("%-36s %-28s (reference kernel: not timed)\n", label.c_str(), impl.c_str());
    return;
  }
  matmul prim(pd);
  memory A(src, eng, a), B(wei, eng, b), C(dst, eng, c);
  double best = 1e30;
  for (int call = 0; call < 5; ++call) {
    const auto t0 = std::chrono::steady_clock::now();
    prim.execute(s, {{DNNL_ARG_SRC, A}, {DNNL_ARG_WEIGHTS, B}, {DNNL_ARG_DST, C}});
    s.wait();
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (call > 0 && sec < best) best = sec;  // the first call warms up
  }
  std::printf("%-36s %-28s %7.1f ms %6.0f GFLOP/s\n", label.c_str(), impl.c_str(), best * 1e3,
              flops / best / 1e9);
}

}  // namespace

int main() {
  dnnl::engine eng(dnnl::engine::kind::cpu, 0);
  dnnl::stream s(eng);
  std::printf("oneDNN %d.%d.%d\n", dnnl_version()->major, dnnl_version()->minor,
              dnnl_version()->patch);
  const int64_t D = 512, V = 50257, n = 256, S = 2048;
  for (dt t : {dt::f32, dt::bf16}) {
    const std::string name = t == dt::f32 ? "f32" : "bf16";
    const size_t e = t == dt::f32 ? 4 : 2;
    std::vector<char> h(n * D * e), dl(n * V * e), w(V * D * e), sq(S * S * e);
    std::vector<float> out(V * D), c(S * S);
    const double f = 2.0 * V * D * n;
    time_gemm(eng, s, {{S, S}, t, {S, 1}}, {{S, S}, t, {S, 1}}, {{S, S}, dt::f32, {S, 1}}, false,
              sq.data(), sq.data(), c.data(), 2.0 * S * S * S, name + " square 2048");
    time_gemm(eng, s, {{n, D}, t, {D, 1}}, {{D, V}, t, {1, D}}, {{n, V}, dt::f32, {V, 1}}, false,
              h.data(), w.data(), out.data(), f, name + " logits = h w^T");
    time_gemm(eng, s, {{n, V}, t, {V, 1}}, {{V, D}, t, {D, 1}}, {{n, D}, dt::f32, {D, 1}}, false,
              dl.data(), w.data(), out.data(), f, name + " dh = dl w");
    time_gemm(eng, s, {{V, n}, t, {1, V}}, {{n, D}, t, {D, 1}}, {{V, D}, dt::f32, {D, 1}}, true,
              dl.data(), h.data(), out.data(), f, name + " dw += dl^T h (trans A)");
    time_gemm(eng, s, {{D, n}, t, {1, D}}, {{n, V}, t, {V, 1}}, {{D, V}, dt::f32, {1, D}}, true,
              h.data(), dl.data(), out.data(), f, name + " dw^T += h^T dl (trans C)");
  }
}
