// The model's tensor-parallel plumbing (Megatron-style): column-parallel
// inputs, row-parallel outputs, their gradients, vocab-parallel embedding and
// loss, and sequence parallelism. With tp = 1 each function is the plain
// single-rank step (same kernels, same numbers).
#include <algorithm>
#include <cmath>

#include "meshtrain/backend/backend.h"
#include "meshtrain/model/model_impl.h"
#include "meshtrain/util/error.h"

namespace meshtrain {

const void* Model::Impl::column_input(const Norm& norm, const Tensor& x, DType dt, Tensor& y,
                                      Tensor& mean, Tensor& rstd, int64_t rows,
                                      MemCategory category) {
  // Sequence parallel: the norm (and what backward keeps) on this rank's rows.
  norm_forward(norm, x, dt, y, mean, rstd, shard_rows(rows), category);
  return all_rows(y, rows, dt);
}

const void* Model::Impl::all_rows(const Tensor& y, int64_t rows, DType dt) {
  if (!sp) return y.raw();
  const int64_t srows = shard_rows(rows), d = cfg.dim;
  ensure(ws.column_input, {rows, d}, dt, MemCategory::workspace);
  ws.column_input.view(tp.rank() * srows * d, {srows, d}).copy_from(y);
  tp_all_gather_rows(tp, ws.column_input.raw(), srows, d, dt);
  return ws.column_input.raw();
}

const float* Model::Impl::row_parallel_sum(const Linear& lin, DType dt, const void* in,
                                           int64_t rows) {
  // Each rank's product over its slice of the inputs is a partial sum.
  const int64_t d = cfg.dim, srows = shard_rows(rows);
  ensure(ws.partial, {rows, d}, DType::f32, MemCategory::workspace);
  ops::MatmulDims dims{.m = rows, .n = lin.out, .k = lin.in, .trans_b = lin.nn_linear};
  backend.matmul(dims, dt, in, linear_weight(lin, dt), DType::f32, ws.partial.data<float>());
  lora_forward(lin, dt, in, rows, ws.partial.data<float>());  // added on tp rank 0 only
  if (!sp) {
    tp_all_reduce_sum(tp, ws.partial.data<float>(), rows * d);
    return ws.partial.data<float>();
  }
  ensure(ws.partial_shard, {srows, d}, DType::f32, MemCategory::workspace);
  tp_reduce_scatter_rows(tp, ws.partial.data<float>(), ws.partial_shard.data<float>(), srows, d);
  return ws.partial_shard.data<float>();
}

void Model::Impl::row_parallel_add(const Linear& lin, DType dt, const void* in, int64_t rows,
                                   const Tensor& residual, Tensor& out) {
  if (!tp.active()) {
    linear_forward(lin, dt, in, rows, out.data<float>(), residual.data<float>());
    return;
  }
  // The bias (replicated) is added once, after the reduction.
  backend.residual_add(residual.data<float>(), row_parallel_sum(lin, dt, in, rows), bias_of(lin),
                       out.data<float>(), shard_rows(rows), cfg.dim);
}

const void* Model::Impl::row_parallel_add_norm(const Linear& lin, DType dt, const void* in,
                                               int64_t rows, const Tensor& residual, Tensor& out,
                                               const Norm& norm, Tensor& y, Tensor& mean,
                                               Tensor& rstd, MemCategory category) {
  if (!tp.active()) {  // the add is the GEMM's (matmul_add)
    row_parallel_add(lin, dt, in, rows, residual, out);
    return column_input(norm, out, dt, y, mean, rstd, rows, category);
  }
  const float* sum = row_parallel_sum(lin, dt, in, rows);
  const int64_t srows = shard_rows(rows);
  const ops::NormArgs args = norm_outputs(norm, dt, y, mean, rstd, srows, category);
  backend.residual_add_norm(residual.data<float>(), sum, bias_of(lin), out.data<float>(), args, dt,
                            y.raw(), srows, cfg.dim);
  return all_rows(y, rows, dt);
}

const float* Model::Impl::reduce_input_grad(int64_t rows) {
  float* dx = ws.dx.data<float>();
  if (!tp.active()) return dx;
  const int64_t d = cfg.dim;
  if (!sp) {
    tp_all_reduce_sum(tp, dx, rows * d);
    return dx;
  }
  const int64_t srows = shard_rows(rows);
  ensure(ws.dx_shard, {srows, d}, DType::f32, MemCategory::workspace);
  tp_reduce_scatter_rows(tp, dx, ws.dx_shard.data<float>(), srows, d);
  return ws.dx_shard.data<float>();
}

const float* Model::Impl::column_parallel_backward(const Linear& lin, DType dt, const void* dy,
                                                   const Tensor& y, int64_t rows, float* scratch) {
  float* dx = ws.dx.data<float>();
  if (!tp.active()) {
    linear_backward(lin, dt, dy, nullptr, y.raw(), rows, dx, scratch);
    return dx;
  }
  const int64_t d = cfg.dim, srows = shard_rows(rows);
  Work gather;
  if (sp) {
    ensure(ws.column_input, {rows, d}, dt, MemCategory::workspace);
    ws.column_input.view(tp.rank() * srows * d, {srows, d}).copy_from(y);
    gather = tp_all_gather_rows_async(tp, ws.column_input.raw(), srows, d, dt);
  }
  linear_backward_input(lin, dt, dy, rows, dx);
  Work reduce;
  const float* out = dx;
  if (sp) {
    ensure(ws.dx_shard, {srows, d}, DType::f32, MemCategory::workspace);
    reduce = tp_reduce_scatter_rows_async(tp, dx, ws.dx_shard.data<float>(), srows, d);
    out = ws.dx_shard.data<float>();
  } else {
    reduce = tp_all_reduce_sum_async(tp, dx, rows * d);
  }
  gather.wait();
  linear_backward_weight(lin, dt, dy, nullptr, sp ? ws.column_input.raw() : y.raw(), rows, scratch);
  reduce.wait();
  return out;
}

const Tensor& Model::Impl::full_residual_grad(int64_t rows) {
  if (!sp) return ws.dres;
  const int64_t d = cfg.dim, srows = shard_rows(rows);
  ensure(ws.dres_full, {rows, d}, DType::f32, MemCategory::workspace);
  ws.dres_full.view(tp.rank() * srows * d, {srows, d}).copy_from(ws.dres);
  tp_all_gather_rows(tp, ws.dres_full.raw(), srows, d, DType::f32);
  return ws.dres_full;
}

float* Model::Impl::norm_grad(size_t param, int slot_index) {
  if (!trains(param)) {
    ensure(ws.discard, {2, cfg.dim}, DType::f32, MemCategory::workspace);
    ws.discard.view(slot_index * cfg.dim, {cfg.dim}).zero();
    return ws.discard.data<float>() + slot_index * cfg.dim;
  }
  if (!sp) return grad(param);
  // A unit has at most two norms with weight and bias (GPT-2 blocks).
  const int64_t d = cfg.dim, capacity = 4 * d;
  ensure(ws.norm_grads, {capacity}, DType::f32, MemCategory::workspace);
  const int64_t offset = pending_norm_grads.empty() ? 0 : pending_norm_grads.back().second + d;
  MESHTRAIN_CHECK(offset + d <= capacity, "model: more norm gradients in one unit than expected");
  ws.norm_grads.view(offset, {d}).zero();
  pending_norm_grads.emplace_back(param, offset);
  return ws.norm_grads.data<float>() + offset;
}

void Model::Impl::flush_norm_grads() {
  if (pending_norm_grads.empty()) return;
  const int64_t d = cfg.dim;
  float* slots = ws.norm_grads.data<float>();
  tp_all_reduce_sum(tp, slots, pending_norm_grads.back().second + d);
  for (const auto& [param, offset] : pending_norm_grads) {
    backend.add_inplace(grad(param), slots + offset, d);
  }
  pending_norm_grads.clear();
}

ops::EmbeddingDims Model::Impl::embedding_dims(int64_t batch, int64_t seq, int64_t pos0,
                                               const int32_t* pos_ids) const {
  ops::EmbeddingDims dims{
      .batch = batch, .seq = seq, .dim = cfg.dim, .pos0 = pos0, .pos_ids = pos_ids};
  if (tp.active()) dims.vocab_begin = vocab_begin, dims.vocab_end = vocab_begin + vocab_valid;
  return dims;
}

void Model::Impl::embed_tokens(const int32_t* tokens, int64_t batch, int64_t seq, int64_t pos0,
                               Tensor& out) {
  const Parameter& table = model.params_[embed];
  // A frozen bf16 / f16 embedding (external storage) may be bound as its compute copy only.
  const Tensor& table_rows = table.master.defined() ? table.master : table.compute;
  const float* wpe = positions != kNoParam ? master(positions) : nullptr;
  const ops::EmbeddingDims dims = embedding_dims(batch, seq, pos0, row_positions);
  const int32_t* ids = upload(ws.tokens, tokens, batch * seq);
  if (!tp.active()) {
    backend.embedding_forward(dims, table_rows.raw(), table_rows.dtype(), wpe, ids,
                              out.data<float>());
    return;
  }
  // Rows of this rank's vocabulary slice (zeros elsewhere), summed over tp.
  const int64_t n = batch * seq, srows = shard_rows(n), d = cfg.dim;
  float* lookup = out.data<float>();
  if (sp) {
    ensure(ws.partial, {n, d}, DType::f32, MemCategory::workspace);
    lookup = ws.partial.data<float>();
  }
  backend.embedding_forward(dims, table_rows.raw(), table_rows.dtype(), nullptr, ids, lookup);
  if (sp) {
    tp_reduce_scatter_rows(tp, lookup, out.data<float>(), srows, d);
  } else {
    tp_all_reduce_sum(tp, lookup, n * d);
  }
  if (wpe == nullptr) return;
  // Then this rank's rows' learned positions: looked up as the ids of a
  // [max_seq, d] table and added.
  const int64_t row0 = sp ? tp.rank() * srows : 0;
  const ops::EmbeddingDims host_dims = embedding_dims(batch, seq, pos0, row_positions_host);
  std::vector<int32_t> row_ids(static_cast<size_t>(srows));
  for (int64_t i = 0; i < srows; ++i) {
    row_ids[static_cast<size_t>(i)] = static_cast<int32_t>(host_dims.position(row0 + i));
  }
  // ws.partial is free again: the lookup is reduced into out.
  ensure(ws.partial, {n, d}, DType::f32, MemCategory::workspace);
  const ops::EmbeddingDims rows_dims{.batch = 1, .seq = srows, .dim = d};
  backend.embedding_forward(rows_dims, wpe, DType::f32, nullptr,
                            upload(ws.position_ids, row_ids.data(), srows),
                            ws.partial.data<float>());
  backend.add_inplace(out.data<float>(), ws.partial.data<float>(), srows * d);
}

void Model::Impl::embed_backward(const int32_t* tokens, int64_t batch, int64_t seq) {
  if (!trains(embed)) return;  // frozen (LoRA freezes positions alike)
  float* dpositions = positions != kNoParam ? grad(positions) : nullptr;
  // Under tp every rank sees all rows' gradients (replicated, or all-gathered
  // under sequence parallelism), so the position gradients are complete everywhere.
  const Tensor& dres = tp.active() ? full_residual_grad(batch * seq) : ws.dres;
  backend.embedding_backward(embedding_dims(batch, seq, 0, row_positions),
                             upload(ws.tokens, tokens, batch * seq), dres.data<float>(),
                             grad(embed), dpositions);
}

double grad_sum_squares(const Model& model) {
  const TensorParallel& tp = model.tensor_parallel();
  const ExpertParallel& ep = model.expert_parallel();
  double dense = 0.0, experts = 0.0;
  const std::vector<Parameter>& params = model.params();
  for (size_t i = 0; i < params.size(); ++i) {
    const Parameter& p = params[i];
    if (!p.spec.trainable || model.param_is_duplicate(i) || !counts_once_over_tp(tp, p.spec)) {
      continue;
    }
    (p.spec.expert ? experts : dense) +=
        model.backend().sum_squares(p.grad.data<float>(), p.spec.numel());
  }
  // The ep group's ranks hold different experts, the same dense gradients.
  if (ep.active()) ep.comm->all_reduce(&experts, 1, CommDType::f64, ReduceOp::sum);
  return tp_sum(tp, dense + experts);
}

double tensor_parallel_grad_norm(const Model& model) { return std::sqrt(grad_sum_squares(model)); }

ops::ClassifierArgs Model::Impl::classifier_args(const void* h, const int32_t* targets,
                                                 int64_t rows, DType dt) {
  ops::ClassifierArgs args;
  args.rows = rows;
  args.dim = cfg.dim;
  args.vocab = vocab_rows;
  args.compute = dt;
  args.h = h;
  args.w = weight(output, dt);
  args.targets = upload(ws.targets, targets, rows);
  if (tp.active()) {
    args.vocab_offset = vocab_begin;
    args.vocab_valid = vocab_valid;
    args.vocab_total = cfg.vocab_size;
    args.reduce_max = [this](float* v, int64_t n) {
      tp.comm->all_reduce(v, n, CommDType::f32, ReduceOp::max);
    };
    args.reduce_sum = [this](float* v, int64_t n) { tp_all_reduce_sum(tp, v, n); };
  }
  return args;
}

}  // namespace meshtrain
