// Shared pieces of the tensor-parallel tests: test shapes whose heads divide
// by 4 and whose vocabulary (37) divides by neither 2 nor 4, the single-rank
// reference, and a tp x dp run of the same global batches on a DeviceMesh.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "meshtrain/backend/cpu/cpu_backend.h"
#include "meshtrain/comm/mesh.h"
#include "meshtrain/optim/adamw.h"
#include "meshtrain/optim/clip.h"
#include "meshtrain/parallel/ddp/ddp.h"
#include "meshtrain/parallel/zero/sharded.h"
#include "mpi_test.h"
#include "support/tiny_models.h"
#include "zero_mpi/zero_run.h"

namespace meshtrain::testing {

// Llama with grouped-query attention (8 query heads over 4 kv heads).
inline ModelConfig tp_llama(bool tied) {
  ModelConfig c = tiny_config(Family::llama, {.n_heads = 8, .n_kv_heads = 4, .hidden_dim = 24,
                                              .vocab_size = 37, .max_seq_len = 16, .tied = tied});
  c.rope_theta = 100.0f;
  return c;
}

inline ModelConfig tp_gpt2() {
  return tiny_config(Family::gpt2, {.n_heads = 4, .n_kv_heads = 4, .hidden_dim = 32,
                                    .vocab_size = 37, .max_seq_len = 16, .tied = true});
}

// Qwen3's and Qwen2's attention options on the tp Llama: QK-norm per head
// (replicated weights whose gradients sum the heads of every tp rank) with a
// head width of 6, not dim / n_heads; q/k/v biases (split like their rows).
inline ModelConfig tp_qwen3() {
  ModelConfig c = tp_llama(false);
  c.qk_norm = QkNorm::head;
  c.head_width = 6;
  return c;
}

inline ModelConfig tp_qwen2() {
  ModelConfig c = tp_llama(false);
  c.qkv_bias = true;
  return c;
}

// Mistral's sliding window, 3 of the 8 positions.
inline ModelConfig tp_mistral() {
  ModelConfig c = tp_llama(false);
  c.sliding_window = 3;
  return c;
}

struct TpCase {
  ModelConfig model;
  const char* name;
};

inline std::vector<TpCase> tp_cases() {
  return {{tp_llama(false), "llama untied"},
          {tp_llama(true), "llama tied"},
          {tp_gpt2(), "gpt2"},
          {tp_qwen3(), "qwen3 attention"},
          {tp_qwen2(), "qwen2 attention"},
          {tp_mistral(), "mistral sliding window"}};
}

// The tp sizes a world of `world` ranks can run (dp = world / tp).
inline std::vector<int> tp_sizes(int world) {
  std::vector<int> out;
  for (int tp : {2, 4}) {
    if (tp <= world && world % tp == 0) out.push_back(tp);
  }
  return out;
}

struct TpRunSpec {
  ModelConfig model = tp_llama(false);
  Precision precision = Precision::fp32;
  int tp = 2;
  bool sequence_parallel = false;
  int zero = 0;  // 0: flat model (+ DDP when dp > 1); 1..3: ZeRO stage on the dp axis
  int steps = 1;
  int64_t global_rows = 8;  // divisible by dp 1, 2, 4
  int64_t seq = 8;
  uint64_t seed = 11;
  float lr = 3e-3f, max_norm = 0.5f;
  bool perturb = false;  // perturb_norms_and_biases after init (flat storage only)
};

struct TpRunResult {
  std::vector<double> losses, norms;  // per step: global mean loss, gradient norm
  std::vector<float> grads;           // after the first step's backward (flat, full layout)
  std::vector<float> master;          // after the last step (full layout)
};

// Rows [row0, row0 + rows) of step's global batch (the ZeRO tests' batches).
inline void tp_batch(const TpRunSpec& s, int step, int64_t row0, int64_t rows,
                     std::vector<int32_t>& inputs, std::vector<int32_t>& targets) {
  global_batch_rows(step, s.global_rows, s.seq, s.model.vocab_size, row0, rows, inputs, targets);
}

// Moves norm weights and biases (flat storage) off their ones/zeros, by
// (name, global index), so a slice gets the slice of the tp = 1 change.
inline void perturb_norms_and_biases(Model& model, uint64_t seed) {
  for (Parameter& p : model.params()) {
    if (p.spec.init == InitKind::normal) continue;
    const uint64_t key = stream_key(seed, "tp-test-perturbation:" + p.spec.name);
    float* v = p.master.data<float>();
    for_each_local_run(p.spec.split, [&](int64_t local, int64_t global, int64_t n) {
      for (int64_t i = 0; i < n; ++i) v[local + i] += 0.2f * normal_at(key, static_cast<uint64_t>(global + i));
    });
  }
  model.sync_compute_weights();
}

inline std::vector<float> tensor_values(const Tensor& t) {
  return std::vector<float>(t.data<float>(), t.data<float>() + t.numel());
}

// The single-rank run: flat model, AdamW, global-norm clipping.
inline TpRunResult tp_reference(const TpRunSpec& s) {
  CpuModel m(s.model, s.precision, 1);
  m.model.init_weights(s.seed);
  if (s.perturb) perturb_norms_and_biases(m.model, s.seed);
  AdamW optimizer(m.model, test_adamw());
  const auto tokens = static_cast<double>(s.global_rows * s.seq);
  TpRunResult r;
  std::vector<int32_t> in, tg;
  for (int step = 0; step < s.steps; ++step) {
    m.model.zero_grads();
    tp_batch(s, step, 0, s.global_rows, in, tg);
    const double loss = m.model.forward_backward(in.data(), tg.data(), s.global_rows, s.seq,
                                                 static_cast<float>(1.0 / tokens));
    if (step == 0) r.grads = tensor_values(m.model.flat_grad());
    const double norm = global_grad_norm(m.model);
    optimizer.step(s.lr, clip_factor(norm, s.max_norm));
    r.losses.push_back(loss / tokens);
    r.norms.push_back(norm);
  }
  r.master = tensor_values(m.model.flat_master());
  return r;
}

// A tp x dp run over the world: every rank of a tp group takes its dp rank's
// rows. Full-layout results on every rank.
struct TpTrainer {
  TpTrainer(Communicator& world, const TpRunSpec& spec)
      : s(spec), mesh(world, spec.tp, 1), tp{&mesh.tp(), spec.sequence_parallel},
        ctx(1, tracker),
        model(spec.model, spec.precision, ctx,
              spec.zero > 0 ? ParamStorage::external : ParamStorage::flat, tp) {
    const int dp = mesh.layout().dp();
    if (s.zero > 0) {
      zero::ZeroOptions options;
      options.stage = s.zero;
      zero = std::make_unique<zero::ShardedDataParallel>(model, mesh.replicas(), test_adamw(), options);
      zero->init_weights(s.seed);
    } else {
      model.init_weights(s.seed);
      if (s.perturb) perturb_norms_and_biases(model, s.seed);
      optimizer = std::make_unique<AdamW>(model, test_adamw());
      if (dp > 1) {
        ddp = std::make_unique<DistributedDataParallel>(model, mesh.replicas(), DdpOptions{});
      }
    }
  }

