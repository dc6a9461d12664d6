// Llama 3 405B as the Llama 3 paper ran it (table 4): tp 8, pp 16, ZeRO-1-style
// sharding, 16M-token batches on H100s; shared by the scale tests.
#pragma once

#include "meshtrain/plan/models.h"
#include "meshtrain/plan/planner.h"

namespace meshtrain::plan {

struct Llama405b {
  PlanContext ctx;
  Cluster cluster;
  Job job;
};

// seq-token sequences, 16M tokens per step, no checkpoints unless asked for.
inline Llama405b llama405b_at(int64_t seq, int64_t gpus) {
  Llama405b x;
  x.job.seq = seq;
  x.job.global_batch = 16 * 1024 * 1024 / seq;
  x.job.tokens = 1e12;
  x.job.checkpoint_interval_seconds = 0;
  ModelConfig m = plan_model("llama3-405b").config;
  m.max_seq_len = std::max(m.max_seq_len, seq);
  x.ctx = make_context(m, x.job);
  x.cluster = make_cluster(gpu_spec("h100-sxm"), gpus, 8);
  return x;
}

// tp 8 x cp x pp 16 x dp, ZeRO-1, sequence parallel, 1F1B.
inline Layout llama405b_layout(int64_t cp, int64_t dp) {
  Layout l;
  l.tp = 8;
  l.cp = cp;
  l.pp = 16;
  l.dp = dp;
  l.zero = 1;
  l.sequence_parallel = true;
  return l;
}

}  // namespace meshtrain::plan
