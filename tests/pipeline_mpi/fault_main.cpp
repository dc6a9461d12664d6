// A pipeline stage that throws in the middle of a schedule (the last stage,
// in its forward at step 3) while the other stages wait for its gradients.
// The job must end within seconds with "rank N: injected failure ..." and a
// non-zero exit (tests/pipeline.cmake), no rank left waiting in a receive.
#include <cstdio>
#include <memory>

#include "meshtrain/backend/cpu/cpu_backend.h"
#include "meshtrain/comm/abort.h"
#include "meshtrain/parallel/pipeline/executor.h"
#include "meshtrain/util/error.h"
#include "support/tiny_models.h"

int main() {
  using namespace meshtrain;
  MemoryTracker tracker;
  MpiEnvironment env;
  RankFailureHandler failure(env, tracker);
  std::unique_ptr<MpiCommunicator> world = env.world(tracker);
  // Declared outside the try: they must outlive the failure report.
  cpu::CpuBackend ctx(1, tracker);
  std::unique_ptr<Model> model;
  std::unique_ptr<pipeline::Executor> executor;
  try {
    MESHTRAIN_CHECK(world->size() >= 2, "pp_fault needs at least 2 ranks");
    ModelConfig config = testing::tiny_llama(false);
    config.n_layers = world->size();
    const pipeline::PipelineShape shape{world->size(), 4, 1};
    model = std::make_unique<Model>(config, Precision::fp32, ctx, ParamStorage::flat,
                                    TensorParallel{},
                                    pipeline::stage_layers(config.n_layers, shape, world->rank(), {}));
    model->init_weights(1);
    executor = std::make_unique<pipeline::Executor>(*model, *world, pipeline::ScheduleKind::one_f_one_b,
                                                    shape, 2, 8);
    int step = 0;
    const bool last = world->rank() == world->size() - 1;
    model->unit_hooks.before = [&](size_t unit, UnitPass pass) {
      if (last && step == 3 && pass == UnitPass::forward && unit == 0) {
        fail("injected failure at step {} in forward (stage {})", step, world->rank());
      }
    };
    std::vector<int32_t> ids = testing::random_ids(7, 2 * 8 + 1, config.vocab_size);
    const std::vector<pipeline::MicroBatchRef> batches(4, {ids.data(), ids.data() + 1, nullptr, {}});
    for (step = 0; step < 1000; ++step) {
      model->zero_grads();
      executor->run(batches, 0.01f);
    }
    std::fprintf(stderr, "rank %d: finished without the injected failure\n", world->rank());
    return 0;
  } catch (const std::exception& e) {
    return failure.fail_rank(e);
  }
}
