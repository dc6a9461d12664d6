// Streaming throughput of the offload tiers against plain copies. One pass visits
// every chunk of `--mib` MiB of optimizer state: acquire, a memory-bound update
// (x = 0.9x + 1, what an Adam moment costs per element), release dirty. Per round,
// alternating:
//   memcpy   copy each chunk into a working buffer and back, no store (the floor for cpu)
//   none     the update in place on resident chunks (no copies)
//   cpu      OffloadStore, cpu tier, resident budget --budget-mib
//   disk     OffloadStore, disk tier in --dir, same budget
// Prints min / median / max seconds and GB/s, where GB/s counts the bytes read plus
// written (2 x state) for memcpy/cpu/disk and the state once for none.
// A file of --mib stays in the page cache here, so "disk" measures the store's
// machinery over pread/pwrite into the cache, not the device.
//   build/bench/bench_offload [--mib 256] [--chunk-kib 4096] [--budget-mib 32] [--sweeps 1] [--rounds 5]
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <functional>
#include <vector>

#include "meshtrain/parallel/zero/offload.h"

namespace fs = std::filesystem;
using namespace meshtrain;
using namespace meshtrain::zero;

namespace {

// `sweeps` > 1 raises the compute per byte moved, which the I/O thread can hide behind.
void update(float* x, int64_t n, int sweeps) {
  for (int r = 0; r < sweeps; ++r) {
    for (int64_t i = 0; i < n; ++i) x[i] = 0.9f * x[i] + 1.0f;
  }
}

double seconds(const std::function<void()>& f) {
  auto start = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void store_pass(OffloadStore& store, int sweeps) {
  std::vector<size_t> order(store.num_chunks());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  store.begin_pass(order);
  for (size_t id : order) {
    update(store.acquire(id).data<float>(), store.chunk(id).numel, sweeps);
    store.release(id, true);
  }
  store.end_pass();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"meshtrain offload benchmark"};
  size_t mib = 256, chunk_kib = 4096, budget_mib = 32;
  int rounds = 5, sweeps = 1;
  std::string dir = fs::temp_directory_path().string();
  app.add_option("--mib", mib, "optimizer state streamed per pass");
  app.add_option("--chunk-kib", chunk_kib, "chunk size");
  app.add_option("--budget-mib", budget_mib, "resident budget of the cpu and disk tiers");
  app.add_option("--rounds", rounds, "timed rounds (after one warm-up)");
  app.add_option("--sweeps", sweeps, "update sweeps over each chunk (compute per byte moved)");
  app.add_option("--dir", dir, "directory for the disk tier's file");
  CLI11_PARSE(app, argc, argv);

  const int64_t chunk_numel = static_cast<int64_t>(chunk_kib << 10) / 4;
  std::vector<OffloadChunkSpec> chunks;
  for (size_t i = 0; i < (mib << 10) / chunk_kib; ++i) chunks.push_back({fmt::format("c{}", i), chunk_numel});
  const double state_bytes = static_cast<double>(chunks.size()) * chunk_numel * 4;

  MemoryTracker tracker, cpu_tracker, disk_tracker;  // one per store: peaks of their own
  auto options = [&](OffloadTier tier) {
    OffloadOptions o;
    o.tier = tier;
    o.directory = dir;
    o.budget_bytes = budget_mib << 20;
    return o;
  };
  OffloadStore none("bench_none", chunks, options(OffloadTier::none), tracker);
  OffloadStore cpu("bench_cpu", chunks, options(OffloadTier::cpu), cpu_tracker);
  OffloadStore disk("bench_disk", chunks, options(OffloadTier::disk), disk_tracker);
  Tensor work({chunk_numel}, DType::f32, MemCategory::workspace, tracker);
  Tensor home({static_cast<int64_t>(chunks.size()) * chunk_numel}, DType::f32, MemCategory::workspace,
              tracker);

  struct Variant {
    const char* name;
    double bytes;
    std::function<void()> pass;
    std::vector<double> times;
  };
  std::vector<Variant> variants = {
      {"memcpy", 2 * state_bytes,
       [&] {
         for (size_t i = 0; i < chunks.size(); ++i) {
           float* h = home.data<float>() + static_cast<int64_t>(i) * chunk_numel;
           std::memcpy(work.raw(), h, work.bytes());
           update(work.data<float>(), chunk_numel, sweeps);
           std::memcpy(h, work.raw(), work.bytes());
         }
       },
       {}},
      {"none", state_bytes, [&] { store_pass(none, sweeps); }, {}},
      {"cpu", 2 * state_bytes, [&] { store_pass(cpu, sweeps); }, {}},
      {"disk", 2 * state_bytes, [&] { store_pass(disk, sweeps); }, {}},
  };
  for (int round = 0; round <= rounds; ++round) {
    for (auto& v : variants) {
      double t = seconds(v.pass);
      if (round > 0) v.times.push_back(t);  // round 0 warms up (page faults, file pages)
    }
  }

  fmt::print("state {} MiB in {} chunks of {} KiB, budget {} MiB, {} update sweep(s), disk file in {}, "
             "{} rounds\n",
             mib, chunks.size(), chunk_kib, budget_mib, sweeps, dir, rounds);
  fmt::print("{:<8} {:>9} {:>9} {:>9} {:>9}\n", "variant", "min s", "median s", "max s", "GB/s");
  for (auto& v : variants) {
    std::sort(v.times.begin(), v.times.end());
    double median = v.times[v.times.size() / 2];
    fmt::print("{:<8} {:>9.4f} {:>9.4f} {:>9.4f} {:>9.2f}\n", v.name, v.times.front(), median,
               v.times.back(), v.bytes / median / 1e9);
  }
  for (auto [store, t] : {std::pair{&cpu, &cpu_tracker}, std::pair{&disk, &disk_tracker}}) {
    OffloadStats s = store->stats();
    fmt::print("{}: acquires ready {} / waited {}, caller waited {:.3f} s, I/O thread busy {:.3f} s, "
               "peak resident {} (budget {})\n",
               offload_tier_name(store->tier()), s.ready_at_acquire, s.waited_at_acquire,
               s.wait_seconds, s.io_seconds, format_bytes(t->peak(MemCategory::optimizer)),
               format_bytes(budget_mib << 20));
  }
  return 0;
}
