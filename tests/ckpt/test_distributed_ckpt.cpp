// Distributed checkpoints: save in one simulated layout, load into every
// other, bit for bit; the manifest; async saves; bounded memory; retention;
// leftovers; the legacy conversion.
#include <gtest/gtest.h>
#include <xxhash.h>

#include <filesystem>

#include "dist_layouts.h"
#include "meshtrain/ckpt/distributed.h"
#include "meshtrain/ckpt/safetensors.h"
#include "util.h"

namespace meshtrain {
namespace {

namespace fs = std::filesystem;
using namespace dist_test;
using testing::read_file;
using testing::scratch_dir;

std::string latest_of(const std::string& out_dir) { return read_file(out_dir + "/latest"); }

// Each layout saves into root/<i>; every rank of every layout loads it, bit for bit.
void expect_cross_loads(const std::string& root, const std::vector<Layout>& layouts) {
  for (size_t s = 0; s < layouts.size(); ++s) {
    const Layout& src = layouts[s];
    const std::string out = root + "/" + std::to_string(s);
    const std::string dir = save_all(out, 3, src);
    ASSERT_EQ(dir, out + "/step_3");
    ASSERT_TRUE(dist_ckpt::is_sharded_checkpoint(dir));
    EXPECT_EQ(latest_of(out), "step_3\n");
    EXPECT_FALSE(fs::exists(out + "/step_3.tmp"));
    dist_ckpt::verify_checkpoint(dir);
    for (const Layout& dst : layouts) {
      for (int r = 0; r < dst.world(); ++r) {
        const ShardMap& map = dst.ranks[static_cast<size_t>(r)];
        MemState state(map.local_numel);
        dist_ckpt::load_checkpoint(dir, map, state);
        EXPECT_TRUE(matches_step(map, state, 3)) << src.name << " -> " << dst.name << " rank " << r;
      }
    }
  }
}

TEST(dist_ckpt, EveryLayoutLoadsIntoEveryOther) {
  expect_cross_loads(scratch_dir(), all_layouts(test_tensors()));
}

TEST(dist_ckpt, FusedViewsLoadIntoPlainLayouts) {
  // c_attn [5, 12] as [5, 3, 4] and its bias [12] as [3, 4], cut over tp 2 in their views.
  const std::vector<layout::GlobalTensor> tensors = {{"h.0.attn.c_attn.weight", {5, 12}, {}},
                                                     {"h.0.attn.c_attn.bias", {12}, {}},
                                                     {"h.0.ln_1.weight", {5}, {}}};
  const Layout fused = fused_tp_layout(tensors, 2);
  EXPECT_EQ(fused.ranks[1].pieces[0].region.view, (Shape{5, 3, 4}));
  const std::string root = scratch_dir();
  expect_cross_loads(root, {single_layout(tensors), fused, zero_layout(fused, 2),
                            tp_layout(tensors, 2, 1), zero_layout(single_layout(tensors), 3)});
  // The manifest keeps the view its regions refer to.
  const dist_ckpt::Manifest m = dist_ckpt::read_manifest(root + "/1/step_3");
  EXPECT_EQ(m.tensors[0].shards[0].region.view, (Shape{5, 3, 4}));
  EXPECT_TRUE(m.tensors[2].shards[0].region.view.empty());
}

TEST(dist_ckpt, SeventyRanksLoadIntoOne) {
  // More rank files than a load keeps open at once.
  const std::string out = scratch_dir();
  const auto tensors = test_tensors();
  const std::string dir = save_all(out, 2, zero_layout(single_layout(tensors), 70));
  EXPECT_EQ(dist_ckpt::read_manifest(dir).files.size(), 70u);
  const Layout single = single_layout(tensors);
  MemState state(single.ranks[0].local_numel);
  dist_ckpt::load_checkpoint(dir, single.ranks[0], state);
  EXPECT_TRUE(matches_step(single.ranks[0], state, 2));
}

TEST(dist_ckpt, ManifestRecordsLayoutMetaShardsAndFiles) {
  const std::string out = scratch_dir();
  const Layout l = tp_layout(test_tensors(), 2, 1);
  const std::string dir = save_all(out, 5, l);
  const dist_ckpt::Manifest m = dist_ckpt::read_manifest(dir);
  EXPECT_EQ(m.step, 5);
  EXPECT_EQ(m.world, 2);
  EXPECT_EQ(m.layout, layout_json(l));
  EXPECT_EQ(m.meta, meta_json(5));
  ASSERT_EQ(m.tensors.size(), 3u);
  EXPECT_EQ(m.tensors[0].name, "model.embed.weight");
  EXPECT_EQ(m.tensors[0].shape, (Shape{7, 5}));
  EXPECT_EQ(m.tensors[0].shards.size(), 6u);  // 2 ranks x 3 states
  const dist_ckpt::ManifestShard& s = m.tensors[0].shards[0];
  EXPECT_EQ(s.file, "rank_0.safetensors");
  EXPECT_EQ(s.key, "master/model.embed.weight#0");
  EXPECT_EQ(s.region.offset, (std::vector<int64_t>{0, 0}));
  EXPECT_EQ(s.region.extent, (std::vector<int64_t>{7, 3}));
  ASSERT_EQ(m.files.size(), 2u);
  for (const auto& f : m.files) EXPECT_EQ(f.bytes, fs::file_size(dir + "/" + f.name));
  // The rank file is plain safetensors: one 1-D f32 tensor per piece and state.
  SafetensorsReader reader(dir + "/rank_1.safetensors");
  EXPECT_EQ(reader.tensors().size(), 9u);
  EXPECT_EQ(reader.info("exp_avg_sq/model.proj.weight#0").shape, (Shape{9}));
  // Only the manifest and the rank files remain.
  size_t entries = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(dir)) ++entries;
  EXPECT_EQ(entries, 3u);

