// The checkpoint library alone (no Trainer, no MPI): sync and async saves by
// 4 ranks (threads) of a ZeRO-sharded state, and loads into the same layout
// and into a tp-column layout (resharding: strided runs), with and without
// verification. Bytes = all three states. End to end through the Trainer
// (stall per save, memory, resume): bench_ckpt.
//   build/bench/bench_dist_ckpt [--benchmark_filter=...]   (scratch: $TMPDIR or /tmp)
#include <benchmark/benchmark.h>
#include <fmt/format.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <thread>
#include <vector>

#include "meshtrain/ckpt/distributed.h"

namespace {

namespace fs = std::filesystem;
using namespace meshtrain;
using layout::ShardMap;
using layout::StateKind;

constexpr int64_t kRows = 4096, kCols = 1024;  // 4 Mi elements, 16 MiB per state per tensor
constexpr int kTensors = 4, kRanks = 4;

class VecState : public layout::StateAccess {
 public:
  explicit VecState(int64_t n) {
    for (auto& v : data_) v.assign(static_cast<size_t>(n), 0.5f);
  }
  void read(StateKind k, int64_t off, int64_t n, float* out) override {
    std::memcpy(out, data_[static_cast<size_t>(k)].data() + off, static_cast<size_t>(n) * 4);
  }
  void write(StateKind k, int64_t off, int64_t n, const float* in) override {
    std::memcpy(data_[static_cast<size_t>(k)].data() + off, in, static_cast<size_t>(n) * 4);
  }

 private:
  std::vector<float> data_[layout::kStateKinds];
};

std::vector<layout::GlobalTensor> tensors() {
  std::vector<layout::GlobalTensor> out;
  for (int t = 0; t < kTensors; ++t) out.push_back({fmt::format("w{}", t), {kRows, kCols}, {}});
  return out;
}

// ZeRO: rank r owns the r-th quarter of every tensor's flat range.
ShardMap zero_map(int r) {
  ShardMap m;
  m.tensors = tensors();
  const int64_t n = kRows * kCols / kRanks;
  for (size_t t = 0; t < m.tensors.size(); ++t) {
    m.pieces.push_back(
        {t, layout::narrow_region(layout::whole_region(m.tensors[t].shape), r * n, (r + 1) * n),
         m.local_numel, 0});
    m.local_numel += n;
  }
  return m;
}

// tp over columns: rank r holds columns [r * C/4, (r+1) * C/4) of every tensor.
ShardMap tp_cols_map(int r) {
  ShardMap m;
  m.tensors = tensors();
  for (size_t t = 0; t < m.tensors.size(); ++t) {
    layout::Region region = layout::whole_region(m.tensors[t].shape);
    region.offset[1] = r * kCols / kRanks;
    region.extent[1] = kCols / kRanks;
    region.flat_end = region.box_numel();
    m.pieces.push_back({t, region, m.local_numel, 0});
    m.local_numel += region.numel();
  }
  return m;
}

std::string scratch() {
  const char* tmp = std::getenv("TMPDIR");
  return (fs::path(tmp ? tmp : "/tmp") / "meshtrain_bench_dist_ckpt").string();
}

void save_all(const std::string& out, int64_t step, bool async) {
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      dist_ckpt::SaveOptions o;
      o.rank = r;
      o.world = kRanks;
      o.async = async;
      o.keep_last = 1;
      const ShardMap map = zero_map(r);
      VecState state(map.local_numel);
      dist_ckpt::CheckpointSaver saver(out, o);
      saver.save(step, map, state, {}, {});
      saver.wait();
    });
  }
  for (auto& t : threads) t.join();
}

const int64_t kBytes = int64_t{kTensors} * kRows * kCols * 4 * 3;

void BM_Save(benchmark::State& st) {
  const std::string out = scratch();
  fs::remove_all(out);
  int64_t step = 0;
  for (auto _ : st) save_all(out, ++step, st.range(0) != 0);
  st.SetBytesProcessed(st.iterations() * kBytes);
  fs::remove_all(out);
}
BENCHMARK(BM_Save)->Arg(0)->Arg(1)->ArgName("async")->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_Load(benchmark::State& st) {
  const std::string out = scratch();
  fs::remove_all(out);
  save_all(out, 1, false);
  const bool reshard = st.range(0) != 0;
  const bool verify = st.range(1) != 0;
  for (auto _ : st) {
    std::vector<std::thread> threads;
    for (int r = 0; r < kRanks; ++r) {
      threads.emplace_back([&, r] {
        const ShardMap map = reshard ? tp_cols_map(r) : zero_map(r);
        VecState state(map.local_numel);
        dist_ckpt::load_checkpoint(out + "/step_1", map, state, 64 << 20, verify);
      });
    }
    for (auto& t : threads) t.join();
  }
  st.SetBytesProcessed(st.iterations() * kBytes);
  fs::remove_all(out);
}
BENCHMARK(BM_Load)
    ->Args({0, 0})
    ->Args({0, 1})
    ->Args({1, 0})
    ->Args({1, 1})
    ->ArgNames({"reshard", "verify"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
