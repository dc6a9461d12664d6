// OffloadStore: the cpu and disk tiers give the none tier's bits, read ahead within
// the budget, keep resident bytes under it, fail with one clear Error, clean up.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <span>

#include "meshtrain/parallel/zero/offload.h"
#include "meshtrain/util/error.h"
#include "meshtrain/util/rng.h"
#include "support/scratch.h"

namespace meshtrain::zero {
namespace {

namespace fs = std::filesystem;
using meshtrain::testing::scratch_dir;

// Odd sizes, so chunks neither match each other nor the file's page alignment.
std::vector<OffloadChunkSpec> mixed_chunks() {
  return {{"embed.exp_avg", 3001}, {"embed.exp_avg_sq", 3001}, {"layers.0.exp_avg", 1237},
          {"layers.0.exp_avg_sq", 1237}, {"layers.1.exp_avg", 4099}, {"layers.1.exp_avg_sq", 4099},
          {"head.exp_avg", 17}, {"head.exp_avg_sq", 17}};
}

OffloadOptions options_for(OffloadTier tier, const std::string& dir, size_t budget) {
  OffloadOptions o;
  o.tier = tier;
  o.directory = dir;
  o.budget_bytes = budget;
  return o;
}

// A permutation of 0..n-1 that depends on `pass` only.
std::vector<size_t> pass_order(size_t n, uint64_t pass) {
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  for (size_t i = n; i > 1; --i) std::swap(order[i - 1], order[mix64(pass * 977 + i) % i]);
  return order;
}

// Fills every chunk with random values outside a pass, runs `passes` passes that update
// chunks (pairs held together, some passes read-only), returns every chunk's final values.
std::vector<std::vector<float>> run_passes(OffloadStore& store, int passes) {
  const size_t n = store.num_chunks();
  for (size_t id = 0; id < n; ++id) {
    float* v = store.acquire(id).data<float>();
    for (int64_t i = 0; i < store.chunk(id).numel; ++i) v[i] = normal_at(stream_key(7, store.chunk(id).name), i);
    store.release(id, true);
  }
  double checksum = 0;
  for (int pass = 0; pass < passes; ++pass) {
    auto order = pass_order(n, static_cast<uint64_t>(pass));
    bool read_only = pass % 5 == 4;
    store.begin_pass(order);
    for (size_t k = 0; k + 1 < n; k += 2) {  // n is even: Adam holds exp_avg and exp_avg_sq
      // Spans, not Tensors: nothing keeps a buffer alive past its release.
      auto as_span = [](const Tensor& t) {
        return std::span<float>(t.data<float>(), static_cast<size_t>(t.numel()));
      };
      std::span<float> a = as_span(store.acquire(order[k]));
      std::span<float> b = as_span(store.acquire(order[k + 1]));
      for (size_t i = 0; i < a.size(); ++i) {
        if (read_only) {
          checksum += a[i];
        } else {
          a[i] = 0.9f * a[i] + 0.1f * static_cast<float>(pass) * b[i % b.size()];
        }
      }
      for (size_t i = 0; i < b.size() && !read_only; ++i) {
        b[i] = 0.999f * b[i] + 1e-3f * a[i % a.size()];
      }
      store.release(order[k], !read_only);
      store.release(order[k + 1], !read_only);
    }
    store.end_pass();
  }
  EXPECT_TRUE(std::isfinite(checksum));
  std::vector<std::vector<float>> out;
  for (size_t id = 0; id < n; ++id) {
    Tensor t = store.acquire(id);
    out.emplace_back(t.data<float>(), t.data<float>() + t.numel());
    store.release(id, false);
  }
  return out;
}

TEST(Offload, TierNames) {
  for (auto tier : {OffloadTier::none, OffloadTier::cpu, OffloadTier::disk}) {
    EXPECT_EQ(parse_offload_tier(offload_tier_name(tier)), tier);
  }
  EXPECT_THROW(parse_offload_tier("nvme"), Error);
}

TEST(Offload, CpuAndDiskEqualNoneBitForBit) {
  auto dir = scratch_dir();
  MemoryTracker tracker;
  OffloadStore reference("opt", mixed_chunks(), options_for(OffloadTier::none, "", 0), tracker);
  auto expected = run_passes(reference, 12);
  // Budget: the two largest chunks plus a little, so read-ahead and spares get exercised.
  size_t budget = 2 * 4099 * 4 + 3001 * 4;
  for (auto tier : {OffloadTier::cpu, OffloadTier::disk}) {
    for (size_t b : {budget, size_t{0}}) {
      SCOPED_TRACE(fmt::format("{} budget {}", offload_tier_name(tier), b));
      OffloadStore store("opt", mixed_chunks(), options_for(tier, dir, b), tracker);
      auto got = run_passes(store, 12);
      ASSERT_EQ(got.size(), expected.size());
      for (size_t id = 0; id < got.size(); ++id) {
        ASSERT_EQ(got[id].size(), expected[id].size());
        EXPECT_EQ(std::memcmp(got[id].data(), expected[id].data(), got[id].size() * 4), 0)
            << store.chunk(id).name;
      }
      auto s = store.stats();
      EXPECT_GT(s.reads, 12u * store.num_chunks());
      EXPECT_GT(s.writes, 9u * store.num_chunks());
    }
  }
}

TEST(Offload, ReadsAheadWithinBudgetAndWritesBehind) {
  auto dir = scratch_dir();
  MemoryTracker tracker;
  std::vector<OffloadChunkSpec> chunks;
  for (int i = 0; i < 8; ++i) chunks.push_back({fmt::format("c{}", i), 1024});
  const size_t chunk = 4096;
  OffloadStore store("ahead", chunks, options_for(OffloadTier::disk, dir, 3 * chunk), tracker);
  std::vector<size_t> order = {5, 1, 7, 0, 2, 6, 3, 4};
  store.begin_pass(order);
  store.wait_idle();
  // Before any acquire the I/O thread has filled the budget, and no more.
  EXPECT_EQ(store.stats().reads, 3u);
  EXPECT_EQ(tracker.live(MemCategory::optimizer), 3 * chunk);
  store.acquire(5).data<float>()[0] = 42.0f;
  store.wait_idle();
  EXPECT_EQ(store.stats().reads, 3u);  // held + 2 ahead = budget
  store.release(5, true);
  store.wait_idle();
  EXPECT_EQ(store.stats().writes, 1u);  // written behind, then its room went to chunk 0
  EXPECT_EQ(store.stats().reads, 4u);
  for (size_t k = 1; k < order.size(); ++k) {
    store.acquire(order[k]);
    store.release(order[k], false);
    store.wait_idle();
  }
  store.end_pass();
  auto s = store.stats();
  EXPECT_EQ(s.ready_at_acquire, 8u);
  EXPECT_EQ(s.waited_at_acquire, 0u);
  EXPECT_EQ(s.reads, 8u);
  EXPECT_EQ(s.writes, 1u);
  EXPECT_EQ(tracker.live(MemCategory::optimizer), 0u);  // buffers go back after the pass
  EXPECT_EQ(store.acquire(5).data<float>()[0], 42.0f);
  store.release(5, false);
}

TEST(Offload, ResidentBytesStayUnderBudget) {
  auto dir = scratch_dir();
  for (auto tier : {OffloadTier::cpu, OffloadTier::disk}) {
    SCOPED_TRACE(offload_tier_name(tier));
    MemoryTracker tracker;
    const size_t budget = 2 * 4099 * 4 + 100;  // just the two largest chunks
    size_t total = 0;
    for (const auto& c : mixed_chunks()) total += static_cast<size_t>(c.numel) * 4;
    {
      OffloadStore store("opt", mixed_chunks(), options_for(tier, dir, budget), tracker);
      EXPECT_EQ(tracker.live(MemCategory::offloaded), total);
      EXPECT_EQ(tracker.live_total(), 0u);  // the slower tier is not working memory
      run_passes(store, 10);
      EXPECT_GT(tracker.peak(MemCategory::optimizer), 4099u * 4);
      EXPECT_LE(tracker.peak(MemCategory::optimizer), budget);
      EXPECT_LE(tracker.peak_total(), budget);
      EXPECT_EQ(tracker.live(MemCategory::optimizer), 0u);
    }
    EXPECT_EQ(tracker.live(MemCategory::offloaded), 0u);
    EXPECT_NE(tracker.report().find("offloaded"), std::string::npos);
  }
}

TEST(Offload, NoneTierHandsOutTheChunkItself) {
  MemoryTracker tracker;
  OffloadStore store("opt", mixed_chunks(), options_for(OffloadTier::none, "", 0), tracker);
  EXPECT_EQ(tracker.live(MemCategory::optimizer), 0u + (2 * (3001 + 1237 + 4099 + 17)) * 4);
  float* first = store.acquire(2).data<float>();
  store.release(2, true);
  store.begin_pass({2, 3});
  EXPECT_EQ(store.acquire(2).data<float>(), first);
  EXPECT_THROW(store.acquire(0), Error);  // out of order
  store.release(2, false);
  store.end_pass();
  EXPECT_EQ(store.stats().reads, 0u);
}

// ZeRO-3's order names a unit's parameter chunk in forward and again in backward:
// the second read waits for the first release, the values written in between come
// back, and the read-ahead still finds most chunks ready. 2-byte chunks keep their size.
TEST(Offload, RepeatedChunksAndTwoByteChunksStreamInOrder) {
  auto dir = scratch_dir();
  MemoryTracker tracker;
  std::vector<OffloadChunkSpec> chunks = {
      {"u0.bf16.compute.0", 1000, DType::bf16}, {"u1.f32.master.0", 1000},
      {"u2.bf16.compute.0", 1000, DType::bf16}, {"u3.f32.master.0", 1000}};
  const size_t budget = 3 * 4000;
  OffloadStore store("params", chunks, options_for(OffloadTier::disk, dir, budget), tracker);
  EXPECT_EQ(tracker.live(MemCategory::offloaded), 2u * 2000 + 2u * 4000);
  for (size_t id = 0; id < chunks.size(); ++id) {
    Tensor t = store.acquire(id);
    EXPECT_EQ(t.dtype(), chunks[id].dtype);
    EXPECT_EQ(t.bytes(), static_cast<size_t>(chunks[id].numel) * dtype_size(chunks[id].dtype));
    std::memset(t.raw(), static_cast<int>(id + 1), t.bytes());
    t = Tensor();
    store.release(id, true);
  }
  // Forward 0..3, backward 2..0 (unit 3 kept), then the next micro-batch's 0.
  const std::vector<size_t> order = {0, 1, 2, 3, 2, 1, 0, 0};
  store.begin_pass(order);
  EXPECT_EQ(store.next_in_pass(), 0u);
  for (size_t k = 0; k < order.size(); ++k) {
    ASSERT_EQ(store.next_in_pass(), order[k]);
    Tensor t = store.acquire(order[k]);
    const auto* bytes = static_cast<const unsigned char*>(t.raw());
    EXPECT_EQ(bytes[0], order[k] + 1 + (k >= 4 && order[k] == 1 ? 10 : 0)) << "position " << k;
    const bool dirty = k == 1;  // the forward changes unit 1 once: backward reads it back
    if (dirty) std::memset(t.raw(), static_cast<int>(order[k] + 11), t.bytes());
    t = Tensor();
    store.release(order[k], dirty);
    store.wait_idle();
  }
  EXPECT_EQ(store.next_in_pass(), OffloadStore::npos);
  store.end_pass();
  const OffloadStats s = store.stats();
  EXPECT_EQ(s.ready_at_acquire + s.waited_at_acquire, order.size());
  EXPECT_GE(s.ready_at_acquire, 6u);
  EXPECT_EQ(s.reads, chunks.size() + order.size());  // the fill outside the pass, then every position
  EXPECT_LE(tracker.peak(MemCategory::optimizer), budget);
  EXPECT_EQ(store.next_in_pass(), OffloadStore::npos);
}

TEST(Offload, ContractErrors) {
  auto dir = scratch_dir();
  MemoryTracker tracker;
  OffloadStore store("opt", mixed_chunks(), options_for(OffloadTier::cpu, dir, 40000), tracker);
  try {
    store.begin_pass({0, 1});
    store.acquire(1);
    FAIL() << "out-of-order acquire accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'embed.exp_avg' next"), std::string::npos) << e.what();
  }
  store.acquire(0);
  EXPECT_THROW(store.end_pass(), Error);  // chunk 0 still held
  store.release(0, false);
  EXPECT_THROW(store.release(0, false), Error);
  EXPECT_THROW(store.begin_pass({99}), Error);
  EXPECT_THROW(store.find("nope"), Error);
  EXPECT_EQ(store.find("head.exp_avg"), 6u);
  // Holding chunks beyond the budget would wait forever: an Error instead.
  store.acquire(4);
  store.acquire(5);
  try {
    store.acquire(0);
    FAIL() << "acquire over the budget accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'embed.exp_avg'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("40000 bytes"), std::string::npos) << e.what();
  }
  store.release(4, false);
  store.release(5, false);
  EXPECT_THROW(OffloadStore("dup", {{"a", 4}, {"a", 4}}, {}, tracker), Error);
  EXPECT_THROW(OffloadStore("empty", {{"a", 0}}, {}, tracker), Error);
}