  const std::string text = dist_ckpt::describe_checkpoint(dir, true);
  EXPECT_NE(text.find("model.proj.weight [9, 3] F32"), std::string::npos) << text;
  EXPECT_NE(text.find("rank_1.safetensors"), std::string::npos) << text;
  EXPECT_NE(text.find("all files ok"), std::string::npos) << text;
  EXPECT_NE(text.find("\"world\":2"), std::string::npos) << text;
}

TEST(dist_ckpt, ReadGlobalTensorAssemblesShards) {
  const std::string out = scratch_dir();
  const auto tensors = test_tensors();
  const std::string dir = save_all(out, 2, zero_layout(tp_layout(tensors, 2, 1), 2));
  const dist_ckpt::Manifest m = dist_ckpt::read_manifest(dir);
  for (size_t t = 0; t < tensors.size(); ++t) {
    for (StateKind kind : kKinds) {
      std::vector<float> got(static_cast<size_t>(shape_numel(tensors[t].shape)), -1.0f);
      dist_ckpt::read_global_tensor(m, dir, tensors[t].name, kind, got.data());
      for (size_t i = 0; i < got.size(); ++i) {
        ASSERT_EQ(got[i], global_value(2, kind, t, static_cast<int64_t>(i))) << tensors[t].name;
      }
    }
  }
}

TEST(dist_ckpt, LoadErrorsNameTensorAndFile) {
  const std::string out = scratch_dir();
  const auto tensors = test_tensors();
  const std::string dir = save_all(out, 1, single_layout(tensors));
  auto other = tensors;
  other[2].shape = {9, 4};
  const Layout reshaped = single_layout(other);
  MemState state(reshaped.ranks[0].local_numel);
  EXPECT_ERROR(dist_ckpt::load_checkpoint(dir, reshaped.ranks[0], state), "model.proj.weight",
               "manifest.json");
  other[2] = {"model.extra.weight", {9, 3}, {}};
  const Layout renamed = single_layout(other);
  EXPECT_ERROR(dist_ckpt::load_checkpoint(dir, renamed.ranks[0], state), "model.extra.weight",
               "not in");
}

// Edits dir's manifest and re-seals it with its checksum, as a buggy writer would.
void rewrite_manifest(const std::string& dir, const std::function<void(nlohmann::json&)>& edit) {
  nlohmann::json m = nlohmann::json::parse(read_file(dir + "/manifest.json"));
  m.erase("manifest_xxh3");
  edit(m);
  const std::string text = m.dump();
  m["manifest_xxh3"] = fmt::format("{:016x}", XXH3_64bits(text.data(), text.size()));
  testing::write_file(dir + "/manifest.json", m.dump(1));
}

// The data bytes of dir's rank files (their tensors' elements, headers left out).
uint64_t rank_data_bytes(const std::string& dir) {
  uint64_t bytes = 0;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().extension() != ".safetensors") continue;
    SafetensorsReader reader(e.path().string());
    for (const StTensorInfo& t : reader.tensors()) bytes += static_cast<uint64_t>(t.numel()) * 4;
  }
  return bytes;
}

