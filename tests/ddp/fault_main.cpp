// A rank that throws in the middle of a data-parallel backward (rank 1 at
// step 3, with some of its bucket all-reduces already issued) while rank 0
// waits in the step's gradient sync. The job must end within seconds with
// "rank 1: injected failure ..." and a non-zero exit (tests/mpi.cmake).
#include <cstdio>
#include <memory>

#include "meshtrain/comm/abort.h"
#include "meshtrain/parallel/ddp/ddp.h"
#include "meshtrain/util/error.h"
#include "support/tiny_models.h"

int main() {
  using namespace meshtrain;
  MemoryTracker tracker;
  MpiEnvironment env;
  RankFailureHandler failure(env, tracker);
  std::unique_ptr<MpiCommunicator> world = env.world(tracker);
  // Declared outside the try: they must outlive the failure report.
  testing::CpuModel m(testing::tiny_llama(false), Precision::fp32, 1);
  std::unique_ptr<DistributedDataParallel> ddp;
  try {
    MESHTRAIN_CHECK(world->size() >= 2, "ddp_fault needs at least 2 ranks");
    m.model.init_weights(1);
    ddp = std::make_unique<DistributedDataParallel>(
        m.model, *world, DdpOptions{.bucket_mb = 0.002, .overlap = true});
    auto sync_hook = m.model.unit_hooks.after;
    int step = 0;
    const size_t middle = m.model.units().size() / 2;
    m.model.unit_hooks.after = [&](size_t unit, UnitPass pass) {
      sync_hook(unit, pass);
      if (world->rank() == 1 && step == 3 && pass == UnitPass::backward && unit == middle) {
        fail("injected failure at step {} in backward (unit {})", step, unit);
      }
    };
    std::vector<int32_t> ids = testing::random_ids(7, 2 * 8 + 1, m.model.config().vocab_size);
    for (step = 0; step < 1000; ++step) {
      m.model.zero_grads();
      ddp->begin_micro_batch(true);
      m.model.forward_backward(ids.data(), ids.data() + 1, 2, 8, 0.01f);
      ddp->finish_gradient_sync();
    }
    std::fprintf(stderr, "rank %d: finished without the injected failure\n", world->rank());
    return 0;
  } catch (const std::exception& e) {
    return failure.fail_rank(e);
  }
}
