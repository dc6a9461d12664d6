// What each rank holds and sends under ZeRO: model-state bytes against the
// formulas, offload (cpu, disk) bit-identical to resident state and within
// its RAM budget, stage 3's prefetch seen in the communicator's timestamps,
// reshard_after_forward, and the bytes each stage moves per step.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <cstdio>
#include <filesystem>

#include "meshtrain/parallel/zero/memory.h"
#include "mpi_test.h"
#include "zero_run.h"

namespace meshtrain {
namespace {

using testing::mpi_env;
using testing::ZeroRunResult;
using testing::ZeroRunSpec;

class ZeroMemory : public ::testing::Test {
 protected:
  MemoryTracker tracker_;
  std::unique_ptr<MpiCommunicator> world_ = mpi_env().world(tracker_);
};

size_t at(const std::array<size_t, kMemCategories>& bytes, MemCategory c) {
  return bytes[static_cast<size_t>(c)];
}

// A model with enough parameters that the formulas' terms are far apart.
ModelConfig memory_model() {
  ModelConfig c = testing::tiny_llama(false);
  c.dim = 64;
  c.n_layers = 3;
  c.hidden_dim = 96;
  c.vocab_size = 101;
  return c;
}

TEST_F(ZeroMemory, ModelStateBytesPerRankEqualTheFormulas) {
  const int dp = world_->size();
  for (Precision precision : {Precision::fp32, Precision::bf16}) {
    ZeroRunSpec spec;
    spec.model = memory_model();
    spec.precision = precision;
    spec.steps = 2;
    int64_t psi = 0, narrow = 0;
    for (const ParamSpec& p : build_param_specs(spec.model)) {
      psi += p.numel();
      if (param_compute_dtype(p, precision) == DType::bf16) narrow += p.numel();
    }
    // Stage 0: the flat model and AdamW.
    {
      testing::CpuModel m(spec.model, precision, 1);
      AdamW optimizer(m.model, testing::test_adamw());
      zero::ModelStateBytes want = zero::zero_formula_bytes(0, psi, narrow, dp);
      EXPECT_EQ(m.tracker.live(MemCategory::params), want.params);
      EXPECT_EQ(m.tracker.live(MemCategory::grads), want.grads);
      EXPECT_EQ(m.tracker.live(MemCategory::optimizer), want.optimizer);
    }
    for (int s = 1; s <= 3; ++s) {
      zero::ZeroOptions options;
      options.stage = s;
      ZeroRunResult r = testing::run_zero(spec, *world_, options);
      const zero::ZeroLayout layout = zero::make_zero_layout(build_param_specs(spec.model),
                                                       build_param_units(spec.model), precision,
                                                       dp);
      const zero::ModelStateBytes exact = zero::layout_model_state_bytes(layout, s);
      const zero::ModelStateBytes formula = zero::zero_formula_bytes(s, psi, narrow, dp);
      const std::string what = fmt::format("{} stage {} dp {}", precision_name(precision), s, dp);
      for (const auto& bytes : {r.built, r.trained}) {
        EXPECT_EQ(at(bytes, MemCategory::params), exact.params) << what;
        EXPECT_EQ(at(bytes, MemCategory::grads), exact.grads) << what;
        EXPECT_EQ(at(bytes, MemCategory::optimizer), exact.optimizer) << what;
      }
      // The measured total within 5% of the formula plus the padding.
      const double padding = static_cast<double>(layout.padding() * 20);
      const double measured = static_cast<double>(at(r.trained, MemCategory::params) +
                                                  at(r.trained, MemCategory::grads) +
                                                  at(r.trained, MemCategory::optimizer));
      EXPECT_LE(std::fabs(measured - static_cast<double>(formula.total())),
                0.05 * static_cast<double>(formula.total()) + padding)
          << what;
    }
  }
}

// cpu and disk tiers stream the same values through other memory: the same bits.
TEST_F(ZeroMemory, OffloadIsBitIdenticalAndDiskStaysWithinItsBudget) {
  const std::string dir = testing::rank_scratch_dir();
  ZeroRunSpec spec;
  spec.model = memory_model();
  spec.precision = Precision::bf16;  // bf16 weights' master shards are offloaded too
  spec.steps = 4;
  spec.micro_batches = 2;
  for (int s : {1, 3}) {
    zero::ZeroOptions options;
    options.stage = s;
    options.piece_elems = 1000;  // many pieces: several chunks per flat parameter
    const ZeroRunResult resident = testing::run_zero(spec, *world_, options);
    const size_t optimizer_bytes = at(resident.trained, MemCategory::optimizer);
    EXPECT_EQ(at(resident.trained, MemCategory::offloaded), 0u);

    options.offload.tier = zero::OffloadTier::cpu;
    const ZeroRunResult cpu = testing::run_zero(spec, *world_, options);
    testing::expect_identical(cpu, resident, fmt::format("stage {} offload cpu", s));
    EXPECT_GE(at(cpu.trained, MemCategory::offloaded), optimizer_bytes);
    // Exactly the layout's: the optimizer state, at stage 3 the parameter shards too.
    const size_t offloaded = zero::layout_offloaded_bytes(
        zero::make_zero_layout(build_param_specs(spec.model), build_param_units(spec.model),
                               spec.precision, world_->size()),
        s);
    EXPECT_EQ(at(cpu.trained, MemCategory::offloaded), offloaded) << "stage " << s;

    options.offload.tier = zero::OffloadTier::disk;
    options.offload.directory = dir;
    options.offload.budget_bytes = 48 * 1000;  // four pieces' three states
    ASSERT_GT(optimizer_bytes, 2 * options.offload.budget_bytes);
    const ZeroRunResult disk = testing::run_zero(spec, *world_, options);
    testing::expect_identical(disk, resident, fmt::format("stage {} offload disk", s));
    EXPECT_LE(disk.peak[static_cast<size_t>(MemCategory::optimizer)],
              options.offload.budget_bytes)
        << "resident optimizer memory over the budget, stage " << s;
    EXPECT_EQ(at(disk.trained, MemCategory::offloaded), offloaded) << "stage " << s;
  }
  EXPECT_TRUE(std::filesystem::is_empty(dir)) << "the store's file outlived it";
}

// Stage 3 with prefetch: some unit's all-gather was issued to the
// communication thread before the model asked for the unit; without prefetch
// none was. Timestamps from the communicator's records.
TEST_F(ZeroMemory, Stage3PrefetchIssuesGathersAheadOfUse) {
  ZeroRunSpec spec;
  spec.model = memory_model();
  spec.model.n_layers = 4;
  spec.model.dim = 96;
  spec.model.hidden_dim = 256;
  spec.model.max_seq_len = 32;
  spec.seq = 32;
  spec.steps = 3;
  for (bool prefetch : {true, false}) {
    zero::ZeroOptions options;
    options.stage = 3;
    options.prefetch = prefetch;
    ZeroRunResult r = testing::run_zero(spec, *world_, options);
    int ahead = 0, issued_early = 0, events = 0;
    for (const zero::ZeroStepTiming& t : r.timings) {
      for (const zero::GatherEvent& e : t.gathers) {
        ++events;
        issued_early += e.call.submitted < e.needed;
        ahead += e.call.started < e.needed;
      }
    }
    EXPECT_GT(events, 0);
    if (prefetch) {
      // Issued ahead is the engine's decision; started ahead also needs the
      // communication thread to be scheduled in time (not on a loaded machine).
      EXPECT_GT(issued_early, 0) << "prefetch on, yet no gather was issued ahead of its use";
      if (ahead == 0) std::printf("note: no prefetched gather had started before its use\n");
    } else {
      EXPECT_EQ(issued_early, 0) << "prefetch off, yet a gather was issued ahead";
    }
  }
}

// Keeping gathered units from forward to backward changes no bit, gathers
// fewer times, and holds more parameters at the peak.
TEST_F(ZeroMemory, ReshardAfterForwardOffGathersOnceAndChangesNothing) {
  ZeroRunSpec spec;
  spec.model = memory_model();
  spec.steps = 3;
  zero::ZeroOptions options;
  options.stage = 3;
  const ZeroRunResult on = testing::run_zero(spec, *world_, options);
  options.reshard_after_forward = false;
  const ZeroRunResult off = testing::run_zero(spec, *world_, options);
  testing::expect_identical(off, on, "reshard_after_forward false");
  const size_t units = build_param_units(spec.model).size();
  // Forward gathers every unit; backward again all but the head.
  EXPECT_EQ(on.timings.back().gathers.size(), 2 * units - 1);
  EXPECT_EQ(off.timings.back().gathers.size(), units);
  EXPECT_GT(off.peak[static_cast<size_t>(MemCategory::params)],
            on.peak[static_cast<size_t>(MemCategory::params)]);
}

// Bytes per step (CallRecord: reduce_scatter its input, all_gather its
// output) against the layout: stages 1/2 one reduce-scatter of the f32 grads
// and one all-gather of the compute values per flat parameter; stage 3 a
// second all-gather of every unit but the head (kept from forward to backward).
TEST_F(ZeroMemory, BytesPerStepMatchTheory) {
  ZeroRunSpec spec;
  spec.model = testing::tiny_gpt2();
  spec.precision = Precision::bf16;
  spec.steps = 3;
  const zero::ZeroLayout layout = zero::make_zero_layout(
      build_param_specs(spec.model), build_param_units(spec.model), spec.precision,
      world_->size());
  const size_t head = layout.unit_flats.size() - 1;
  uint64_t grads = 0, values = 0, head_values = 0;
  for (const zero::FlatParam& f : layout.flats) {
    grads += static_cast<uint64_t>(f.padded) * 4;
    values += static_cast<uint64_t>(f.padded) * dtype_size(f.dtype);
    if (f.unit == head) head_values += static_cast<uint64_t>(f.padded) * dtype_size(f.dtype);
  }
  for (int s = 1; s <= 3; ++s) {
    zero::ZeroOptions options;
    options.stage = s;
    ZeroRunResult r = testing::run_zero(spec, *world_, options);
    const uint64_t want = s < 3 ? grads + values : grads + 2 * values - head_values;
    EXPECT_EQ(r.timings.back().bytes, want) << "stage " << s;
  }
}

}  // namespace
}  // namespace meshtrain