// A frozen tensor (LoRA's base) has master weights only: no moments are
// saved, loaded or assembled for it, in any layout, sync or async.
TEST(dist_ckpt, FrozenTensorsHaveNoMomentsInAnyLayout) {
  auto tensors = test_tensors(5);
  tensors[0].states = layout::StateSet::master_only();
  tensors[2].states = layout::StateSet::master_only();
  const int64_t frozen = shape_numel(tensors[0].shape) + shape_numel(tensors[2].shape);
  const int64_t trainable = shape_numel(tensors[1].shape);
  const std::string root = scratch_dir();
  const std::vector<Layout> layouts = all_layouts(tensors);
  for (size_t s = 0; s < layouts.size(); ++s) {
    dist_ckpt::SaveOptions options;
    options.async = s % 2 == 1;
    const std::string dir = save_all(root + "/" + std::to_string(s), 3, layouts[s], options);
    ASSERT_FALSE(dir.empty()) << layouts[s].name;
    EXPECT_EQ(rank_data_bytes(dir), static_cast<uint64_t>(frozen + 3 * trainable) * 4)
        << layouts[s].name;
    const dist_ckpt::Manifest saved = dist_ckpt::read_manifest(dir);
    EXPECT_EQ(saved.tensors[0].states, layout::StateSet::master_only());
    EXPECT_EQ(saved.tensors[1].states, layout::StateSet{});
    for (const dist_ckpt::ManifestShard& shard : saved.tensors[2].shards) {
      EXPECT_EQ(shard.state, StateKind::master) << shard.key;
    }
    for (const Layout& dst : layouts) {
      for (const ShardMap& map : dst.ranks) {
        MemState state(map.local_numel);
        dist_ckpt::load_checkpoint(dir, map, state);
        EXPECT_TRUE(matches_step(map, state, 3)) << layouts[s].name << " -> " << dst.name;
        // The frozen tensors' moments were never written (still NaN).
        for (const layout::ShardPiece& p : map.pieces) {
          if (p.tensor == 1) continue;
          EXPECT_TRUE(std::isnan(state.data[1][static_cast<size_t>(p.local_offset)]));
        }
      }
    }
  }
  const std::string dir = root + "/0/step_3";
  std::vector<float> got(static_cast<size_t>(shape_numel(tensors[0].shape)));
  const dist_ckpt::Manifest m = dist_ckpt::read_manifest(dir);
  EXPECT_ERROR(dist_ckpt::read_global_tensor(m, dir, tensors[0].name, StateKind::exp_avg,
                                             got.data()),
               "model.embed.weight", "saved frozen");
  // A layout where the tensor trains needs its moments: refused by name.
  const Layout trains = single_layout(test_tensors(5));
  MemState state(trains.ranks[0].local_numel);
  EXPECT_ERROR(dist_ckpt::load_checkpoint(dir, trains.ranks[0], state), "model.embed.weight",
               "saved frozen");
  const std::string text = dist_ckpt::describe_checkpoint(dir, true);
  EXPECT_NE(text.find("model.embed.weight [35, 5] F32, master; 1 shards"), std::string::npos)
      << text;
  EXPECT_NE(text.find("model.norm.weight [65] F32, master, exp_avg, exp_avg_sq; 3 shards"),
            std::string::npos)
      << text;
}

