#include <omp.h>

#include <algorithm>
#include <cmath>

#include "meshtrain/backend/cpu/matmul.h"
#include "meshtrain/util/error.h"
#include "reference.h"

namespace meshtrain::testing {

ScopedThreads::ScopedThreads(int n) : saved_(omp_get_max_threads()) { omp_set_num_threads(n); }
ScopedThreads::~ScopedThreads() { omp_set_num_threads(saved_); }

namespace {

using cpu::MatmulDims;

struct Case {
  MatmulDims dims;
  DType ab = DType::f32, c = DType::f32;
  float alpha = 1.0f;
  bool accumulate = false, bias = false;
};

// C[b] = alpha * op(A[b]) op(B[b]) + bias (+ C0) in float64 from the (rounded) inputs.
std::vector<double> reference(const Case& cs, const std::vector<float>& a, const std::vector<float>& b,
                              const std::vector<float>& bias, const std::vector<float>& c0) {
  const auto& d = cs.dims;
  std::vector<double> c(static_cast<size_t>(d.batch * d.m * d.n));
  for (int64_t bt = 0; bt < d.batch; ++bt) {
    const float* ab = a.data() + bt * d.m * d.k;
    const float* bb = b.data() + (d.broadcast_b ? 0 : bt * d.k * d.n);
    for (int64_t i = 0; i < d.m; ++i) {
      for (int64_t j = 0; j < d.n; ++j) {
        double s = 0.0;
        for (int64_t p = 0; p < d.k; ++p) {
          const double av = d.trans_a ? ab[p * d.m + i] : ab[i * d.k + p];
          const double bv = d.trans_b ? bb[j * d.k + p] : bb[p * d.n + j];
          s += av * bv;
        }
        const size_t idx = static_cast<size_t>((bt * d.m + i) * d.n + j);
        double v = cs.alpha * s;
        if (cs.bias) v += bias[j];
        if (cs.accumulate) v += c0[idx];
        c[idx] = v;
      }
    }
  }
  return c;
}

void run_case(cpu::CpuContext& ctx, const Case& cs) {
  const auto& d = cs.dims;
  auto a = random_floats(d.batch * d.m * d.k, 1);
  auto b = random_floats((d.broadcast_b ? 1 : d.batch) * d.k * d.n, 2);
  auto bias = random_floats(d.n, 3);
  auto c0 = random_floats(d.batch * d.m * d.n, 4);
  if (cs.ab == DType::bf16) {
    a = round_bf16(a);
    b = round_bf16(b);
  } else if (cs.ab == DType::f16) {
    a = round_f16(a);
    b = round_f16(b);
  }
  auto want = reference(cs, a, b, bias, c0);
  auto ab16 = to_bf16(a), bb16 = to_bf16(b);
  auto ah16 = to_f16(a), bh16 = to_f16(b);
  const void* pa = cs.ab == DType::bf16 ? static_cast<const void*>(ab16.data())
                   : cs.ab == DType::f16 ? static_cast<const void*>(ah16.data())
                                         : a.data();
  const void* pb = cs.ab == DType::bf16 ? static_cast<const void*>(bb16.data())
                   : cs.ab == DType::f16 ? static_cast<const void*>(bh16.data())
                                         : b.data();
  const float* pbias = cs.bias ? bias.data() : nullptr;
  SCOPED_TRACE(::testing::Message() << "batch " << d.batch << " m " << d.m << " n " << d.n << " k "
                                    << d.k << " ta " << d.trans_a << " tb " << d.trans_b << " bcast "
                                    << d.broadcast_b << " ab " << dtype_name(cs.ab) << " c "
                                    << dtype_name(cs.c) << " alpha " << cs.alpha << " acc "
                                    << cs.accumulate << " bias " << cs.bias);
  if (cs.c == DType::f32) {
    std::vector<float> c = c0;
    cpu::matmul(ctx, d, cs.ab, pa, pb, DType::f32, c.data(), cs.alpha, cs.accumulate, pbias);
    expect_close(c, want, 1e-5, 1e-6, "C");
  } else if (cs.c == DType::bf16) {
    std::vector<bf16> c(want.size());
    cpu::matmul(ctx, d, cs.ab, pa, pb, DType::bf16, c.data(), cs.alpha, false, pbias);
    expect_close(from_bf16(c), want, 8e-3, 1e-4, "C(bf16)");
  } else {
    // f32 accumulation, one rounding to f16 (2^-11 relative) at the end.
    std::vector<f16> c(want.size());
    cpu::matmul(ctx, d, cs.ab, pa, pb, DType::f16, c.data(), cs.alpha, false, pbias);
    expect_close(from_f16(c), want, 1e-3, 1e-5, "C(f16)");
  }
}

TEST(Matmul, AllTransposesBatchesAndBroadcast) {
  MemoryTracker tracker;
  cpu::CpuContext ctx(0, tracker);
  for (int64_t batch : {1, 3})
    for (bool ta : {false, true})
      for (bool tb : {false, true})
        for (bool bcast : {false, true}) {
          if (bcast && batch == 1) continue;
          Case cs;
          cs.dims = {batch, 7, 5, 9, ta, tb, bcast};
          run_case(ctx, cs);
        }
}

// Copies a dense [rows, cols] matrix into rows of length ld (the rest is pad).
std::vector<float> pad_rows(const std::vector<float>& x, int64_t rows, int64_t cols, int64_t ld, float pad) {
  std::vector<float> out(static_cast<size_t>(rows * ld), pad);
  for (int64_t r = 0; r < rows; ++r)
    std::copy_n(x.begin() + r * cols, cols, out.begin() + r * ld);
  return out;
}

TEST(Matmul, LeadingDimensionsReadAndWriteInsideLargerRows) {
  MemoryTracker tracker;
  cpu::CpuContext ctx(0, tracker);
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (bool acc : {false, true}) {
        Case cs;
        cs.dims = {1, 7, 5, 9, ta, tb, false};
        cs.accumulate = acc;
        const auto& d = cs.dims;
        auto a = random_floats(d.m * d.k, 1), b = random_floats(d.k * d.n, 2), c0 = random_floats(d.m * d.n, 4);
        auto want = reference(cs, a, b, {}, c0);
        // Stored shapes: A [m, k] or [k, m]; B [k, n] or [n, k]; C [m, n].
        const int64_t a_rows = ta ? d.k : d.m, a_cols = ta ? d.m : d.k;
        const int64_t b_rows = tb ? d.n : d.k, b_cols = tb ? d.k : d.n;
        cpu::MatmulDims dims = d;
        dims.lda = a_cols + 3;
        dims.ldb = b_cols + 1;
        dims.ldc = d.n + 2;
        auto pa = pad_rows(a, a_rows, a_cols, dims.lda, NAN), pb = pad_rows(b, b_rows, b_cols, dims.ldb, NAN);
        auto pc = pad_rows(c0, d.m, d.n, dims.ldc, -7.0f);
        cpu::matmul(ctx, dims, DType::f32, pa.data(), pb.data(), DType::f32, pc.data(), 1.0f, acc);
        std::vector<float> got;
        for (int64_t i = 0; i < d.m; ++i) {
          for (int64_t j = 0; j < dims.ldc; ++j) {
            const float v = pc[static_cast<size_t>(i * dims.ldc + j)];
            if (j < d.n) {
              got.push_back(v);
            } else {
              EXPECT_EQ(v, -7.0f) << "pad of C written at row " << i;
            }
          }
        }
        expect_close(got, want, 1e-5, 1e-6, "C with leading dims");
      }
  cpu::MatmulDims bad{1, 7, 5, 9, false, false, false, 8, 0, 0};  // lda < k
  std::vector<float> x(100);
  EXPECT_THROW(cpu::matmul(ctx, bad, DType::f32, x.data(), x.data(), DType::f32, x.data()), Error);
}

TEST(Matmul, AlphaAccumulateBias) {
  MemoryTracker tracker;
  cpu::CpuContext ctx(0, tracker);
  for (float alpha : {1.0f, 0.37f})
    for (bool acc : {false, true})
      for (bool bias : {false, true}) {
        Case cs;
        cs.dims = {2, 7, 13, 11, false, true, false};
        cs.alpha = alpha;
        cs.accumulate = acc;
        cs.bias = bias;
        run_case(ctx, cs);
      }
}

TEST(Matmul, Bf16InputsAndOutput) {
  MemoryTracker tracker;
  cpu::CpuContext ctx(0, tracker);
  for (DType c : {DType::f32, DType::bf16})
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        Case cs;
        cs.dims = {2, 9, 17, 33, ta, tb, false};
        cs.ab = DType::bf16;
        cs.c = c;
        run_case(ctx, cs);
      }
  Case cs;
  cs.dims = {3, 5, 7, 6, false, true, true};
  cs.ab = DType::bf16;
  cs.accumulate = true;
  cs.alpha = 0.5f;
  cs.bias = true;
  run_case(ctx, cs);
}

// oneDNN has no f16 matmul here: the operands are widened to f32 (exactly),
// so an f16 GEMM equals the f32 GEMM of the f16-rounded inputs.
TEST(Matmul, F16InputsAndOutputThroughF32) {
  MemoryTracker tracker;
  cpu::CpuContext ctx(0, tracker);
  for (DType c : {DType::f32, DType::f16})
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        Case cs;
        cs.dims = {2, 9, 17, 33, ta, tb, false};
        cs.ab = DType::f16;
        cs.c = c;
        run_case(ctx, cs);
      }
  Case cs;
  cs.dims = {3, 5, 7, 6, false, true, true};
  cs.ab = DType::f16;
  cs.accumulate = true;
  cs.alpha = 0.5f;
  cs.bias = true;
  run_case(ctx, cs);
}