  // One optimizer step; returns the global mean loss.
  double step(int k) {
    const int dp = mesh.layout().dp();
    const int64_t rows = s.global_rows / dp;
    std::vector<int32_t> in, tg;
    tp_batch(s, k, mesh.coord().dp * rows, rows, in, tg);
    // Gradients averaged over dp: each rank's loss is the mean over its tokens.
    const auto scale = static_cast<float>(1.0 / static_cast<double>(rows * s.seq));
    double loss = 0, norm = 0;
    if (zero) {
      zero->begin_micro_batch(true, true);
      loss = model.forward_backward(in.data(), tg.data(), rows, s.seq, scale);
      zero->finish_gradient_sync();
      norm = zero->grad_norm();
      zero->step(s.lr, clip_factor(norm, s.max_norm));
    } else {
      model.zero_grads();
      if (ddp) ddp->begin_micro_batch(true);
      loss = model.forward_backward(in.data(), tg.data(), rows, s.seq, scale);
      if (ddp) ddp->finish_gradient_sync();
      if (k == 0) first_grads = full(model.flat_grad());
      norm = tensor_parallel_grad_norm(model);
      optimizer->step(s.lr, clip_factor(norm, s.max_norm));
    }
    mesh.replicas().all_reduce(&loss, 1, CommDType::f64, ReduceOp::sum);
    norms.push_back(norm);
    return loss / static_cast<double>(s.global_rows * s.seq);
  }