// Checkpoints written before states were listed hold (zero) moments for every
// tensor and no "states" field: they load, the frozen tensors' moments unread.
TEST(dist_ckpt, CheckpointsWithoutStatesListLoadIntoFrozenLayouts) {
  const std::string out = scratch_dir();
  const std::string dir = save_all(out, 2, zero_layout(single_layout(test_tensors()), 2));
  rewrite_manifest(dir, [](nlohmann::json& m) {
    for (nlohmann::json& t : m["tensors"]) t.erase("states");
  });
  EXPECT_EQ(dist_ckpt::read_manifest(dir).tensors[0].states, layout::StateSet{});
  auto tensors = test_tensors();
  tensors[0].states = layout::StateSet::master_only();
  for (const Layout& dst : {single_layout(tensors), tp_layout(tensors, 2, 1)}) {
    for (const ShardMap& map : dst.ranks) {
      MemState state(map.local_numel);
      dist_ckpt::load_checkpoint(dir, map, state);
      EXPECT_TRUE(matches_step(map, state, 2)) << dst.name;
    }
  }
  rewrite_manifest(dir, [](nlohmann::json& m) { m["tensors"][1]["states"] = {"exp_avg"}; });
  EXPECT_ERROR(dist_ckpt::read_manifest(dir), "manifest.json", "lacks 'master'");
}

TEST(dist_ckpt, ShardsMustTileEveryRegionExactly) {
  const std::string out = scratch_dir();
  const auto tensors = test_tensors();
  const std::string dir = save_all(out, 1, tp_layout(tensors, 3, 0));
  const Layout single = single_layout(tensors);
  MemState state(single.ranks[0].local_numel);
  // proj.weight [9, 3] in three row blocks of 3: point rank 1's master block at
  // rank 0's rows. Element counts still add up; rows 3..5 are now covered by
  // nobody and rows 0..2 twice.
  rewrite_manifest(dir, [](nlohmann::json& m) {
    for (auto& shard : m["tensors"][2]["shards"]) {
      if (shard["file"] == "rank_1.safetensors" && shard["state"] == "master")
        shard["offset"][0] = 0;
    }
  });
  dist_ckpt::verify_checkpoint(dir);  // the files are fine
  EXPECT_ERROR(dist_ckpt::load_checkpoint(dir, single.ranks[0], state), "model.proj.weight",
               "covered twice");
  // Loading only rank 2's rows does not touch the broken part.
  const Layout tp3 = tp_layout(tensors, 3, 0);
  MemState rank2(tp3.ranks[2].local_numel);
  dist_ckpt::load_checkpoint(dir, tp3.ranks[2], rank2);
  EXPECT_TRUE(matches_step(tp3.ranks[2], rank2, 1));
  // A region outside its tensor is refused when the manifest is read.
  rewrite_manifest(dir, [](nlohmann::json& m) { m["tensors"][2]["shards"][0]["offset"][0] = 8; });
  EXPECT_ERROR(dist_ckpt::read_manifest(dir), "manifest.json", "model.proj.weight");
}

