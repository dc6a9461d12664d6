// Data parallelism under mpirun (1, 2 and 4 ranks): buckets, overlap measured
// from the communicator's timestamps, no communication on non-final
// micro-batches, and whole training runs equal to the single-rank run on the
// same global batch (with and without accumulation, any bucket size).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "meshtrain/comm/mesh.h"
#include "meshtrain/parallel/ddp/ddp.h"
#include "meshtrain/train/trainer.h"
#include "mpi_test.h"
#include "support/scratch.h"
#include "support/tiny_models.h"
#include "support/trainer_run.h"

namespace meshtrain {
namespace {

using testing::mpi_env;
using testing::run_trainer;

TEST(GradBuckets, ContiguousReverseOrderCoveringEveryParameter) {
  testing::CpuModel m(testing::tiny_llama(false), Precision::fp32, 1);
  const std::vector<Parameter>& params = m.model.params();
  for (size_t cap : {size_t{1}, size_t{4096}, size_t{20000}, size_t{1} << 30}) {
    std::vector<GradBucket> buckets = make_grad_buckets(params, cap);
    ASSERT_FALSE(buckets.empty());
    size_t end = params.size();
    int64_t end_offset = m.model.num_params();
    for (const GradBucket& b : buckets) {
      EXPECT_EQ(b.end_param, end) << "buckets follow reverse registry order";
      EXPECT_LT(b.first_param, b.end_param);
      EXPECT_EQ(b.offset + b.numel, end_offset) << "contiguous, no gaps";
      EXPECT_EQ(b.offset, params[b.first_param].offset);
      // Over the cap only by the parameter that crossed it.
      const size_t bytes = static_cast<size_t>(b.numel) * 4;
      const size_t first_bytes = static_cast<size_t>(params[b.first_param].spec.numel()) * 4;
      if (b.first_param > 0) {
        EXPECT_LT(bytes - first_bytes, cap);
      }
      end = b.first_param;
      end_offset = b.offset;
    }
    EXPECT_EQ(end, 0u);
    EXPECT_EQ(end_offset, 0);
  }
  EXPECT_EQ(make_grad_buckets(params, size_t{1} << 30).size(), 1u);
  EXPECT_EQ(make_grad_buckets(params, 1).size(), params.size());
}

// A model on each rank with its own tokens (rank-dependent), synced by DDP.
class DdpModel : public ::testing::Test {
 protected:
  static constexpr int64_t kBatch = 2, kSeq = 8;
  MemoryTracker tracker_;
  std::unique_ptr<MpiCommunicator> world_ = mpi_env().world(tracker_);
  testing::CpuModel m_{testing::tiny_llama(false), Precision::fp32, 1};