// Leading dimensions with f16: the pads of A and B are read (widened) but
// unused, and C's pad is never written.
TEST(Matmul, F16LeadingDimensionsKeepCsPad) {
  MemoryTracker tracker;
  cpu::CpuContext ctx(0, tracker);
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      Case cs;
      cs.dims = {1, 7, 5, 9, ta, tb, false};
      const auto& d = cs.dims;
      auto a = round_f16(random_floats(d.m * d.k, 1)), b = round_f16(random_floats(d.k * d.n, 2));
      auto want = reference(cs, a, b, {}, {});
      const int64_t a_rows = ta ? d.k : d.m, a_cols = ta ? d.m : d.k;
      const int64_t b_rows = tb ? d.n : d.k, b_cols = tb ? d.k : d.n;
      cpu::MatmulDims dims = d;
      dims.lda = a_cols + 3;
      dims.ldb = b_cols + 1;
      dims.ldc = d.n + 2;
      auto pa = to_f16(pad_rows(a, a_rows, a_cols, dims.lda, 1e4f));
      auto pb = to_f16(pad_rows(b, b_rows, b_cols, dims.ldb, 1e4f));
      auto pc = to_f16(pad_rows(std::vector<float>(d.m * d.n, 0.0f), d.m, d.n, dims.ldc, -7.0f));
      cpu::matmul(ctx, dims, DType::f16, pa.data(), pb.data(), DType::f16, pc.data());
      std::vector<float> got;
      for (int64_t i = 0; i < d.m; ++i) {
        for (int64_t j = 0; j < dims.ldc; ++j) {
          const float v = f16_to_float(pc[static_cast<size_t>(i * dims.ldc + j)]);
          if (j < d.n) {
            got.push_back(v);
          } else {
            EXPECT_EQ(v, -7.0f) << "pad of C written at row " << i;
          }
        }
      }
      expect_close(got, want, 1e-3, 1e-5, "C(f16) with leading dims");
    }
}

TEST(Matmul, RepeatedCallsReuseThePrimitiveWithNewPointers) {
  MemoryTracker tracker;
  cpu::CpuContext ctx(0, tracker);
  Case cs;
  cs.dims = {1, 4, 6, 5, false, false, false};
  run_case(ctx, cs);
  run_case(ctx, cs);  // same key, fresh buffers
}

TEST(Matmul, RejectsAccumulateIntoBf16) {
  MemoryTracker tracker;
  cpu::CpuContext ctx(0, tracker);
  std::vector<bf16> a(4), b(4), c(4);
  EXPECT_THROW(cpu::matmul(ctx, {1, 2, 2, 2, false, false, false}, DType::bf16, a.data(), b.data(),
                           DType::bf16, c.data(), 1.0f, true),
               Error);
}

TEST(Matmul, PeakProbeReturnsAPositiveRate) {
  MemoryTracker tracker;
  cpu::CpuContext ctx(0, tracker);
  EXPECT_GT(cpu::measure_matmul_peak_flops(ctx, DType::f32, 0.05), 1e8);
}

}  // namespace
}  // namespace meshtrain::testing