TEST(dist_ckpt, ATensorNobodyOwnsIsRefusedAtCommit) {
  const std::string out = scratch_dir();
  Layout l = replicated_layout(test_tensors(), 2);
  l.ranks[0].pieces[1].replica = 1;  // the norm: held by both ranks, written by neither
  const std::string dir = [&] {
    std::vector<std::string> errors(2);
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        dist_ckpt::SaveOptions o;
        o.rank = r;
        o.world = 2;
        // The default 600 s timeout: rank 1 must hear of rank 0's failure, not wait it out.
        dist_ckpt::CheckpointSaver saver(out, o);
        MemState state = state_for(l.ranks[static_cast<size_t>(r)], 1);
        errors[static_cast<size_t>(r)] = ckpt_test::error_of(
            [&] { saver.save(1, l.ranks[static_cast<size_t>(r)], state, {}, {}); });
      });
    }
    for (auto& t : threads) t.join();
    EXPECT_NE(errors[0].find("model.norm.weight"), std::string::npos) << errors[0];
    EXPECT_NE(errors[0].find("hold 0 elements"), std::string::npos) << errors[0];
    EXPECT_NE(errors[1].find("rank 0 failed to commit"), std::string::npos) << errors[1];
    EXPECT_NE(errors[1].find("model.norm.weight"), std::string::npos) << errors[1];
    return out + "/step_1";
  }();
  EXPECT_FALSE(fs::exists(dir));
}

TEST(dist_ckpt, RanksMustAgreeOnTheWorld) {
  const std::string out = scratch_dir();
  const Layout l = tp_layout(test_tensors(), 2, 0);
  std::string errors[2];
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      dist_ckpt::SaveOptions o;
      o.rank = r;
      o.world = 2 + r;  // rank 1 thinks there are 3
      dist_ckpt::CheckpointSaver saver(out, o);
      MemState state = state_for(l.ranks[static_cast<size_t>(r)], 1);
      errors[r] = ckpt_test::error_of(
          [&] { saver.save(1, l.ranks[static_cast<size_t>(r)], state, {}, {}); });
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_NE(errors[0].find("rank_1.done.json: rank 1 saves with world 3, rank 0 with world 2"),
            std::string::npos)
      << errors[0];
  EXPECT_NE(errors[1].find("rank 0 failed to commit"), std::string::npos) << errors[1];
  EXPECT_FALSE(fs::exists(out + "/step_1"));
}

TEST(dist_ckpt, CommitTimesOutNamingMissingRanks) {
  const std::string out = scratch_dir();
  const Layout l = tp_layout(test_tensors(), 3, 0);
  dist_ckpt::SaveOptions options;
  options.world = 3;
  options.commit_timeout_s = 0.2;
  dist_ckpt::CheckpointSaver saver(out, options);
  MemState state = state_for(l.ranks[0], 1);
  EXPECT_ERROR(saver.save(1, l.ranks[0], state, {}, {}), "step_1.tmp", "ranks 1, 2 did not finish");
  EXPECT_FALSE(fs::exists(out + "/step_1"));
  EXPECT_FALSE(fs::exists(out + "/latest"));
}

TEST(dist_ckpt, AsyncSaveCopiesAtTheCallAndMatchesSync) {
  const std::string root = scratch_dir();
  const auto tensors = test_tensors(40000);  // ~3 M elements per state
  const Layout l = single_layout(tensors);
  MemState state = state_for(l.ranks[0], 7);

  MemoryTracker tracker;
  dist_ckpt::SaveOptions options;
  options.async = true;
  options.tracker = &tracker;
  dist_ckpt::CheckpointSaver saver(root + "/async", options);
  const std::string dir = saver.save(7, l.ranks[0], state, layout_json(l), meta_json(7));
  EXPECT_TRUE(saver.pending());
  EXPECT_FALSE(fs::exists(dir + "/manifest.json"));  // still writing
  const size_t staging = 3 * static_cast<size_t>(l.ranks[0].owned_numel()) * 4;
  EXPECT_EQ(tracker.live(MemCategory::workspace), staging);
  for (auto& v : state.data) std::fill(v.begin(), v.end(), 0.0f);  // the copy was taken
  saver.wait();
  EXPECT_FALSE(saver.pending());
  EXPECT_EQ(tracker.peak(MemCategory::workspace), staging);  // written from the copy, no buffer
  // The staging copy is kept for the next save (no allocation at its step boundary).
  EXPECT_EQ(tracker.live(MemCategory::workspace), staging);
  dist_ckpt::verify_checkpoint(dir);
  MemState back(l.ranks[0].local_numel);
  dist_ckpt::load_checkpoint(dir, l.ranks[0], back);
  EXPECT_TRUE(matches_step(l.ranks[0], back, 7));

  const std::string sync_dir = save_all(root + "/sync", 7, l);
  EXPECT_TRUE(read_file(sync_dir + "/rank_0.safetensors") ==
              read_file(dir + "/rank_0.safetensors"));
  auto a = dist_ckpt::read_manifest(dir), b = dist_ckpt::read_manifest(sync_dir);
  EXPECT_EQ(a.files[0].xxh3, b.files[0].xxh3);
}