  void SetUp() override { testing::init_for_test(m_.model, 5); }
  // One micro-batch of this rank's data (different on every rank).
  void micro_batch(uint64_t k) {
    std::vector<int32_t> ids = testing::random_ids(100 * static_cast<uint64_t>(world_->rank()) + k,
                                                   kBatch * kSeq + 1, m_.model.config().vocab_size);
    m_.model.forward_backward(ids.data(), ids.data() + 1, kBatch, kSeq, 0.01f);
  }
};

TEST_F(DdpModel, AveragesGradientsOverRanks) {
  // Overlap off first: the local gradients can be read before they are reduced.
  std::vector<float> averaged;
  for (bool overlap : {false, true}) {
    DistributedDataParallel ddp(m_.model, *world_,
                                DdpOptions{.bucket_mb = 0.002, .overlap = overlap});
    m_.model.zero_grads();
    ddp.begin_micro_batch(true);
    micro_batch(0);
    // (With overlap on, buckets are being reduced in place on the communication thread by
    // now: reading them here was a data race, ThreadSanitizer's report in ddp.np2.)
    std::vector<float> local;
    if (!overlap) {
      local.assign(m_.model.flat_grad().data<float>(),
                   m_.model.flat_grad().data<float>() + m_.model.num_params());
    }
    ddp.finish_gradient_sync();
    const float* g = m_.model.flat_grad().data<float>();
    if (!overlap) {
      // Reference: every rank's local gradient summed explicitly, over the size.
      std::vector<float> sum = local;
      world_->all_reduce(sum.data(), static_cast<int64_t>(sum.size()), CommDType::f32,
                         ReduceOp::sum);
      for (size_t i = 0; i < sum.size(); ++i) {
        ASSERT_NEAR(g[i], sum[i] / static_cast<float>(world_->size()),
                    1e-7f + 1e-6f * std::fabs(g[i]))
            << i;
      }
      averaged.assign(g, g + m_.model.num_params());
    } else {
      // Reducing buckets during backward gives the same bits.
      EXPECT_EQ(std::memcmp(averaged.data(), g, averaged.size() * 4), 0);
    }
    EXPECT_GT(ddp.buckets().size(), 3u);
    EXPECT_EQ(ddp.last_sync().calls.size(), ddp.buckets().size());
  }
}

TEST_F(DdpModel, NoCommunicationBeforeTheLastMicroBatch) {
  DistributedDataParallel ddp(m_.model, *world_, DdpOptions{.bucket_mb = 0.002, .overlap = true});
  m_.model.zero_grads();
  const uint64_t before = world_->calls_issued();
  for (uint64_t k = 0; k < 3; ++k) {
    ddp.begin_micro_batch(k == 2);
    micro_batch(k);
    if (k < 2) {
      EXPECT_EQ(world_->calls_issued(), before) << "micro-batch " << k << " communicated";
    }
  }
  ddp.finish_gradient_sync();
  EXPECT_EQ(world_->calls_issued(), before + ddp.buckets().size());
}

// A bucket is issued as soon as every unit it overlaps has finished backward
// (after(u, backward)), not later, and never before.
TEST_F(DdpModel, BucketsLaunchWhenTheUnitsTheyOverlapFinishBackward) {
  DistributedDataParallel ddp(m_.model, *world_, DdpOptions{.bucket_mb = 0.002, .overlap = true});
  const std::vector<ParamUnit>& units = m_.model.units();
  const std::vector<size_t> first_units = bucket_first_units(ddp.buckets(), units);
  ASSERT_EQ(first_units.size(), ddp.buckets().size());
  for (size_t b = 0; b < first_units.size(); ++b) {
    const ParamUnit& u = units[first_units[b]];
    EXPECT_LE(u.first_param, ddp.buckets()[b].first_param);
    EXPECT_LT(ddp.buckets()[b].first_param, u.end_param);
  }
  std::vector<uint64_t> issued_at(units.size(), 0);
  auto ddp_hook = m_.model.unit_hooks.after;
  const uint64_t before = world_->calls_issued();
  m_.model.unit_hooks.after = [&](size_t u, UnitPass pass) {
    ddp_hook(u, pass);
    if (pass == UnitPass::backward) issued_at[u] = world_->calls_issued() - before;
  };
  m_.model.zero_grads();
  ddp.begin_micro_batch(true);
  micro_batch(0);
  ddp.finish_gradient_sync();
  m_.model.unit_hooks.after = ddp_hook;
  for (size_t u = 0; u < units.size(); ++u) {
    uint64_t complete = 0;  // buckets lying in units u .. U-1
    for (size_t f : first_units) complete += f >= u;
    EXPECT_EQ(issued_at[u], complete) << "after backward of unit " << units[u].name;
  }
  EXPECT_EQ(issued_at[0], ddp.buckets().size());
}

// Overlap is measured, not assumed: with overlap on, some bucket's all-reduce
// started (on the communication thread) before backward returned; with it
// off, none did. Times come from the communicator's own records. The model is
// large enough that backward outlasts a scheduler tick after the first
// bucket, even with 4 ranks on 2 cores.
TEST(DdpOverlap, BucketAllReducesStartDuringBackward) {
  MemoryTracker tracker;
  auto world = mpi_env().world(tracker);
  ModelConfig c = testing::tiny_llama(false);
  c.dim = 96;
  c.n_layers = 4;
  c.hidden_dim = 256;
  c.max_seq_len = 64;
  testing::CpuModel m(c, Precision::fp32, 1);
  m.model.init_weights(3);
  std::vector<int32_t> ids =
      testing::random_ids(static_cast<uint64_t>(world->rank()), 4 * 64 + 1, c.vocab_size);
  for (bool overlap : {true, false}) {
    DistributedDataParallel ddp(m.model, *world, DdpOptions{.bucket_mb = 0.05, .overlap = overlap});
    int steps_with_overlap = 0;
    for (int step = 0; step < 4; ++step) {
      m.model.zero_grads();
      ddp.begin_micro_batch(true);
      m.model.forward_backward(ids.data(), ids.data() + 1, 4, 64, 0.01f);
      ddp.finish_gradient_sync();
      const DdpSyncTiming& t = ddp.last_sync();
      // The communicator's log holds the same calls.
      std::vector<CallRecord> log = world->recent_calls();
      ASSERT_GE(log.size(), t.calls.size());
      const size_t first = log.size() - t.calls.size();
      int early = 0;
      for (size_t i = 0; i < t.calls.size(); ++i) {
        EXPECT_EQ(log[first + i].seq, t.calls[i].seq);
        EXPECT_EQ(log[first + i].started, t.calls[i].started);
        if (t.calls[i].started < t.backward_end) ++early;
      }
      if (!overlap) {
        EXPECT_EQ(early, 0) << "overlap off, yet a call started during backward";
      }
      steps_with_overlap += early > 0;
      EXPECT_GE(t.exposed_seconds, 0.0);
      EXPECT_GT(t.comm_seconds, 0.0);
    }
    if (overlap) {
      EXPECT_GT(steps_with_overlap, 0) << "no all-reduce ever started before backward ended";
    }
    EXPECT_GT(ddp.buckets().size(), 4u);
  }
}

// Whole runs: dp = world size against dp = 1 on the same global batch.
class DdpTraining : public ::testing::Test {
 protected:
  using Run = testing::TrainerRun;  // (hides ::testing::Test::Run)

