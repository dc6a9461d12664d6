// Pipeline stages composed with tensor (and sequence) parallelism and data
// parallelism at the engine level: tp 2 x pp 2 on 4 ranks, dp 2 x tp 2 x pp 2
// on 8. Every rank's gradient slices equal the single model's on the global
// batch, and the loss summed over the stages (and dp) equals its loss.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <memory>

#include "meshtrain/backend/cpu/cpu_backend.h"
#include "meshtrain/comm/mesh.h"
#include "meshtrain/parallel/ddp/ddp.h"
#include "meshtrain/parallel/pipeline/executor.h"
#include "mpi_test.h"
#include "support/tiny_models.h"

namespace meshtrain::pipeline {
namespace {

using testing::mpi_env;

TEST(PipelineTensorParallel, StagesWithTpSlicesMatchTheSingleModel) {
  MemoryTracker tracker;
  std::unique_ptr<MpiCommunicator> world = mpi_env().world(tracker);
  if (world->size() % 4 != 0) GTEST_SKIP() << "needs tp 2 x pp 2 (4 or 8 ranks)";
  DeviceMesh mesh(*world, 2, 2);
  const int dp = mesh.layout().dp(), dp_rank = mesh.coord().dp;
  const int64_t batch = 2, seq = 8, rows = batch * seq;
  const int m = 3;
  const PipelineShape shape{2, m, 1};
  for (bool tied : {false, true}) {
    for (bool sp : {false, true}) {
      SCOPED_TRACE(fmt::format("tied {} sequence parallel {} (window 3) dp {}", tied, sp, dp));
      ModelConfig c = testing::tiny_llama(tied);
      c.n_layers = 3;
      c.sliding_window = sp ? 3 : 0;  // Mistral's window (3 of 8) with sequence parallelism
      cpu::CpuBackend ctx(1, tracker);
      Model stage(c, Precision::fp32, ctx, ParamStorage::flat, TensorParallel{&mesh.tp(), sp},
                  stage_layers(c.n_layers, shape, mesh.coord().pp, {}));
      stage.init_weights(5);
      stage.zero_grads();
      std::unique_ptr<DistributedDataParallel> ddp;
      if (dp > 1) ddp = std::make_unique<DistributedDataParallel>(stage, mesh.replicas(), DdpOptions{25, false});
      Executor executor(stage, mesh.pp(), ScheduleKind::one_f_one_b, shape, batch, seq);
      // dp rank d runs micro-batches [d m, (d + 1) m) of the global batch.
      const std::vector<int32_t> ids = testing::random_ids(3, dp * m * (rows + 1), c.vocab_size);
      std::vector<MicroBatchRef> mine;
      for (int i = 0; i < m; ++i) {
        const int32_t* tokens = ids.data() + (dp_rank * m + i) * (rows + 1);
        mine.push_back({tokens, tokens + 1, nullptr, {}});
      }
      const float scale = 1.0f / static_cast<float>(m * rows);  // averaged over dp by DDP
      double loss = executor.run(mine, scale);
      if (tied) {
        // pp 2: the pp group is the first and the last stage.
        Parameter& embedding = stage.params()[0];
        mesh.pp().all_reduce(embedding.grad.data<float>(), embedding.spec.numel(), CommDType::f32,
                             ReduceOp::sum);
      }
      if (ddp) {
        ddp->begin_micro_batch(true);
        ddp->finish_gradient_sync();
      }
      mesh.pp().all_reduce(&loss, 1, CommDType::f64, ReduceOp::sum);
      mesh.replicas().all_reduce(&loss, 1, CommDType::f64, ReduceOp::sum);

      testing::CpuModel whole(c, Precision::fp32, 1);
      whole.model.init_weights(5);
      whole.model.zero_grads();
      double expected = 0;
      for (int i = 0; i < dp * m; ++i) {
        const int32_t* tokens = ids.data() + i * (rows + 1);
        expected += whole.model.forward_backward(tokens, tokens + 1, batch, seq,
                                                 scale / static_cast<float>(dp));
      }
      EXPECT_NEAR(loss, expected, 1e-5 * expected);
      // Per parameter, as the tp tests: the largest difference within 1e-5
      // of the largest reference value (tp sums partials in another order).
      for (const Parameter& p : stage.params()) {
        const Parameter& ref = whole.model.param(p.spec.name);
        double diff = 0, largest = 0;
        for_each_local_run(p.spec.split, [&](int64_t local, int64_t global, int64_t count) {
          for (int64_t i = 0; i < count; ++i) {
            const double want = ref.grad.data<float>()[global + i];
            diff = std::max(diff, std::fabs(p.grad.data<float>()[local + i] - want));
            largest = std::max(largest, std::fabs(want));
          }
        });
        EXPECT_LE(diff, 1e-5 * std::max(largest, 1e-30)) << p.spec.name << " (max |ref| " << largest << ")";
      }
    }
  }
}

}  // namespace
}  // namespace meshtrain::pipeline