TEST(dist_ckpt, AsyncErrorsSurfaceInWaitNamingThePath) {
  const std::string root = scratch_dir();
  testing::write_file(root + "/not_a_dir", "x");
  const Layout l = single_layout(test_tensors());
  MemState state = state_for(l.ranks[0], 1);
  dist_ckpt::SaveOptions options;
  options.async = true;
  dist_ckpt::CheckpointSaver saver(root + "/not_a_dir/out", options);
  saver.save(1, l.ranks[0], state, {}, {});
  EXPECT_ERROR(saver.wait(), "not_a_dir/out", "step_1");
  EXPECT_FALSE(saver.pending());
  saver.wait();  // the error is reported once
  // The next save reports its own failure the same way, synchronously too.
  options.async = false;
  dist_ckpt::CheckpointSaver sync(root + "/not_a_dir/out", options);
  EXPECT_ERROR(sync.save(1, l.ranks[0], state, {}, {}), "not_a_dir/out", "step_1");
}

TEST(dist_ckpt, AsyncRanksCalledOneAfterAnother) {
  // Ranks 1..N-1 then 0 in one thread: the async savers write in the background.
  const std::string out = scratch_dir();
  const Layout l = zero_layout(tp_layout(test_tensors(), 2, 0), 2);
  std::vector<std::unique_ptr<dist_ckpt::CheckpointSaver>> savers;
  std::vector<MemState> states;
  for (int r = 0; r < l.world(); ++r)
    states.push_back(state_for(l.ranks[static_cast<size_t>(r)], 4));
  for (int step = 4; step <= 5; ++step) {
    for (int r = l.world() - 1; r >= 0; --r) {
      if (step == 4) {
        dist_ckpt::SaveOptions o;
        o.rank = r;
        o.world = l.world();
        o.async = true;
        savers.push_back(std::make_unique<dist_ckpt::CheckpointSaver>(out, o));
      }
      savers[static_cast<size_t>(l.world() - 1 - r)]->save(step, l.ranks[static_cast<size_t>(r)],
                                                           states[static_cast<size_t>(r)],
                                                           layout_json(l), meta_json(step));
    }
  }
  for (auto& s : savers) s->wait();
  EXPECT_EQ(latest_of(out), "step_5\n");
  const Layout single = single_layout(test_tensors());
  MemState back(single.ranks[0].local_numel);
  dist_ckpt::load_checkpoint(out + "/step_5", single.ranks[0], back);
  EXPECT_TRUE(matches_step(single.ranks[0], back, 4));  // the states were not changed
}

TEST(dist_ckpt, SyncSaveAndLoadStayWithinTheBuffer) {
  const std::string out = scratch_dir();
  const auto tensors = test_tensors(30000);  // ~2.2 M elements per state, ~27 MB in all
  const Layout src = zero_layout(single_layout(tensors), 2);
  const Layout dst = tp_layout(tensors, 2, 1);
  constexpr int64_t kBuffer = 1 << 20;
  dist_ckpt::SaveOptions options;
  options.buffer_bytes = kBuffer;
  std::vector<MemoryTracker> per_rank(2);  // the ranks save at once: one tracker each
  save_all(out, 1, src, options, &per_rank);
  for (const MemoryTracker& t : per_rank) {
    EXPECT_GT(t.peak(MemCategory::workspace), 0u);
    EXPECT_LE(t.peak(MemCategory::workspace), static_cast<size_t>(kBuffer) + 4096);
  }
  MemoryTracker tracker;
  dist_ckpt::verify_checkpoint(out + "/step_1", kBuffer, &tracker);
  for (const ShardMap& map : dst.ranks) {
    MemState state(map.local_numel);
    dist_ckpt::load_checkpoint(out + "/step_1", map, state, kBuffer, true, &tracker);
    EXPECT_TRUE(matches_step(map, state, 1));
  }
  EXPECT_GT(tracker.peak(MemCategory::workspace), 0u);
  EXPECT_LE(tracker.peak(MemCategory::workspace), static_cast<size_t>(kBuffer) + 4096);
  EXPECT_EQ(tracker.live(MemCategory::workspace), 0u);
}

