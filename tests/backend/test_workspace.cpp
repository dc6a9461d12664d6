// The backend's workspace queries against what the kernels take: for a GEMM
// (matmul_workspace: oneDNN's scratchpad and the f16 staging) and for the
// attention kernels (attention_workspace_bytes), the tracker's workspace peak
// after the call equals the query, to the byte, for 1 and 2 threads. The
// planner (train/memory_plan.cpp) predicts a run's workspace from them.
#include <gtest/gtest.h>

#include <omp.h>

#include <vector>

#include "meshtrain/backend/cpu/attention.h"
#include "meshtrain/backend/cpu/matmul.h"
#include "meshtrain/tensor/tensor.h"

namespace meshtrain {
namespace {

struct GemmCase {
  cpu::MatmulDims dims;
  DType ab, c;
  bool accumulate, bias;
};

TEST(Workspace, MatmulQueryIsWhatMatmulTakes) {
  const std::vector<GemmCase> cases = {
      {{.m = 64, .n = 96, .k = 32, .trans_b = true}, DType::f32, DType::f32, false, false},
      {{.m = 96, .n = 32, .k = 64, .trans_a = true}, DType::f32, DType::f32, true, false},
      {{.m = 64, .n = 96, .k = 32}, DType::bf16, DType::f32, true, true},
      {{.m = 512, .n = 64, .k = 256, .trans_b = true}, DType::bf16, DType::f32, false, false},
      {{.m = 64, .n = 61, .k = 300, .trans_a = true}, DType::f16, DType::f32, true, false},
      {{.batch = 3, .m = 16, .n = 16, .k = 8}, DType::f16, DType::f16, false, false},
  };
  size_t any_scratchpad = 0;
  for (int threads : {1, 2}) {
    for (const GemmCase& g : cases) {
      SCOPED_TRACE(testing::Message() << threads << " threads, m " << g.dims.m << " n " << g.dims.n
                                      << " k " << g.dims.k << " " << dtype_name(g.ab));
      // Asked before the context exists: the query sets and restores the thread count.
      omp_set_num_threads(3);
      const cpu::MatmulWorkspace want =
          cpu::matmul_workspace(g.dims, g.ab, g.c, threads, 1.0f, g.accumulate, g.bias);
      EXPECT_EQ(omp_get_max_threads(), 3);
      MemoryTracker tracker;
      cpu::CpuContext ctx(threads, tracker);
      const int64_t b_batch = g.dims.broadcast_b ? 1 : g.dims.batch;
      Tensor a({g.dims.batch * g.dims.m * g.dims.k}, g.ab, MemCategory::activations, tracker);
      Tensor b({b_batch * g.dims.k * g.dims.n}, g.ab, MemCategory::activations, tracker);
      Tensor c({g.dims.batch * g.dims.m * g.dims.n}, g.c, MemCategory::activations, tracker);
      Tensor bias({g.dims.n}, DType::f32, MemCategory::activations, tracker);
      cpu::matmul(ctx, g.dims, g.ab, a.raw(), b.raw(), g.c, c.raw(), 1.0f, g.accumulate,
                  g.bias ? bias.data<float>() : nullptr);
      EXPECT_EQ(tracker.peak(MemCategory::workspace), want.scratchpad + want.f16_staging);
      EXPECT_EQ(want.f16_staging > 0, g.ab == DType::f16 || g.c == DType::f16);
      any_scratchpad = std::max(any_scratchpad, want.scratchpad);
    }
  }
  EXPECT_GT(any_scratchpad, 0u);  // the comparison covers oneDNN's scratchpad, not only zeros
}

// The slot is grown, never shrunk: after forward and backward it holds the
// larger of the two passes' sizes.
TEST(Workspace, AttentionQueryIsWhatTheKernelsTake) {
  const cpu::AttentionDims dims{2, 24, 4, 2, 8};  // GQA, 3 causal blocks of 8 rows
  for (int threads : {1, 2}) {
    for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
      for (bool recompute : {false, true}) {
        SCOPED_TRACE(testing::Message() << threads << " threads, " << dtype_name(dt)
                                        << (recompute ? ", probabilities recomputed" : ""));
        const size_t forward = cpu::attention_workspace_bytes(dims, dt, recompute, false, threads);
        const size_t backward = cpu::attention_workspace_bytes(dims, dt, recompute, true, threads);
        MemoryTracker tracker;
        cpu::CpuContext ctx(threads, tracker);
        const int64_t rows = dims.batch * dims.seq, width = dims.n_heads * dims.head_dim;
        Tensor qkv({rows, dims.qkv_width()}, DType::f32, MemCategory::activations, tracker);
        float* x = qkv.data<float>();
        for (int64_t i = 0; i < qkv.numel(); ++i) x[i] = 0.01f * static_cast<float>(i % 37) - 0.2f;
        Tensor out({rows, width}, dt, MemCategory::activations, tracker);
        Tensor d_out({rows, width}, DType::f32, MemCategory::activations, tracker);
        Tensor d_qkv({rows, dims.qkv_width()}, dt, MemCategory::activations, tracker);
        cpu::AttentionSaved saved;
        saved.recompute_probs = recompute;
        cpu::attention_forward(ctx, dims, nullptr, dt, x, out.raw(), saved);
        EXPECT_EQ(tracker.peak(MemCategory::workspace), forward);
        cpu::attention_backward(ctx, dims, nullptr, dt, saved, d_out.data<float>(), d_qkv.raw());
        EXPECT_EQ(tracker.peak(MemCategory::workspace), std::max(forward, backward));
        EXPECT_EQ(tracker.live(MemCategory::workspace), std::max(forward, backward));
      }
    }
  }
}

}  // namespace
}  // namespace meshtrain