TEST(Offload, SetupErrorsNameTheCause) {
  auto dir = scratch_dir();
  MemoryTracker tracker;
  auto message = [&](OffloadOptions o, std::vector<OffloadChunkSpec> chunks) {
    try {
      OffloadStore store("opt", std::move(chunks), std::move(o), tracker);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  auto missing = dir + "/missing";
  EXPECT_NE(message(options_for(OffloadTier::disk, missing, 0), mixed_chunks()).find(missing),
            std::string::npos);
  testing::write_file(dir + "/plain", "x");
  EXPECT_NE(message(options_for(OffloadTier::disk, dir + "/plain", 0), mixed_chunks())
                .find("not a directory"),
            std::string::npos);
  EXPECT_NE(message(options_for(OffloadTier::disk, "", 0), mixed_chunks()).find("needs a directory"),
            std::string::npos);
  auto over = message(options_for(OffloadTier::disk, dir, 10000), mixed_chunks());
  EXPECT_NE(over.find("'embed.exp_avg' is 11.72 KiB (12004 bytes), more than the resident budget "
                      "of 9.77 KiB (10000 bytes)"),
            std::string::npos)
      << over;
  // The none tier keeps everything resident: no budget applies.
  EXPECT_EQ(message(options_for(OffloadTier::none, "", 10000), mixed_chunks()), "no error");
  EXPECT_EQ(tracker.live(MemCategory::offloaded), 0u);
  EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator()), 1);  // "plain"
}