TEST(dist_ckpt, KeepLastRetiresTheOldest) {
  const std::string out = scratch_dir();
  const Layout l = tp_layout(test_tensors(), 2, 0);
  dist_ckpt::SaveOptions options;
  options.keep_last = 2;
  for (int step = 1; step <= 5; ++step) save_all(out, step * 10, l, options);
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(out)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"latest", "step_40", "step_50"}));
  EXPECT_EQ(latest_of(out), "step_50\n");
}

TEST(dist_ckpt, LeftoversOfKilledSavesAreRemovedNeverRead) {
  const std::string out = scratch_dir();
  const Layout l = tp_layout(test_tensors(), 2, 1);
  save_all(out, 1, l);
  // Killed saves of step 9 and of the step about to be saved, the latter with
  // a stale open.json that rank 1 will follow before rank 0 starts.
  testing::write_file(out + "/latest.tmp.999999", "step_9\n");  // a killed rewrite of latest
  for (const char* name : {"step_9.tmp", "step_2.tmp", "step_1.trash"}) {
    fs::create_directories(out + "/" + name);
    testing::write_file(out + "/" + name + "/rank_1.safetensors", "junk");
  }
  const std::string stale = "0123456789abcdef";
  testing::write_file(out + "/step_2.tmp/open.json",
                      R"({"step": 2, "save_id": ")" + stale + R"("})");

  dist_ckpt::SaveOptions o1;
  o1.rank = 1;
  o1.world = 2;
  o1.async = true;
  dist_ckpt::CheckpointSaver rank1(out, o1);
  MemState state1 = state_for(l.ranks[1], 2);
  rank1.save(2, l.ranks[1], state1, {}, {});
  // Rank 1 writes under the stale id first...
  const std::string done1 = out + "/step_2.tmp/rank_1.done.json";
  for (int i = 0; i < 2000 && read_file(done1).find(stale) == std::string::npos; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_NE(read_file(done1).find(stale), std::string::npos);
  // ...then rank 0 replaces the directory; rank 1 writes again under the new id.
  dist_ckpt::SaveOptions o0;
  o0.world = 2;
  dist_ckpt::CheckpointSaver rank0(out, o0);
  MemState state0 = state_for(l.ranks[0], 2);
  rank0.save(2, l.ranks[0], state0, {}, {});
  rank1.wait();
  EXPECT_NE(dist_ckpt::read_manifest(out + "/step_2").save_id, stale);
  EXPECT_FALSE(fs::exists(out + "/step_9.tmp"));
  EXPECT_FALSE(fs::exists(out + "/step_2.tmp"));
  EXPECT_FALSE(fs::exists(out + "/step_1.trash"));
  EXPECT_FALSE(fs::exists(out + "/latest.tmp.999999"));
  dist_ckpt::verify_checkpoint(out + "/step_2");
  for (const ShardMap& map : l.ranks) {
    MemState state(map.local_numel);
    dist_ckpt::load_checkpoint(out + "/step_2", map, state);
    EXPECT_TRUE(matches_step(map, state, 2));
  }
}

TEST(dist_ckpt, SavingTheSameStepAgainReplacesIt) {
  const std::string out = scratch_dir();
  const Layout l = single_layout(test_tensors());
  save_all(out, 3, l);
  MemState state = state_for(l.ranks[0], 8);  // other values under the same step
  dist_ckpt::CheckpointSaver saver(out, {});
  saver.save(3, l.ranks[0], state, {}, meta_json(3));
  MemState back(l.ranks[0].local_numel);
  dist_ckpt::load_checkpoint(out + "/step_3", l.ranks[0], back);
  EXPECT_TRUE(matches_step(l.ranks[0], back, 8));
  EXPECT_FALSE(fs::exists(out + "/step_3.tmp"));
}

// A checkpoint of today's format, written as train/checkpoint.cpp does.
void write_legacy(const std::string& dir, const std::vector<layout::GlobalTensor>& tensors) {
  std::vector<std::vector<float>> values[layout::kStateKinds];
  const char* files[] = {"model.safetensors", "exp_avg.safetensors", "exp_avg_sq.safetensors"};
  for (StateKind kind : kKinds) {
    auto& per_tensor = values[static_cast<size_t>(kind)];
    SafetensorsWriter writer;
    for (size_t t = 0; t < tensors.size(); ++t) {
      per_tensor.emplace_back(static_cast<size_t>(shape_numel(tensors[t].shape)));
      for (size_t i = 0; i < per_tensor.back().size(); ++i) {
        per_tensor.back()[i] = global_value(6, kind, t, static_cast<int64_t>(i));
      }
    }
    for (size_t t = 0; t < tensors.size(); ++t) {
      writer.add(tensors[t].name, StDType::F32, tensors[t].shape, per_tensor[t].data());
    }
    writer.set_metadata("format", kind == StateKind::master ? "meshtrain" : "meshtrain-adamw");
    writer.write(dir + "/" + files[static_cast<size_t>(kind)]);
  }
  testing::write_file(dir + "/train_state.json",
                      R"({"format": "meshtrain-train-state", "version": 1, "step": 6,
                          "optimizer_step": 6, "sampler": {"epoch": 0, "index": 48}, "seed": 5,
                          "config": {"model": {"dim": 8}}})");
}

