// parallel.pp_split: "auto" (the default) balances pipeline stages by the
// planner's FLOP costs, so a big vocabulary's head moves layers off the last
// stage; a tiny vocabulary keeps the count split; "" / "uniform" and explicit
// lists behave as before.
#include <gtest/gtest.h>

#include <numeric>
#include <string>
#include <vector>

#include "meshtrain/parallel/pipeline/executor.h"
#include "meshtrain/plan/pipeline_split.h"
#include "meshtrain/train/config.h"
#include "meshtrain/util/error.h"

namespace meshtrain {
namespace {

TrainConfig config_for(const std::string& preset, int64_t seq, int pp, int virtual_stages,
                       const ConfigOverrides& extra = {}) {
  ConfigOverrides overrides = {{"model.preset", preset},
                               {"train.seq_len", std::to_string(seq)},
                               {"parallel.pp", std::to_string(pp)},
                               {"parallel.virtual_stages", std::to_string(virtual_stages)}};
  overrides.insert(overrides.end(), extra.begin(), extra.end());
  return parse_config("[train]\nsteps = 1\nbatch_size = 8\nmicro_batch_size = 1\n"
                      "[data]\ntrain = \"train.bin\"\n",
                      "run.toml", overrides);
}

// Layers of each rank (chunk j on rank j % pp).
std::vector<int64_t> per_stage(const std::vector<int64_t>& chunks, int pp) {
  return plan::stage_layers(chunks, pp);
}

// The executor's count split ("" / "uniform") as layers per chunk.
std::vector<int64_t> count_split(int64_t layers, int chunks) {
  std::vector<int64_t> n;
  for (const auto& [first, end] : pipeline::split_layers(layers, chunks, {})) n.push_back(end - first);
  return n;
}

TEST(PipelineSplitAuto, IsTheDefault) {
  EXPECT_EQ(config_for("llama-60M", 256, 2, 1).parallel.pp_split, "auto");
}

TEST(PipelineSplitAuto, BigVocabularyMovesLayersOffTheLastStage) {
  // llama-60M: 8 blocks; the tied 50257 x 512 head + loss is ~7 blocks of FLOPs.
  EXPECT_EQ(pp_split_layers(config_for("llama-60M", 256, 2, 1)), (std::vector<int64_t>{7, 1}));
  // pp 4: the head alone outweighs a quarter of the work; the last stage keeps 1 layer.
  const std::vector<int64_t> four = pp_split_layers(config_for("llama-60M", 256, 4, 1));
  ASSERT_EQ(four.size(), 4u);
  EXPECT_EQ(four.back(), 1);
  EXPECT_EQ(std::accumulate(four.begin(), four.end(), int64_t{0}), 8);
  for (int64_t n : four) EXPECT_GE(n, 1);
  // Interleaved (v = 2): four chunks, each >= 1 layer; rank 1 holds the head and
  // the fewest layers.
  const std::vector<int64_t> chunks = pp_split_layers(config_for("llama-60M", 256, 2, 2));
  ASSERT_EQ(chunks.size(), 4u);
  for (int64_t n : chunks) EXPECT_GE(n, 1);
  EXPECT_EQ(per_stage(chunks, 2), (std::vector<int64_t>{6, 2}));
  // The stage layout the engine builds from it.
  const TrainConfig c = config_for("llama-60M", 256, 2, 1);
  const StageLayers last = pipeline::stage_layers(8, {2, 8, 1}, 1, pp_split_layers(c));
  ASSERT_EQ(last.chunks.size(), 1u);
  EXPECT_EQ(last.chunks[0], (std::pair<int64_t, int64_t>{7, 8}));
}

TEST(PipelineSplitAuto, TinyVocabularyKeepsTheCountSplit) {
  // llama-tiny: vocabulary 256, dim 64: the head is ~1/3 of a block.
  for (int64_t layers = 2; layers <= 13; ++layers) {
    for (int pp : {2, 3, 4}) {
      for (int v : {1, 2}) {
        if (layers < pp * v) continue;
        const TrainConfig c =
            config_for("llama-tiny", 32, pp, v, {{"model.n_layers", std::to_string(layers)}});
        const std::vector<int64_t> chunks = pp_split_layers(c);
        const std::vector<int64_t> counted = count_split(layers, pp * v);
        SCOPED_TRACE(testing::Message() << layers << " layers, pp " << pp << ", v " << v);
        ASSERT_EQ(chunks.size(), static_cast<size_t>(pp * v));
        for (int64_t n : chunks) EXPECT_GE(n, 1);
        // Per rank the same layers; within a rank the planner gives the later
        // chunks the remainder, the executor the earlier ones.
        if (v == 1) {
          EXPECT_EQ(chunks, counted);
        }
        EXPECT_EQ(per_stage(chunks, pp), per_stage(counted, pp));
      }
    }
  }
}

TEST(PipelineSplitAuto, EdgeCases) {
  // As many layers as chunks: one each.
  EXPECT_EQ(pp_split_layers(config_for("llama-60M", 256, 4, 2)), std::vector<int64_t>(8, 1));
  EXPECT_EQ(pp_split_layers(config_for("llama-60M", 256, 8, 1)), std::vector<int64_t>(8, 1));
  // Fewer layers than chunks, or no pipeline: the executor's rule (which names
  // the first case as an Error).
  EXPECT_TRUE(pp_split_layers(config_for("llama-60M", 256, 4, 3)).empty());
  EXPECT_THROW(pipeline::split_layers(8, 12, {}), Error);
  EXPECT_TRUE(pp_split_layers(config_for("llama-60M", 256, 1, 1)).empty());
}

TEST(PipelineSplitAuto, UniformAndExplicitSplitsAsBefore) {
  for (const char* uniform : {"", "uniform"}) {
    EXPECT_TRUE(
        pp_split_layers(config_for("llama-60M", 256, 2, 1, {{"parallel.pp_split", uniform}}))
            .empty());
  }
  EXPECT_EQ(pp_split_layers(config_for("llama-60M", 256, 2, 1, {{"parallel.pp_split", "5,3"}})),
            (std::vector<int64_t>{5, 3}));
  try {
    config_for("llama-60M", 256, 2, 1, {{"parallel.pp_split", "7;1"}});
    ADD_FAILURE() << "a malformed list parsed";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("parallel.pp_split"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace meshtrain