TEST(Offload, FilesAreRemoved) {
  auto dir = scratch_dir();
  MemoryTracker tracker;
  {
    OffloadStore a("opt/stage3", mixed_chunks(), options_for(OffloadTier::disk, dir, 0), tracker);
    OffloadStore b("opt/stage3", mixed_chunks(), options_for(OffloadTier::disk, dir, 0), tracker);
    EXPECT_NE(a.file_path(), b.file_path());
    EXPECT_EQ(fs::path(a.file_path()).parent_path(), fs::path(dir));
    EXPECT_EQ(fs::path(a.file_path()).filename().string().rfind("meshtrain-offload-opt_stage3-", 0),
              0u);
    EXPECT_TRUE(fs::exists(a.file_path()));
    EXPECT_GE(fs::file_size(a.file_path()), 2u * (3001 + 1237 + 4099 + 17) * 4);
    a.begin_pass({0, 1, 2});  // destroyed in the middle of a pass
    a.acquire(0);
  }
  EXPECT_TRUE(fs::is_empty(dir));
}

TEST(Offload, ShortReadIsAnErrorNamingTheFile) {
  auto dir = scratch_dir();
  MemoryTracker tracker;
  OffloadStore store("opt", mixed_chunks(), options_for(OffloadTier::disk, dir, 0), tracker);
  fs::resize_file(store.file_path(), 100);  // a file cut short behind the store's back
  try {
    store.acquire(1);
    FAIL() << "short read accepted";
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find(store.file_path()), std::string::npos) << m;
    EXPECT_NE(m.find("'embed.exp_avg_sq'"), std::string::npos) << m;
    EXPECT_NE(m.find("file ends"), std::string::npos) << m;
  }
  EXPECT_THROW(store.begin_pass({3}), Error);  // the store stays unusable
  // The I/O thread's failed read-ahead reaches the caller.
  OffloadStore ahead("ahead", mixed_chunks(), options_for(OffloadTier::disk, dir, 0), tracker);
  fs::resize_file(ahead.file_path(), 100);
  ahead.begin_pass({3, 4});
  EXPECT_THROW(ahead.wait_idle(), Error);  // wait_idle does no I/O itself: the thread read
  EXPECT_THROW(ahead.acquire(3), Error);
  EXPECT_THROW(ahead.end_pass(), Error);
}