  // One directory for all ranks, as on a cluster's shared file system (every
  // rank must be given the same config, paths included).
  void SetUp() override {
    dir_ = testing::shared_scratch_dir(*world_);
    if (world_->rank() == 0) testing::write_phrase_corpus(dir_, 64);
    world_->barrier();
  }

  TrainConfig config(const std::string& out, ConfigOverrides extra = {}) const {
    return testing::tiny_run_config(R"(
[model]
family = "llama"
dim = 32
n_layers = 2
n_heads = 4
n_kv_heads = 2
hidden_dim = 64
vocab_size = 64
max_seq_len = 32
tie_embeddings = false
[train]
steps = 20
batch_size = 8
seq_len = 16
threads = 1
grad_clip = 1.0
eval_interval = 10
eval_batches = 1
peak_flops = 1e11
checkpoint_interval = -1
[optim]
lr = 3e-3
min_lr = 3e-4
warmup_steps = 2
[data]
tokenizer = "bytes"
)",
                                    dir_, out, std::move(extra), "ddp.toml");
  }

  // Losses within 1e-5 relative, final weights within 1e-5.
  static void expect_close(const Run& ddp, const Run& ref, const std::string& what) {
    ASSERT_EQ(ddp.records.size(), ref.records.size()) << what;
    for (size_t i = 0; i < ref.records.size(); ++i) {
      EXPECT_NEAR(ddp.records[i].loss, ref.records[i].loss, 1e-5 * std::fabs(ref.records[i].loss))
          << what << ": step " << i + 1;
    }
    ASSERT_EQ(ddp.weights.size(), ref.weights.size());
    float worst = 0;
    for (size_t i = 0; i < ref.weights.size(); ++i) {
      worst = std::max(worst, std::fabs(ddp.weights[i] - ref.weights[i]));
    }
    EXPECT_LE(worst, 1e-5f) << what << ": largest weight difference";
  }

  // Every rank holds the same weights, bit for bit.
  static void expect_replicas_identical(Communicator& world, const std::vector<float>& weights) {
    std::vector<float> root = weights;
    world.broadcast(root.data(), static_cast<int64_t>(root.size()), CommDType::f32, 0);
    EXPECT_EQ(std::memcmp(root.data(), weights.data(), weights.size() * 4), 0)
        << "rank " << world.rank() << " drifted from rank 0";
  }

