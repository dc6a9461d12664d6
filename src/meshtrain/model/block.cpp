// The transformer block's explicit forward and backward, shared by both
// families: a family is a choice of norm (RMSNorm / LayerNorm + bias), weight
// layout (nn.Linear / Conv1D), biases, activation (SwiGLU / GELU) and RoPE.
#include <algorithm>

#include "meshtrain/backend/cpu/activation.h"
#include "meshtrain/backend/cpu/matmul.h"
#include "meshtrain/backend/cpu/norm.h"
#include "meshtrain/model/model_impl.h"
#include "meshtrain/util/error.h"

namespace meshtrain {

namespace {

// Registry slots within one block (see params.cpp for the order).
namespace llama_slot {
enum : size_t { in_norm, q, k, v, o, post_norm, gate, up, down, count };
}
namespace gpt2_slot {
enum : size_t { ln1_w, ln1_b, attn_w, attn_b, attn_proj_w, attn_proj_b, ln2_w, ln2_b, fc_w, fc_b,
                proj_w, proj_b, count };
}

}  // namespace

Model::Impl::Impl(Model& owner)
    : model(owner), cfg(owner.config_), ctx(owner.ctx_), tp(owner.tp_) {
  const size_t layers = static_cast<size_t>(cfg.n_layers);
  const int64_t n = tp.size();
  sp = tp.active() && tp.sequence_parallel;
  heads = cfg.n_heads / n;
  kv_heads = cfg.n_kv_heads / n;
  hidden = cfg.hidden_dim / n;
  // Slots by global registry index, then this stage's.
  size_t end = 0, untied_output = kNoParam;
  if (cfg.family == Family::llama) {
    has_rope = true;
    rope = cpu::make_rope_table(cfg.head_dim(), cfg.max_seq_len, cfg.rope_frequencies(),
                                ctx.tracker());
    end = 1 + layers * llama_slot::count;
    final_norm = Norm{local(end), kNoParam};
    if (!cfg.tie_embeddings) untied_output = end + 1;
  } else {
    positions = local(1);
    end = 2 + layers * gpt2_slot::count;
    final_norm = Norm{local(end), local(end + 1)};
  }
  tied = untied_output == kNoParam;
  embed = local(0);
  output = tied ? embed : local(untied_output);
  // Units: embed (first stage, or a tied last stage's output layer), this
  // stage's layers, head (last stage).
  unit_of_layer.assign(layers, kNoUnit);
  embed_unit = head_unit = kNoUnit;
  for (size_t u = 0; u < model.units_.size(); ++u) {
    const std::string& name = model.units_[u].name;
    int64_t layer = -1;
    if (name == "embed") {
      embed_unit = u;
    } else if (name == "head") {
      head_unit = u;
    } else {
      layer = std::stoll(name.substr(name.find('.') + 1));
      unit_of_layer[static_cast<size_t>(layer)] = u;
    }
    layer_of_unit.push_back(layer);
  }
  // The embedding and the output layer split the vocabulary alike.
  const size_t vocab_param = embed != kNoParam ? embed : output;
  if (vocab_param == kNoParam) return;  // a middle stage
  const TensorSplit& vocab = model.params_[vocab_param].spec.split;
  vocab_rows = model.params_[vocab_param].spec.shape[0];
  vocab_begin = vocab.split() ? static_cast<int64_t>(tp.rank()) * vocab.chunk() : 0;
  vocab_valid = vocab.split() ? vocab.chunk_valid() : cfg.vocab_size;
  if (head_unit == kNoUnit) return;
  // The slots above must agree with the registry.
  MESHTRAIN_CHECK(model.params_[final_norm.weight].spec.shape == Shape{cfg.dim} &&
                      model.params_[output].spec.split.global_shape ==
                          (Shape{cfg.vocab_size, cfg.dim}) &&
                      model.units_.size() == head_unit + 1 &&
                      model.units_[head_unit].first_param == final_norm.weight,
                  "model: registry layout does not match the block slots");
}

size_t Model::Impl::local(size_t g) const {
  if (model.local_index_.empty() || g == kNoParam) return g;
  return model.local_index_[g];
}

const void* Model::Impl::weight(size_t i, DType dt) const {
  const Parameter& p = model.params_[i];
  if (dt == DType::f32) return p.master.raw();
  MESHTRAIN_CHECK(p.compute.defined(), "model: parameter '{}' has no {} compute copy", p.spec.name,
                  dtype_name(dt));
  return p.compute.raw();
}

void Model::Impl::ready(size_t i) {
  MESHTRAIN_CHECK(i + 1 == next_ready, "model: gradient of '{}' (index {}) reported out of order",
                  model.params_[i].spec.name, i);
  next_ready = i;
}

Block Model::Impl::block(int64_t layer) const {
  // This rank's widths (the whole layer at tp 1).
  const int64_t d = cfg.dim, hd = cfg.head_dim(), h = hidden;
  const int64_t qkv_width = (heads + 2 * kv_heads) * hd, q_width = heads * hd;
  Block b;
  const size_t l = static_cast<size_t>(layer);
  // A layer's parameters are contiguous on every stage that holds it.
  if (cfg.family == Family::llama) {
    using namespace llama_slot;
    const size_t base = local(1 + l * count);
    b.norm1 = Norm{base + in_norm, kNoParam};
    b.norm2 = Norm{base + post_norm, kNoParam};
    b.qkv = Linear{base + q, 3, kNoParam, d, qkv_width, true};
    b.proj = Linear{base + o, 1, kNoParam, q_width, d, true};
    b.ff_in = Linear{base + gate, 2, kNoParam, d, 2 * h, true};
    b.ff_out = Linear{base + down, 1, kNoParam, h, d, true};
  } else {
    using namespace gpt2_slot;
    const size_t base = local(2 + l * count);
    b.norm1 = Norm{base + ln1_w, base + ln1_b};
    b.norm2 = Norm{base + ln2_w, base + ln2_b};
    b.qkv = Linear{base + attn_w, 1, base + attn_b, d, qkv_width, false};
    b.proj = Linear{base + attn_proj_w, 1, base + attn_proj_b, q_width, d, false};
    b.ff_in = Linear{base + fc_w, 1, base + fc_b, d, h, false};
    b.ff_out = Linear{base + proj_w, 1, base + proj_b, h, d, false};
  }
  return b;
}

cpu::AttentionDims Model::Impl::attention_dims(int64_t batch, int64_t seq) const {
  return cpu::AttentionDims{batch, seq, heads, kv_heads, cfg.head_dim(), row_positions};
}

void Model::Impl::ensure(Tensor& t, const Shape& shape, DType dtype, MemCategory category) const {
  if (!t.defined() || t.shape() != shape || t.dtype() != dtype) {
    t = Tensor();  // free first, so the peak does not count both
    t = Tensor(shape, dtype, category, ctx.tracker());
  }
}

void Model::Impl::check_tokens(const int32_t* ids, int64_t n, bool allow_negative,
                               const char* what) const {
  for (int64_t i = 0; i < n; ++i) {
    const int32_t id = ids[i];
    if (id >= cfg.vocab_size || (id < 0 && !allow_negative)) {
      fail("model: {} id {} at position {} is outside the vocabulary [0, {})", what, id, i,
           cfg.vocab_size);
    }
  }
}

const Tensor& Model::Impl::forward_trunk(Activations& acts, const int32_t* tokens, int64_t batch,
                                         int64_t seq, DType dt, bool keep_all, KVCache* cache) {
  MESHTRAIN_CHECK(batch > 0 && seq > 0, "model: batch {} and seq {} must be > 0", batch, seq);
  const int64_t pos0 = cache ? cache->length : 0;
  MESHTRAIN_CHECK(pos0 + seq <= cfg.max_seq_len,
                  "model: positions up to {} exceed model.max_seq_len {}", pos0 + seq,
                  cfg.max_seq_len);
  const int64_t rows = batch * seq, d = cfg.dim;
  check_tokens(tokens, rows, false, "token");
  MESHTRAIN_CHECK(!sp || rows % tp.size() == 0,
                  "model: sequence parallel needs batch x seq = {} x {} divisible by tp = {}", batch,
                  seq, tp.size());
  const size_t layers = static_cast<size_t>(cfg.n_layers);
  const size_t n_res = keep_all ? layers + 1 : 2;
  acts.residual.resize(n_res);
  acts.blocks.resize(keep_all ? layers : 1);
  acts.batch = batch;
  acts.seq = seq;
  // Without backward nothing is kept: the buffers count as workspace.
  const MemCategory cat = keep_all ? MemCategory::activations : MemCategory::workspace;
  acts.category = cat;
  for (BlockActs& a : acts.blocks) a.category = cat;
  for (Tensor& r : acts.residual) ensure(r, {shard_rows(rows), d}, DType::f32, cat);

  before(embed_unit, UnitPass::forward);
  embed_tokens(tokens, batch, seq, pos0, acts.residual[0]);
  after(embed_unit, UnitPass::forward);
  for (size_t l = 0; l < layers; ++l) {
    const Tensor& x = acts.residual[keep_all ? l : l % 2];
    Tensor& out = acts.residual[keep_all ? l + 1 : (l + 1) % 2];
    BlockActs& a = acts.blocks[keep_all ? l : 0];
    cpu::KVCacheLayer* layer_cache = cache ? &cache->layers[l] : nullptr;
    const int64_t layer = static_cast<int64_t>(l);
    before(layer_unit(layer), UnitPass::forward);
    if (keep_all) {
      train_forward_block(layer, 0, x, a, out, dt, batch, seq);
    } else {
      forward_block(layer, x, a, out, dt, batch, seq, layer_cache, pos0);
    }
    after(layer_unit(layer), UnitPass::forward);
  }
  return acts.residual[keep_all ? layers : layers % 2];
}

void Model::Impl::norm_forward(const Norm& norm, const Tensor& x, DType dt, Tensor& y,
                               Tensor& mean, Tensor& rstd, int64_t rows, MemCategory category) {
  const int64_t d = cfg.dim;
  ensure(y, {rows, d}, dt, category);
  ensure(rstd, {rows}, DType::f32, category);
  if (norm.layer_norm()) {
    ensure(mean, {rows}, DType::f32, category);
    cpu::layernorm_forward(x.data<float>(), master(norm.weight), master(norm.bias), dt, y.raw(),
                           mean.data<float>(), rstd.data<float>(), rows, d, cfg.norm_eps);
  } else {
    cpu::rmsnorm_forward(x.data<float>(), master(norm.weight), dt, y.raw(), rstd.data<float>(),
                         rows, d, cfg.norm_eps);
  }
}

void Model::Impl::norm_backward(const Norm& norm, const Tensor& x, const Tensor& mean,
                                const Tensor& rstd, const float* dy, float* dx, int64_t rows) {
  const int64_t d = cfg.dim;
  if (norm.layer_norm()) {
    float* dw = norm_grad(norm.weight);
    cpu::layernorm_backward(x.data<float>(), master(norm.weight), mean.data<float>(),
                            rstd.data<float>(), dy, dx, dw, norm_grad(norm.bias), rows, d);
    ready(norm.bias);
  } else {
    cpu::rmsnorm_backward(x.data<float>(), master(norm.weight), rstd.data<float>(), dy, dx,
                          norm_grad(norm.weight), rows, d);
  }
  ready(norm.weight);
}

void Model::Impl::linear_forward(const Linear& lin, DType dt, const void* x, int64_t rows, float* y,
                                 bool accumulate) {
  cpu::MatmulDims dims{.m = rows, .n = lin.out, .k = lin.in, .trans_b = lin.nn_linear};
  const float* bias = lin.bias != kNoParam ? master(lin.bias) : nullptr;
  cpu::matmul(ctx, dims, dt, x, weight(lin.weight, dt), DType::f32, y, 1.0f, accumulate, bias);
}

void Model::Impl::linear_backward(const Linear& lin, DType dt, const void* dy, const float* dy_f32,
                                  const void* x, int64_t rows, float* dx, float* scratch) {
  linear_backward_weight(lin, dt, dy, dy_f32, x, rows, scratch);
  if (dx != nullptr) linear_backward_input(lin, dt, dy, rows, dx);
}

void Model::Impl::linear_backward_weight(const Linear& lin, DType dt, const void* dy,
                                         const float* dy_f32, const void* x, int64_t rows,
                                         float* scratch) {
  // dW += dY^T · X ([out, in], nn.Linear) or X^T · dY ([in, out], Conv1D).
  if (lin.nn_linear) {
    cpu::MatmulDims dims{.m = lin.out, .n = lin.in, .k = rows, .trans_a = true};
    cpu::matmul(ctx, dims, dt, dy, x, DType::f32, grad(lin.weight), 1.0f, true);
  } else {
    cpu::MatmulDims dims{.m = lin.in, .n = lin.out, .k = rows, .trans_a = true};
    cpu::matmul(ctx, dims, dt, x, dy, DType::f32, grad(lin.weight), 1.0f, true);
  }
  if (lin.bias != kNoParam) {
    if (dy_f32 == nullptr) {
      if (dt == DType::f32) {
        dy_f32 = static_cast<const float*>(dy);
      } else {
        convert(dt, dy, DType::f32, scratch, static_cast<size_t>(rows * lin.out));
        dy_f32 = scratch;
      }
    }
    cpu::bias_backward(dy_f32, grad(lin.bias), rows, lin.out);
    ready(lin.bias);
  }
  for (size_t i = lin.n_weights; i-- > 0;) ready(lin.weight + i);
}

void Model::Impl::linear_backward_input(const Linear& lin, DType dt, const void* dy, int64_t rows,
                                        float* dx) {
  // dX = dY · W ([out, in]) or dY · W^T ([in, out]).
  cpu::MatmulDims dims{.m = rows, .n = lin.in, .k = lin.out, .trans_b = !lin.nn_linear};
  cpu::matmul(ctx, dims, dt, dy, weight(lin.weight, dt), DType::f32, dx);
}

const void* Model::Impl::residual_grad_compute(DType dt, const Tensor& dres, int64_t rows) {
  if (dt == DType::f32) return dres.raw();
  ensure(ws.dres_c, {rows, cfg.dim}, dt, MemCategory::workspace);
  ws.dres_c.copy_from(dres);
  return ws.dres_c.raw();
}

void Model::Impl::forward_block(int64_t layer, const Tensor& x, BlockActs& a, Tensor& out,
                                DType dt, int64_t batch, int64_t seq, cpu::KVCacheLayer* cache,
                                int64_t pos0) {
  const Block b = block(layer);
  const int64_t rows = batch * seq;
  const cpu::AttentionDims dims = attention_dims(batch, seq);
  const MemCategory act = a.category;

  // Attention sub-block: mid = x + proj(attention(qkv(norm1(x)))).
  const void* xn1 = column_input(b.norm1, x, dt, a.xn1, a.mean1, a.rstd1, rows, act);
  ensure(ws.qkv, {rows, b.qkv.out}, DType::f32, MemCategory::workspace);
  linear_forward(b.qkv, dt, xn1, rows, ws.qkv.data<float>(), false);
  ensure(a.att, {rows, b.proj.in}, dt, act);
  if (cache != nullptr) {
    MESHTRAIN_CHECK(dt == DType::f32, "model: decoding runs in f32");
    cpu::attention_decode(ctx, dims, rope_table(), ws.qkv.data<float>(), pos0, *cache,
                          a.att.data<float>());
  } else {
    cpu::attention_forward(ctx, dims, rope_table(), dt, ws.qkv.data<float>(), a.att.raw(), a.attn);
  }
  ensure(a.mid, x.shape(), DType::f32, act);
  row_parallel_add(b.proj, dt, a.att.raw(), rows, x, a.mid);

  // Feed-forward sub-block: out = mid + ff_out(act(ff_in(norm2(mid)))).
  const void* xn2 = column_input(b.norm2, a.mid, dt, a.xn2, a.mean2, a.rstd2, rows, act);
  ensure(a.ff_pre, {rows, b.ff_in.out}, DType::f32, act);
  linear_forward(b.ff_in, dt, xn2, rows, a.ff_pre.data<float>(), false);
  mlp_activation(a.ff_pre, dt, a.ff_act, rows, act);
  row_parallel_add(b.ff_out, dt, a.ff_act.raw(), rows, a.mid, out);
}

void Model::Impl::mlp_activation(const Tensor& pre, DType dt, Tensor& act, int64_t rows,
                                 MemCategory category) {
  ensure(act, {rows, hidden}, dt, category);
  if (cfg.family == Family::llama) {
    cpu::swiglu_forward(pre.data<float>(), dt, act.raw(), rows, hidden);
  } else {
    cpu::gelu_forward(pre.data<float>(), dt, act.raw(), rows * hidden);
  }
}

void Model::Impl::backward_block(int64_t layer, const Tensor& x, BlockActs& a, DType dt,
                                 int64_t batch, int64_t seq) {
  const Block b = block(layer);
  const int64_t rows = batch * seq, srows = shard_rows(rows), d = cfg.dim, h = hidden;
  const MemCategory wsc = MemCategory::workspace;
  ensure(ws.dx, {rows, d}, DType::f32, wsc);
  ensure(ws.dff, {rows, std::max(h, b.qkv.out)}, DType::f32, wsc);
  ensure(ws.dff_c, {rows, b.ff_in.out}, dt, wsc);
  ensure(ws.dqkv, {rows, b.qkv.out}, dt, wsc);
  float* dres = ws.dres.data<float>();
  float* dx = ws.dx.data<float>();
  float* dff = ws.dff.data<float>();

  // Feed-forward sub-block, in reverse.
  const Tensor* dy = &full_residual_grad(rows);
  const void* dres_c = residual_grad_compute(dt, *dy, rows);
  linear_backward(b.ff_out, dt, dres_c, dy->data<float>(), a.ff_act.raw(), rows, dff, nullptr);
  if (cfg.family == Family::llama) {
    cpu::swiglu_backward(a.ff_pre.data<float>(), dff, dt, ws.dff_c.raw(), rows, h);
  } else {
    cpu::gelu_backward(a.ff_pre.data<float>(), dff, dt, ws.dff_c.raw(), rows * h);
  }
  const float* dxn = column_parallel_backward(b.ff_in, dt, ws.dff_c.raw(), a.xn2, rows, dff);
  norm_backward(b.norm2, a.mid, a.mean2, a.rstd2, dxn, dres, srows);  // dres += d(norm2 input)

  // Attention sub-block, in reverse.
  dy = &full_residual_grad(rows);
  dres_c = residual_grad_compute(dt, *dy, rows);
  linear_backward(b.proj, dt, dres_c, dy->data<float>(), a.att.raw(), rows, dx, nullptr);
  cpu::attention_backward(ctx, attention_dims(batch, seq), rope_table(), dt, a.attn, dx,
                          ws.dqkv.raw());
  dxn = column_parallel_backward(b.qkv, dt, ws.dqkv.raw(), a.xn1, rows, dff);
  norm_backward(b.norm1, x, a.mean1, a.rstd1, dxn, dres, srows);
  flush_norm_grads();
}

}  // namespace meshtrain
