// A mixture-of-experts feed-forward (config.h MoeConfig), on one rank:
// route (f32 router GEMM, ops router), dispatch (sort by expert, permute),
// the experts as grouped GEMMs over their contiguous rows (grouped_matmul),
// combine with the routing weights; shared experts added, gated or
// not. The backward runs the same steps in reverse and adds the auxiliary
// losses' gradients at the router (they never travel as activations).
#include <fmt/format.h>

#include <algorithm>
#include <numeric>

#include "meshtrain/backend/backend.h"
#include "meshtrain/model/model_impl.h"
#include "meshtrain/util/error.h"
#include "meshtrain/util/trace.h"

namespace meshtrain {

namespace {

// The rows this rank's experts compute: their kept slots (of every rank of
// the ep group under expert parallelism).
int64_t kept_rows(const MoeActs& s) {
  const std::vector<int32_t>& rows = s.exchange.expert_rows;
  return std::accumulate(rows.begin(), rows.end(), int64_t{0});
}

// The rows the experts' buffers hold: every slot at ep 1 (the same size
// whatever the routing), else what the ep group sent (at least one row).
int64_t expert_side_rows(const ExpertParallel& ep, const MoeActs& s, int64_t slots) {
  return ep.active() ? std::max<int64_t>(s.exchange.received(), 1) : slots;
}

// The shared experts' gate, a one-expert sigmoid router: weight = sigmoid(logit).
ops::RouterDims gate_dims(int64_t rows) {
  return ops::RouterDims{.tokens = rows, .experts = 1, .top_k = 1,
                         .score = ops::RouterScore::sigmoid, .renormalize = false};
}

}  // namespace

ops::RouterDims Model::Impl::router_dims(int64_t rows) const {
  const MoeConfig& m = cfg.moe;
  return ops::RouterDims{.tokens = rows, .experts = m.experts, .top_k = m.top_k,
                         .score = m.score, .renormalize = m.renormalize, .scaling = m.scaling,
                         .n_groups = m.n_groups, .topk_groups = m.topk_groups};
}

void Model::Impl::moe_forward(int64_t layer, const Block& b, BlockActs& a, const void* xn2,
                              DType dt, int64_t rows, Tensor& out) {
  const MoeConfig& m = cfg.moe;
  const int64_t d = cfg.dim, E = m.experts, K = m.top_k, I = m.hidden_dim, S = rows * K;
  const MemCategory cat = a.category, wsc = MemCategory::workspace;
  MoeActs& s = a.moe;
  // The router and the dispatch read norm2's output in f32: every row (under
  // tensor parallelism the routed part runs whole on every tp rank, on the
  // rows all tp ranks share; the copy is kept for backward when the block
  // keeps only its own rows: sequence parallelism).
  const float* x32 = static_cast<const float*>(xn2);
  if (dt != DType::f32 || sp) {
    ensure(s.x32, {rows, d}, DType::f32, cat);
    backend.convert(dt, xn2, DType::f32, s.x32.raw(), rows * d);
    x32 = s.x32.data<float>();
  }

  // Route: logits = x W_r^T in f32, then scores, choices and weights.
  trace::Span route("moe", "route", layer);
  ensure(ws.router_logits, {rows, E}, DType::f32, wsc);
  backend.matmul({.m = rows, .n = E, .k = d, .trans_b = true}, DType::f32, x32,
                 master(b.moe.router), DType::f32, ws.router_logits.raw());
  ensure(s.probs, {rows, E}, DType::f32, cat);
  ensure(s.lse, {rows}, DType::f32, cat);
  ensure(s.indices, {rows, K}, DType::i32, cat);
  ensure(s.weights, {rows, K}, DType::f32, cat);
  ops::RouterDims rd = router_dims(rows);
  if (b.moe.selection_bias != kNoParam) rd.bias = master(b.moe.selection_bias);
  backend.router_forward(rd, ws.router_logits.data<float>(), s.probs.data<float>(),
                         s.indices.data<int32_t>(), s.weights.data<float>(), s.lse.data<float>());

  route.end();
  // Dispatch: the rows grouped by expert, their counts on the host for the GEMMs.
  trace::Span dispatch("moe", "dispatch", layer);
  const ops::DispatchDims dd{.tokens = rows, .top_k = K, .experts = E, .dim = d};
  ensure(s.slots, {S}, DType::i32, cat);
  ensure(s.rows, {S}, DType::i32, cat);
  ensure(s.counts, {E}, DType::i32, cat);
  backend.moe_sort(dd, s.indices.data<int32_t>(), s.slots.data<int32_t>(), s.rows.data<int32_t>(),
                   s.counts.data<int32_t>());
  s.counts_host.resize(static_cast<size_t>(E));
  backend.copy_to_host(s.counts, s.counts_host.data());
  s.rows_host = s.counts_host;
  if (const ContextParallel& cp = model.context_parallel(); cp.active() && m.aux_loss > 0 &&
                                                            !m.aux_per_step) {
    // The micro-batch's f_e counts every cp rank's share of its rows.
    s.counts_group = s.counts_host;
    cp.comm->all_reduce(s.counts_group.data(), E, CommDType::i32, ReduceOp::sum);
  }
  if (m.capacity_factor > 0) {
    ensure(s.kept, {E}, DType::i32, cat);
    backend.moe_capacity(dd, m.capacity(rows), s.weights.data<float>(), s.counts.data<int32_t>(),
                         s.slots.data<int32_t>(), s.rows.data<int32_t>(), s.kept.data<int32_t>());
    backend.copy_to_host(s.kept, s.rows_host.data());
  }
  ensure(s.xp, {S, d}, dt, cat);
  backend.moe_permute(dd, s.slots.data<int32_t>(), x32, dt, s.xp.raw());
  // Expert parallelism: the kept rows go to the ranks holding their experts.
  s.exchange = plan_exchange(ep, s.rows_host);
  const int64_t R = expert_side_rows(ep, s, S);
  max_expert_rows = std::max(max_expert_rows, R);
  const void* xe = s.xp.raw();
  if (ep.active()) {
    ensure(s.xe, {R, d}, dt, cat);
    ensure(ws.moe_staging, {R, d}, DType::f32, wsc);
    dispatch_rows(ep, s.exchange, backend, dt, d, s.xp.raw(), ws.moe_staging.raw(), s.xe.raw());
    xe = s.xe.raw();
  }

  dispatch.end();
  // The experts: gate|up, SwiGLU, down, a grouped GEMM over the (local) experts per projection.
  trace::Span experts("moe", "experts", layer);
  ensure(s.pre, {R, 2 * I}, DType::f32, cat);
  ensure(s.y, {S, d}, DType::f32, cat);
  float* ye = s.y.data<float>();
  if (ep.active()) {
    ensure(ws.moe_ye, {R, d}, DType::f32, wsc);
    ye = ws.moe_ye.data<float>();
  }
  const void* w_in = weight(b.moe.experts_in, dt);
  const void* w_out = weight(b.moe.experts_out, dt);
  const std::vector<int32_t>& sizes = s.exchange.expert_rows;
  backend.grouped_matmul({.sizes = sizes, .n = 2 * I, .k = d, .trans_b = true, .max_rows = R}, dt,
                         xe, w_in, DType::f32, s.pre.raw());
  // The activation over the kept rows only (they come first; dropped ones
  // follow); at ep 1 act keeps all S rows, so its size does not depend on the routing.
  const int64_t kept = kept_rows(s);
  ensure(s.act, {R, I}, dt, cat);
  backend.swiglu_forward(s.pre.data<float>(), dt, s.act.raw(), kept, I);
  backend.grouped_matmul({.sizes = sizes, .n = d, .k = I, .trans_b = true, .max_rows = R}, dt,
                         s.act.raw(), w_out, DType::f32, ye);

  experts.end();
  // Combine: the outputs back to their tokens' ranks, out = mid + sum_j w_j y_j.
  trace::Span combine("moe", "combine", layer);
  if (ep.active()) {
    combine_rows(ep, s.exchange, backend, DType::f32, d, ye, ws.moe_staging.raw(), s.y.raw());
  }
  ensure(ws.moe_out, {rows, d}, DType::f32, wsc);
  backend.moe_combine(dd, s.rows.data<int32_t>(), s.weights.data<float>(), s.y.data<float>(),
                      ws.moe_out.data<float>());
  // This rank's rows of the residual stream (all of them but under sequence parallelism).
  const int64_t own = shard_rows(rows), row0 = sp ? tp.rank() * own : 0;
  backend.residual_add(a.mid.data<float>(), ws.moe_out.data<float>() + row0 * d, nullptr,
                       out.data<float>(), own, d);

  combine.end();
  // Shared experts: out += (sigmoid(x w_g) *) down(SwiGLU(gate|up(x))); a
  // tensor-parallel MLP whose row-parallel output is summed over tp here.
  if (b.moe.shared()) {
    trace::Span shared("moe", "shared experts", layer);
    const int64_t hs = m.shared_hidden / tp.size();
    ensure(s.shared_pre, {rows, 2 * hs}, DType::f32, cat);
    linear_forward(b.moe.shared_in, dt, xn2, rows, s.shared_pre.data<float>());
    mlp_activation(s.shared_pre, dt, s.shared_act, rows, hs, cat);
    ensure(s.shared_y, {rows, d}, DType::f32, cat);
    linear_forward(b.moe.shared_out, dt, s.shared_act.raw(), rows, s.shared_y.data<float>());
    if (tp.active()) tp_all_reduce_sum(tp, s.shared_y.data<float>(), rows * d);
    if (b.moe.shared_gate == kNoParam) {
      backend.add_inplace(out.data<float>(), s.shared_y.data<float>() + row0 * d, own * d);
    } else {
      // The gate as a one-expert sigmoid router, applied by a one-choice combine.
      ensure(ws.moe_gate_logits, {rows, 1}, DType::f32, wsc);
      backend.matmul({.m = rows, .n = 1, .k = d, .trans_b = true}, DType::f32, x32,
                     master(b.moe.shared_gate), DType::f32, ws.moe_gate_logits.raw());
      ensure(s.gate_prob, {rows, 1}, DType::f32, cat);
      ensure(s.gate_index, {rows, 1}, DType::i32, cat);
      ensure(s.gate_weight, {rows, 1}, DType::f32, cat);
      backend.router_forward(gate_dims(rows), ws.moe_gate_logits.data<float>(),
                             s.gate_prob.data<float>(), s.gate_index.data<int32_t>(),
                             s.gate_weight.data<float>(), nullptr);
      if (ws.iota.numel() != rows) {
        std::vector<int32_t> iota(static_cast<size_t>(rows));
        std::iota(iota.begin(), iota.end(), 0);
        upload(ws.iota, iota.data(), rows);
      }
      backend.moe_combine({.tokens = rows, .top_k = 1, .experts = 1, .dim = d},
                          ws.iota.data<int32_t>(), s.gate_weight.data<float>(),
                          s.shared_y.data<float>(), ws.moe_out.data<float>());
      backend.add_inplace(out.data<float>(), ws.moe_out.data<float>() + row0 * d, own * d);
    }
  }

  if (counting_routing) {  // the step's routing pass (moe.aux_scope = "step")
    int64_t* step = step_routing.data() + moe_layer_index(layer) * E;
    for (int64_t e = 0; e < E; ++e) step[e] += s.counts_host[static_cast<size_t>(e)];
  }
  if (!recording_moe) return;
  // The routing statistics of this training forward; the load-balancing
  // statistic needs each expert's summed scores, on the host with the counts.
  ensure(ws.moe_prob_sums, {E}, DType::f32, wsc);
  ws.moe_prob_sums.zero();
  backend.bias_backward(s.probs.data<float>(), ws.moe_prob_sums.data<float>(), rows, E);
  s.prob_sums.resize(static_cast<size_t>(E));
  backend.copy_to_host(ws.moe_prob_sums, s.prob_sums.data());
  MoeLayerStats& st = moe_stats[static_cast<size_t>(moe_layer_index(layer))];
  st.micro_batches += 1;
  const BalanceCounts f = balance_counts(layer, s);
  double balance = 0;
  for (int64_t e = 0; e < E; ++e) {
    const auto i = static_cast<size_t>(e);
    st.tokens[i] += s.counts_host[i];
    st.dropped += s.counts_host[i] - s.rows_host[i];
    balance += static_cast<double>(s.prob_sums[i]) * f.counts[i];
  }
  st.aux += balance * static_cast<double>(E) / (static_cast<double>(rows) * f.total);
  st.z += backend.sum_squares(s.lse.data<float>(), rows) / static_cast<double>(rows);
}

int64_t Model::Impl::moe_layer_index(int64_t layer) const {
  auto it = std::find_if(moe_stats.begin(), moe_stats.end(),
                         [layer](const MoeLayerStats& st) { return st.layer == layer; });
  MESHTRAIN_CHECK(it != moe_stats.end(), "model: layer {} has no MoE statistics", layer);
  return it - moe_stats.begin();
}

Model::Impl::BalanceCounts Model::Impl::balance_counts(int64_t layer, const MoeActs& s) const {
  const int64_t E = cfg.moe.experts;
  // The micro-batch's choices (their total is its S = N * top_k slots), or the step's.
  const int64_t* step = cfg.moe.aux_per_step ? step_routing.data() + moe_layer_index(layer) * E
                                             : nullptr;
  BalanceCounts f;
  for (int64_t e = 0; e < E; ++e) {
    const std::vector<int32_t>& mine = s.counts_group.empty() ? s.counts_host : s.counts_group;
    f.counts.push_back(static_cast<double>(step ? step[e] : mine[static_cast<size_t>(e)]));
    f.total += f.counts.back();
  }
  MESHTRAIN_CHECK(f.total > 0, "model: moe.aux_scope = \"step\" but layer {}'s routing of the step "
                  "was not counted (Model::count_routing)", layer);
  return f;
}

const float* Model::Impl::moe_backward(int64_t layer, const Block& b, BlockActs& a, DType dt,
                                       int64_t rows) {
  const MoeConfig& m = cfg.moe;
  const int64_t d = cfg.dim, E = m.experts, K = m.top_k, I = m.hidden_dim, S = rows * K;
  const MemCategory wsc = MemCategory::workspace;
  MoeActs& s = a.moe;
  const float* dy = full_residual_grad(rows).data<float>();  // d(out), every row
  const float* x32 = dt == DType::f32 && !sp ? a.xn2.data<float>() : s.x32.data<float>();
  float* dx = ws.dx.data<float>();  // d(norm2 output), summed below
  // Where the routed part's and the gate's d(x) sum: every row, the same on
  // every tp rank (so never reduced over tp). At tp 1 that is ws.dx itself,
  // after the shared experts' part.
  float* acc = dx;
  const float* reduced = nullptr;  // the shared experts' d(x), reduced over tp: this rank's rows

  // Shared experts, in reverse registry order: gate, down, gate|up. d(x) starts here.
  if (b.moe.shared()) {
    trace::Span shared("moe", "shared experts backward");
    const float* d_shared = dy;
    if (b.moe.shared_gate != kNoParam) {
      ensure(ws.moe_shared_d, {rows, d}, DType::f32, wsc);
      ensure(ws.moe_gate_d, {rows, 1}, DType::f32, wsc);
      const ops::DispatchDims one{.tokens = rows, .top_k = 1, .experts = 1, .dim = d};
      backend.moe_combine_backward(one, ws.iota.data<int32_t>(), s.gate_weight.data<float>(),
                                   s.shared_y.data<float>(), dy, DType::f32,
                                   ws.moe_shared_d.raw(), ws.moe_gate_d.data<float>());
      ensure(ws.moe_gate_logits, {rows, 1}, DType::f32, wsc);
      backend.router_backward(gate_dims(rows), s.gate_prob.data<float>(),
                              s.gate_index.data<int32_t>(), ws.moe_gate_d.data<float>(), {},
                              ws.moe_gate_logits.data<float>());
      backend.matmul({.m = 1, .n = d, .k = rows, .trans_a = true}, DType::f32,
                     ws.moe_gate_logits.raw(), x32, DType::f32, grad(b.moe.shared_gate), 1.0f,
                     true);
      ready(b.moe.shared_gate);
      d_shared = ws.moe_shared_d.data<float>();
    }
    const void* d_shared_c = d_shared;
    if (dt != DType::f32) {
      ensure(ws.dres_c, {rows, d}, dt, wsc);
      backend.convert(DType::f32, d_shared, dt, ws.dres_c.raw(), rows * d);
      d_shared_c = ws.dres_c.raw();
    }
    reduced = ffn_backward(b.moe.shared_in, b.moe.shared_out, dt, d_shared_c, d_shared,
                           s.shared_pre, s.shared_act, a.xn2, rows, m.shared_hidden / tp.size());
    if (tp.active()) {
      ensure(ws.moe_acc, {rows, d}, DType::f32, wsc);
      ws.moe_acc.zero();
      acc = ws.moe_acc.data<float>();
    }
    if (b.moe.shared_gate != kNoParam) {
      backend.matmul({.m = rows, .n = d, .k = 1}, DType::f32, ws.moe_gate_logits.raw(),
                     master(b.moe.shared_gate), DType::f32, acc, 1.0f, true);
    }
  }

  // Combine, in reverse: d(expert outputs) and d(routing weights).
  trace::Span combine("moe", "combine backward");
  const ops::DispatchDims dd{.tokens = rows, .top_k = K, .experts = E, .dim = d};
  ensure(ws.moe_d_y, {S, d}, dt, wsc);
  ensure(ws.moe_d_weights, {rows, K}, DType::f32, wsc);
  backend.moe_combine_backward(dd, s.rows.data<int32_t>(), s.weights.data<float>(),
                               s.y.data<float>(), dy, dt, ws.moe_d_y.raw(),
                               ws.moe_d_weights.data<float>());

  // Expert parallelism: those gradients to the ranks holding their experts.
  const int64_t R = expert_side_rows(ep, s, S);
  const void* d_ye = ws.moe_d_y.raw();
  const void* xe = s.xp.raw();
  float* d_xe = nullptr;
  ensure(ws.moe_d_xp, {S, d}, DType::f32, wsc);
  if (ep.active()) {
    ensure(ws.moe_staging, {R, d}, DType::f32, wsc);
    ensure(ws.moe_d_ye, {R, d}, dt, wsc);
    ensure(ws.moe_d_xe, {R, d}, DType::f32, wsc);
    dispatch_rows(ep, s.exchange, backend, dt, d, ws.moe_d_y.raw(), ws.moe_staging.raw(),
                  ws.moe_d_ye.raw());
    d_ye = ws.moe_d_ye.raw();
    xe = s.xe.raw();
    d_xe = ws.moe_d_xe.data<float>();
  } else {
    d_xe = ws.moe_d_xp.data<float>();
  }

  combine.end();
  // The experts, down then gate|up, a grouped GEMM over the experts for each of d(W) and
  // d(input). Expert gradients sum the whole ep group's tokens: scaled by
  // 1 / ep (expert_parallel.h), so their average over the expert-data-parallel
  // group is the dp average.
  trace::Span experts("moe", "experts backward");
  const float g_scale = 1.0f / static_cast<float>(ep.size());
  ensure(ws.moe_d_act, {R, I}, DType::f32, wsc);
  ensure(ws.moe_d_pre, {R, 2 * I}, dt, wsc);
  const void* w_in = weight(b.moe.experts_in, dt);
  const void* w_out = weight(b.moe.experts_out, dt);
  float* g_in = grad(b.moe.experts_in);
  float* g_out = grad(b.moe.experts_out);
  const std::vector<int32_t>& sizes = s.exchange.expert_rows;
  backend.grouped_matmul({.sizes = sizes, .along_k = true, .m = d, .n = I, .max_rows = R}, dt, d_ye,
                         s.act.raw(), DType::f32, g_out, g_scale, true);
  backend.grouped_matmul({.sizes = sizes, .n = I, .k = d, .max_rows = R}, dt, d_ye, w_out,
                         DType::f32, ws.moe_d_act.raw());
  ready(b.moe.experts_out);
  backend.swiglu_backward(s.pre.data<float>(), ws.moe_d_act.data<float>(), dt, ws.moe_d_pre.raw(),
                          kept_rows(s), I);
  backend.grouped_matmul({.sizes = sizes, .along_k = true, .m = 2 * I, .n = d, .max_rows = R}, dt,
                         ws.moe_d_pre.raw(), xe, DType::f32, g_in, g_scale, true);
  backend.grouped_matmul({.sizes = sizes, .n = d, .k = 2 * I, .max_rows = R}, dt,
                         ws.moe_d_pre.raw(), w_in, DType::f32, d_xe);
  ready(b.moe.experts_in);
  experts.end();
  if (ep.active()) {
    trace::Span back("moe", "dispatch backward exchange");
    combine_rows(ep, s.exchange, backend, DType::f32, d, d_xe, ws.moe_staging.raw(),
                 ws.moe_d_xp.raw());
  }
  if (b.moe.selection_bias != kNoParam) ready(b.moe.selection_bias);  // frozen: no gradient

  // The router, with the auxiliary losses' gradients (weighted like the
  // micro-batch's tokens, aux_weight): load balancing d/dp[t, e] =
  // aux_loss * E * f_e / N, z-loss d/dlogits = 2 z_loss lse softmax / N.
  trace::Span route("moe", "route backward");
  ops::RouterAuxGrad aux;
  const double n = static_cast<double>(rows);
  if (m.aux_loss > 0) {
    std::vector<float> score_grad(static_cast<size_t>(E));
    const BalanceCounts shares = balance_counts(layer, s);
    for (int64_t e = 0; e < E; ++e) {
      const double f = shares.counts[static_cast<size_t>(e)] / shares.total;
      score_grad[static_cast<size_t>(e)] =
          static_cast<float>(m.aux_loss * aux_weight * static_cast<double>(E) * f / n);
    }
    ensure(ws.moe_score_grad, {E}, DType::f32, wsc);
    backend.copy_from_host(score_grad.data(), ws.moe_score_grad);
    aux.score_grad = ws.moe_score_grad.data<float>();
  }
  if (m.z_loss > 0) {
    aux.lse = s.lse.data<float>();
    aux.z = static_cast<float>(2.0 * m.z_loss * aux_weight / n);
  }
  ensure(ws.router_logits, {rows, E}, DType::f32, wsc);
  float* d_logits = ws.router_logits.data<float>();
  backend.router_backward(router_dims(rows), s.probs.data<float>(), s.indices.data<int32_t>(),
                          ws.moe_d_weights.data<float>(), aux, d_logits);
  backend.matmul({.m = E, .n = d, .k = rows, .trans_a = true}, DType::f32, d_logits, x32,
                 DType::f32, grad(b.moe.router), 1.0f, true);
  ready(b.moe.router);
  route.end();

  // d(x): the permuted rows' gradients summed per token, plus the router's (and the shared part).
  trace::Span dispatch("moe", "dispatch backward");
  if (b.moe.shared()) {
    ensure(ws.moe_dx, {rows, d}, DType::f32, wsc);
    backend.moe_permute_backward(dd, s.rows.data<int32_t>(), ws.moe_d_xp.data<float>(),
                                 ws.moe_dx.data<float>());
    backend.add_inplace(acc, ws.moe_dx.data<float>(), rows * d);
  } else {
    backend.moe_permute_backward(dd, s.rows.data<int32_t>(), ws.moe_d_xp.data<float>(), acc);
  }
  backend.matmul({.m = rows, .n = d, .k = E}, DType::f32, d_logits, master(b.moe.router),
                 DType::f32, acc, 1.0f, true);
  // This rank's rows: the routed part's, plus the shared part reduced over tp.
  const int64_t own = shard_rows(rows), row0 = sp ? tp.rank() * own : 0;
  if (reduced == nullptr) return acc + row0 * d;
  if (acc == dx) return dx;  // tp 1: both parts summed in ws.dx
  float* mine = sp ? ws.dx_shard.data<float>() : dx;
  MESHTRAIN_CHECK(mine == reduced, "model: the shared experts' d(input) must land in ws.dx{}",
                  sp ? "_shard" : "");
  backend.add_inplace(mine, acc + row0 * d, own * d);
  return mine;
}

const std::vector<MoeLayerStats>& Model::moe_stats() const { return impl_->moe_stats; }

int64_t Model::max_expert_rows() const { return impl_->max_expert_rows; }

std::vector<int64_t>& Model::step_routing() {
  impl_->step_routing.resize(impl_->moe_stats.size() * static_cast<size_t>(config_.moe.experts));
  return impl_->step_routing;
}

void Model::count_routing(bool on) {
  step_routing();  // sized
  impl_->counting_routing = on;
}

std::vector<float> Model::selection_bias(int64_t layer) const {
  const size_t i = impl_->block(layer).moe.selection_bias;
  if (i == kNoParam) return {};
  std::vector<float> bias(static_cast<size_t>(params_[i].spec.numel()));
  copy_master_to_host(params_[i], bias.data());
  return bias;
}

std::optional<size_t> Model::selection_bias_param(int64_t layer) const {
  const size_t i = impl_->block(layer).moe.selection_bias;
  if (i == kNoParam) return std::nullopt;
  return i;
}

void Model::update_selection_bias(int64_t layer, std::span<const int64_t> tokens) {
  const std::optional<size_t> i = selection_bias_param(layer);
  if (!i) return;
  add_to_master(params_[*i], selection_bias_change(tokens));
}

std::vector<float> Model::selection_bias_change(std::span<const int64_t> tokens) const {
  const auto E = static_cast<int64_t>(tokens.size());
  MESHTRAIN_CHECK(E == config_.moe.experts, "model: {} experts, got {} loads",
                  config_.moe.experts, E);
  const double mean =
      static_cast<double>(std::accumulate(tokens.begin(), tokens.end(), int64_t{0})) /
      static_cast<double>(E);
  // rate * sign(mean - load): an under-loaded expert's bias rises; made zero-mean.
  std::vector<double> delta(static_cast<size_t>(E));
  double shift = 0;
  for (int64_t e = 0; e < E; ++e) {
    const double load = static_cast<double>(tokens[static_cast<size_t>(e)]);
    delta[static_cast<size_t>(e)] = config_.moe.bias_update_rate * ((mean > load) - (mean < load));
    shift += delta[static_cast<size_t>(e)] / static_cast<double>(E);
  }
  std::vector<float> change(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) {
    change[static_cast<size_t>(e)] = static_cast<float>(delta[static_cast<size_t>(e)] - shift);
  }
  return change;
}

void Model::reset_moe_stats() {
  for (MoeLayerStats& st : impl_->moe_stats) {
    st.micro_batches = 0;
    std::fill(st.tokens.begin(), st.tokens.end(), 0);
    st.dropped = 0;
    st.aux = st.z = 0;
  }
}

}  // namespace meshtrain