  std::string dir_;
  MemoryTracker tracker_;
  std::unique_ptr<MpiCommunicator> world_ = mpi_env().world(tracker_);
};

TEST_F(DdpTraining, MatchesSingleRankWithAndWithoutAccumulation) {
  DeviceMesh mesh(*world_, 1, 1);
  // micro_batch_size 8: one micro-batch per rank; 1: batch/dp micro-batches per rank.
  for (const char* micro : {"8", "1"}) {
    // Every rank runs the reference alone, in its own directory.
    Run ref = run_trainer(
        config(std::string("ref") + micro + ".rank" + std::to_string(world_->rank()),
               {{"train.micro_batch_size", micro}}),
        nullptr);
    Run ddp =
        run_trainer(config(std::string("ddp") + micro, {{"train.micro_batch_size", micro}}), &mesh);
    expect_close(ddp, ref, std::string("micro_batch_size ") + micro);
    expect_replicas_identical(*world_, ddp.weights);
  }
}

TEST_F(DdpTraining, BucketSizeAndOverlapChangeNothingBeyondRounding) {
  DeviceMesh mesh(*world_, 1, 1);
  Run big = run_trainer(config("big", {{"parallel.bucket_mb", "25"}}), &mesh);
  Run small = run_trainer(config("small", {{"parallel.bucket_mb", "0.001"}}), &mesh);
  Run off = run_trainer(
      config("off", {{"parallel.bucket_mb", "0.001"}, {"parallel.overlap", "false"}}), &mesh);
  expect_close(small, big, "bucket_mb 0.001 vs 25");
  expect_close(off, small, "overlap off vs on");
  expect_replicas_identical(*world_, small.weights);
}

// The replicas each write 1/dp of the state; every rank resumes from the
// checkpoint and continues exactly as the uninterrupted run.
TEST_F(DdpTraining, ResumeFromRankZerosCheckpointContinuesBitForBit) {
  DeviceMesh mesh(*world_, 1, 1);
  Run full = run_trainer(config("full", {{"train.checkpoint_interval", "10"}}), &mesh);
  world_->barrier();  // rank 0's step_10 is on disk
  EXPECT_EQ(std::filesystem::exists(dir_ + "/full/step_10/manifest.json"), true);
  // The replicas share the writing: every rank writes 1/dp of the state.
  EXPECT_EQ(std::filesystem::exists(dir_ + "/full/step_10/rank_1.safetensors"), world_->size() > 1);
  TrainerOptions options;
  options.console = false;
  options.mesh = &mesh;
  options.resume_dir = dir_ + "/full/step_10";
  Trainer resumed(config("resumed"), options);
  EXPECT_EQ(resumed.step(), 10);
  std::vector<StepRecord> rest = resumed.run();
  ASSERT_EQ(rest.size(), 10u);
  for (size_t i = 0; i < rest.size(); ++i) {
    EXPECT_EQ(rest[i].loss, full.records[10 + i].loss) << "step " << rest[i].step;
  }
  const Tensor& w = resumed.model().flat_master();
  EXPECT_EQ(std::memcmp(w.data<float>(), full.weights.data(), full.weights.size() * 4), 0);
}

TEST_F(DdpTraining, EachRankWritesItsMetricsWithCommunicationTimes) {
  DeviceMesh mesh(*world_, 1, 1);
  run_trainer(config("metrics", {{"train.steps", "3"}}), &mesh);
  const int rank = world_->rank();
  std::string name = rank == 0 ? "metrics.jsonl" : "metrics.rank" + std::to_string(rank) + ".jsonl";
  std::string text = testing::read_file(dir_ + "/metrics/" + name);
  EXPECT_NE(text.find("\"step\":3"), std::string::npos) << name;
  if (world_->size() > 1) {
    EXPECT_NE(text.find("\"exposed_comm_ms\""), std::string::npos);
    EXPECT_EQ(text.find("\"comm_ms\":0.0,"), std::string::npos) << "dp > 1 communicates";
  }
}

}  // namespace
}  // namespace meshtrain
