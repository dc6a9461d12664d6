// Pipeline stage models in one process: every rank's schedule run against
// the others through an in-memory mailbox gives the single model's loss and
// gradients (by parameter name), for both families, tied and untied, each
// schedule, uneven and explicit layer splits.
#include <gtest/gtest.h>

#include <map>
#include <memory>

#include "meshtrain/backend/cpu/cpu_backend.h"
#include "meshtrain/parallel/pipeline/executor.h"
#include "meshtrain/parallel/pipeline/schedule.h"
#include "meshtrain/util/error.h"
#include "support/tiny_models.h"

namespace meshtrain::pipeline {
namespace {

using testing::CpuModel;

struct Stages {
  MemoryTracker tracker;
  cpu::CpuBackend ctx{1, tracker};
  std::vector<std::unique_ptr<Model>> models;
};

// Runs `kind` over all ranks in this process; returns the loss sum.
double run_in_process(Stages& st, ScheduleKind kind, const PipelineShape& shape,
                      const std::vector<int32_t>& ids, int64_t batch, int64_t seq, float scale) {
  const Schedule schedule = make_schedule(kind, shape);
  const int64_t n = st.models[0]->stage_rows(batch, seq) * st.models[0]->config().dim;
  std::map<int, std::vector<float>> mailbox;  // by tag
  std::vector<std::map<std::tuple<bool, int, int>, std::vector<float>>> outgoing(schedule.size());
  std::vector<size_t> pc(schedule.size(), 0);
  double loss = 0;
  const int64_t rows = batch * seq;
  for (bool progress = true; progress;) {
    progress = false;
    for (size_t r = 0; r < schedule.size(); ++r) {
      Model& model = *st.models[r];
      for (; pc[r] < schedule[r].size(); ++pc[r]) {
        const Action& a = schedule[r][pc[r]];
        if (a.kind == ActionKind::send_recv) {
          for (const Transfer& t : a.transfers) {
            if (t.send) mailbox[t.tag] = outgoing[r][{t.grad, t.chunk, t.micro_batch}];
          }
          continue;
        }
        std::vector<float> in;
        if (a.receive >= 0) {
          const Transfer& t = schedule[r][static_cast<size_t>(a.receive)].transfers[0];
          if (!mailbox.contains(t.tag)) break;
          in = mailbox[t.tag];
        }
        const int32_t* tokens = ids.data() + a.micro_batch * (rows + 1);
        std::vector<float> out(static_cast<size_t>(n));
        if (a.kind == ActionKind::forward) {
          model.stage_forward(a.chunk, a.micro_batch, tokens, in.data(), batch, seq, out.data());
        } else {
          loss += model.stage_backward(a.chunk, a.micro_batch, tokens, tokens + 1, scale,
                                       in.data(), out.data());
        }
        outgoing[r][{a.kind == ActionKind::backward, a.chunk, a.micro_batch}] = std::move(out);
        progress = true;
      }
    }
  }
  for (size_t r = 0; r < schedule.size(); ++r) {
    EXPECT_EQ(pc[r], schedule[r].size()) << "rank " << r << " did not finish";
    EXPECT_EQ(st.models[r]->stage_in_flight(), 0u);
  }
  return loss;
}

struct Case {
  const char* name;
  ModelConfig config;
  ScheduleKind kind;
  PipelineShape shape;
  std::vector<int64_t> split;
};

void check_case(const Case& c) {
  SCOPED_TRACE(c.name);
  const int64_t batch = 2, seq = 8, m = c.shape.micro_batches;
  const uint64_t seed = 5;
  CpuModel whole(c.config, Precision::fp32, 1);
  whole.model.init_weights(seed);
  whole.model.zero_grads();
  // Micro-batch i's tokens start at i * (rows + 1); targets are shifted by one.
  const std::vector<int32_t> ids = testing::random_ids(3, m * (batch * seq + 1), c.config.vocab_size);
  const float scale = 1.0f / static_cast<float>(m * batch * seq);
  double expected = 0;
  for (int64_t i = 0; i < m; ++i) {
    const int32_t* tokens = ids.data() + i * (batch * seq + 1);
    expected += whole.model.forward_backward(tokens, tokens + 1, batch, seq, scale);
  }

  Stages st;
  for (int r = 0; r < c.shape.stages; ++r) {
    st.models.push_back(std::make_unique<Model>(
        c.config, Precision::fp32, st.ctx, ParamStorage::flat, TensorParallel{},
        stage_layers(c.config.n_layers, c.shape, r, c.split)));
    st.models.back()->init_weights(seed);
    st.models.back()->zero_grads();
  }
  const double loss = run_in_process(st, c.kind, c.shape, ids, batch, seq, scale);
  EXPECT_NEAR(loss, expected, 1e-5 * std::abs(expected));

  // Every parameter is on some stage with the single model's values; its
  // gradient equals the single model's (tied: the first and last stages'
  // copies add up to it).
  for (const Parameter& p : whole.model.params()) {
    std::vector<float> grad(static_cast<size_t>(p.spec.numel()), 0.0f);
    int holders = 0;
    for (auto& model : st.models) {
      for (const Parameter& q : model->params()) {
        if (q.spec.name != p.spec.name) continue;
        ++holders;
        for (int64_t i = 0; i < p.spec.numel(); ++i) {
          ASSERT_EQ(q.master.data<float>()[i], p.master.data<float>()[i]) << p.spec.name;
          grad[static_cast<size_t>(i)] += q.grad.data<float>()[i];
        }
      }
    }
    ASSERT_GE(holders, 1) << p.spec.name;
    for (int64_t i = 0; i < p.spec.numel(); ++i) {
      const float want = p.grad.data<float>()[i];
      ASSERT_NEAR(grad[static_cast<size_t>(i)], want, 1e-5f * (std::abs(want) + 1e-3f))
          << p.spec.name << "[" << i << "]";
    }
  }
}

ModelConfig layers(ModelConfig c, int64_t n) {
  c.n_layers = n;
  return c;
}

TEST(Stage, SchedulesMatchTheSingleModel) {
  const ModelConfig llama = layers(testing::tiny_llama(false), 5);
  const ModelConfig tied = layers(testing::tiny_llama(true), 4);
  const ModelConfig gpt2 = layers(testing::tiny_gpt2(), 4);
  for (const Case& c : {
           Case{"llama 1f1b p2 m3 (5 layers)", llama, ScheduleKind::one_f_one_b, {2, 3, 1}, {}},
           Case{"llama gpipe p4 m2", llama, ScheduleKind::gpipe, {4, 2, 1}, {}},
           Case{"llama 1f1b p4 m6 split", llama, ScheduleKind::one_f_one_b, {4, 6, 1}, {2, 1, 1, 1}},
           Case{"llama interleaved p2 m4 v2", llama, ScheduleKind::interleaved, {2, 4, 2}, {}},
           Case{"tied llama 1f1b p2 m1", tied, ScheduleKind::one_f_one_b, {2, 1, 1}, {}},
           Case{"tied llama interleaved p2 m2 v2", tied, ScheduleKind::interleaved, {2, 2, 2}, {}},
           Case{"gpt2 1f1b p3 m4", gpt2, ScheduleKind::one_f_one_b, {3, 4, 1}, {}},
           Case{"gpt2 gpipe p2 m2", gpt2, ScheduleKind::gpipe, {2, 2, 1}, {}},
       }) {
    check_case(c);
  }
}

TEST(Stage, HoldsOnlyItsParametersUnderGlobalNames) {
  const ModelConfig c = layers(testing::tiny_gpt2(), 4);
  MemoryTracker tracker;
  cpu::CpuBackend ctx(1, tracker);
  Model last(c, Precision::fp32, ctx, ParamStorage::flat, {}, StageLayers{{{2, 4}}, false, true});
  std::vector<std::string> units;
  for (const ParamUnit& u : last.units()) units.push_back(u.name);
  EXPECT_EQ(units, (std::vector<std::string>{"embed", "layers.2", "layers.3", "head"}));
  // The tied output layer without the positions; it is another stage's too.
  EXPECT_EQ(last.params()[0].spec.name, "transformer.wte.weight");
  EXPECT_TRUE(last.param_is_duplicate(0));
  EXPECT_EQ(last.params()[1].spec.name, "transformer.h.2.ln_1.weight");
  EXPECT_THROW(last.forward_loss(nullptr, nullptr, 1, 1), Error);
}

TEST(Stage, SplitErrorsNameTheNumbers) {
  auto message = [](int64_t n_layers, int stages, std::vector<int64_t> split) {
    try {
      split_layers(n_layers, stages, split);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message(3, 4, {}).find("n_layers = 3 is fewer than pp x virtual_stages = 4"),
            std::string::npos);
  EXPECT_NE(message(4, 2, {1, 2}).find("sums to 3 layers; the model has n_layers = 4"),
            std::string::npos);
  EXPECT_NE(message(4, 2, {4}).find("has 1 entries; pp x virtual_stages = 2"), std::string::npos);
  const auto ranges = split_layers(5, 2, {});
  EXPECT_EQ(ranges, (std::vector<std::pair<int64_t, int64_t>>{{0, 3}, {3, 5}}));
}

}  // namespace
}  // namespace meshtrain::pipeline