// Lowers the file-size limit (writes past it fail with EFBIG) for one scope.
class FileSizeLimit {
 public:
  explicit FileSizeLimit(rlim_t bytes) {
    old_handler_ = ::signal(SIGXFSZ, SIG_IGN);
    ::getrlimit(RLIMIT_FSIZE, &old_);
    rlimit lower = old_;
    lower.rlim_cur = bytes;
    ::setrlimit(RLIMIT_FSIZE, &lower);
  }
  ~FileSizeLimit() {
    ::setrlimit(RLIMIT_FSIZE, &old_);
    ::signal(SIGXFSZ, old_handler_);
  }

 private:
  rlimit old_{};
  sighandler_t old_handler_;
};

TEST(Offload, WriteErrorsReachTheCaller) {
  auto dir = scratch_dir();
  MemoryTracker tracker;
  OffloadStore store("opt", mixed_chunks(), options_for(OffloadTier::disk, dir, 0), tracker);
  OffloadStore behind("behind", mixed_chunks(), options_for(OffloadTier::disk, dir, 0), tracker);
  {
    FileSizeLimit limit(12288);  // chunk 0 ends below the limit, chunk 1 starts at it
    store.acquire(0);
    EXPECT_NO_THROW(store.release(0, true));
    store.acquire(1);
    try {
      store.release(1, true);
      FAIL() << "failed write accepted";
    } catch (const Error& e) {
      std::string m = e.what();
      EXPECT_NE(m.find("writing chunk 'embed.exp_avg_sq'"), std::string::npos) << m;
      EXPECT_NE(m.find(store.file_path()), std::string::npos) << m;
    }
    EXPECT_THROW(store.acquire(0), Error);  // unusable after a failure
    // Written behind on the I/O thread: the failure reaches the caller.
    behind.begin_pass({1});
    behind.acquire(1);
    behind.release(1, true);
    EXPECT_THROW(behind.wait_idle(), Error);
    EXPECT_THROW(behind.end_pass(), Error);
  }
  // Reserving space fails at construction, and leaves no file behind.
  {
    FileSizeLimit limit(4096);
    fs::create_directory(dir + "/sub");
    try {
      OffloadStore big("big", mixed_chunks(), options_for(OffloadTier::disk, dir + "/sub", 0),
                       tracker);
      FAIL() << "reservation past the file-size limit accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("cannot reserve"), std::string::npos) << e.what();
    }
  }
  EXPECT_TRUE(fs::is_empty(dir + "/sub"));
}

}  // namespace
}  // namespace meshtrain::zero