TEST(dist_ckpt, LegacyCheckpointConvertsAndReshards) {
  const std::string root = scratch_dir();
  const auto tensors = test_tensors(3);
  fs::create_directories(root + "/old/step_6");
  write_legacy(root + "/old/step_6", tensors);
  EXPECT_TRUE(dist_ckpt::is_legacy_checkpoint(root + "/old/step_6"));
  EXPECT_FALSE(dist_ckpt::is_sharded_checkpoint(root + "/old/step_6"));

  MemoryTracker tracker;
  dist_ckpt::convert_legacy_checkpoint(root + "/old/step_6", root + "/new/step_6", 256, &tracker);
  EXPECT_LE(tracker.peak(MemCategory::workspace), 256u);
  const std::string dir = root + "/new/step_6";
  EXPECT_FALSE(dist_ckpt::is_legacy_checkpoint(dir));
  dist_ckpt::verify_checkpoint(dir);
  const dist_ckpt::Manifest m = dist_ckpt::read_manifest(dir);
  EXPECT_EQ(m.step, 6);
  EXPECT_EQ(m.meta["sampler"]["index"], 48);
  EXPECT_EQ(m.meta["config"]["model"]["dim"], 8);
  EXPECT_EQ(m.layout["dp"], 1);
  EXPECT_EQ(m.layout["tp"], 1);
  ASSERT_EQ(m.files.size(), 1u);
  for (const Layout& l : {tp_layout(tensors, 2, 1), zero_layout(single_layout(tensors), 2)}) {
    for (const ShardMap& map : l.ranks) {
      MemState state(map.local_numel);
      dist_ckpt::load_checkpoint(dir, map, state);
      EXPECT_TRUE(matches_step(map, state, 6)) << l.name;
    }
  }
  EXPECT_ERROR(dist_ckpt::convert_legacy_checkpoint(root + "/old/step_6", dir), dir,
               "already exists");
  EXPECT_ERROR(dist_ckpt::convert_legacy_checkpoint(dir, root + "/x"), dir, "not a whole-tensor");
}

}  // namespace
}  // namespace meshtrain