  // A flat local tensor in the full (tp = 1) layout, on every rank.
  std::vector<float> full(const Tensor& local) {
    const std::vector<TensorSplit> splits = model.param_splits();
    std::vector<float> out(static_cast<size_t>(full_flat_numel(splits)));
    gather_tp_flat(tp, splits, local.data<float>(), out.data());
    return out;
  }

  // This rank's master weights (its slices, local flat layout).
  Tensor local_master() {
    Tensor local({model.num_params()}, DType::f32, MemCategory::workspace, tracker);
    if (!zero) {
      local.copy_from(model.flat_master());
      return local;
    }
    zero->gather_full(zero::ShardedDataParallel::State::master, 0, local.data<float>());
    // gather_full fills rank 0 of the dp group only; share it with the group.
    mesh.replicas().broadcast(local.raw(), local.numel(), CommDType::f32, 0);
    return local;
  }

  // The master weights in the full layout, on every rank.
  std::vector<float> full_master() { return full(local_master()); }

  // The values of the parameters replicated over tp, as this rank holds them.
  std::vector<float> replicated_values() {
    const Tensor local = local_master();
    std::vector<float> out;
    for (const Parameter& p : model.params()) {
      if (p.spec.split.split()) continue;
      const float* v = local.data<float>() + p.offset;
      out.insert(out.end(), v, v + p.spec.numel());
    }
    return out;
  }

  TpRunResult run() {
    TpRunResult r;
    for (int k = 0; k < s.steps; ++k) r.losses.push_back(step(k));
    r.norms = norms;
    r.grads = first_grads;
    r.master = full_master();
    return r;
  }

  TpRunSpec s;
  MemoryTracker tracker;
  DeviceMesh mesh;
  TensorParallel tp;
  cpu::CpuBackend ctx;
  Model model;
  std::unique_ptr<AdamW> optimizer;
  std::unique_ptr<DistributedDataParallel> ddp;
  std::unique_ptr<zero::ShardedDataParallel> zero;
  std::vector<double> norms;
  std::vector<float> first_grads;
};

// max |a - b| over a parameter's elements <= tol * max |b| (each parameter of
// the full layout of `config`).
// skip: parameters not compared (by name suffix).
inline void expect_close_per_param(const ModelConfig& config, const std::vector<float>& got,
                                   const std::vector<float>& want, double tol, const char* what,
                                   const std::string& skip = "") {
  ASSERT_EQ(got.size(), want.size()) << what;
  int64_t offset = 0;
  for (const ParamSpec& spec : build_param_specs(config)) {
    if (!skip.empty() && spec.name.ends_with(skip)) {
      offset += spec.numel();
      continue;
    }
    double diff = 0, scale = 0;
    for (int64_t i = offset; i < offset + spec.numel(); ++i) {
      diff = std::max(diff, std::fabs(static_cast<double>(got[i]) - want[i]));
      scale = std::max(scale, std::fabs(static_cast<double>(want[i])));
    }
    EXPECT_LE(diff, tol * std::max(scale, 1e-30)) << what << " " << spec.name << " (max |ref| " << scale << ")";
    offset += spec.numel();
  }
}

inline void expect_rel(double got, double want, double tol, const std::string& what) {
  EXPECT_LE(std::fabs(got - want), tol * std::fabs(want)) << what << ": " << got << " vs " << want;
}

}  // namespace meshtrain::testing
