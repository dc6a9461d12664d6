// The transformer block's explicit forward and backward, shared by both
// families: a family is a choice of norm (RMSNorm / LayerNorm + bias), weight
// layout (nn.Linear / Conv1D), biases, activation (SwiGLU / GELU) and RoPE.
#include <fmt/format.h>

#include <algorithm>

#include "meshtrain/backend/backend.h"
#include "meshtrain/model/model_impl.h"
#include "meshtrain/util/error.h"
#include "meshtrain/util/rng.h"
#include "meshtrain/util/trace.h"

namespace meshtrain {

Model::Impl::Impl(Model& owner)
    : model(owner), cfg(owner.config_), backend(owner.backend_), tp(owner.tp_), ep(owner.ep_) {
  const size_t layers = static_cast<size_t>(cfg.n_layers);
  const int64_t n = tp.size();
  sp = tp.active() && tp.sequence_parallel;
  heads = cfg.n_heads / n;
  kv_heads = cfg.n_kv_heads / n;
  hidden = cfg.hidden_dim / n;
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
  if (cfg.recipe().positions == Positions::rope) {
    has_rope = true;
    rope = backend.make_rope_table(cfg.head_dim(), cfg.max_seq_len, cfg.rope_frequencies());
  } else {
    positions = local(1);
  }
  // The head unit: the final norm (+ bias), then an untied llama's lm_head.
  const size_t head_first = head_unit != kNoUnit ? model.units_[head_unit].first_param : kNoParam;
  const bool norm_bias = cfg.recipe().norm == NormKind::layer;
  final_norm = head_first == kNoParam ? Norm{}
                                      : Norm{head_first, norm_bias ? head_first + 1 : kNoParam};
  tied = cfg.tie_embeddings;
  embed = local(0);
  output = tied ? embed : (head_first == kNoParam ? kNoParam : head_first + 1);
  blocks.resize(layers);
  for (size_t l = 0; l < layers; ++l) {
    if (unit_of_layer[l] == kNoUnit) continue;
    const auto layer = static_cast<int64_t>(l);
    blocks[l] = make_block(layer);
    for (const Linear* lin : {&blocks[l].qkv, &blocks[l].proj, &blocks[l].ff_in, &blocks[l].ff_out}) {
      if (lin->weight != kNoParam && model.params_[lin->weight].spec.nf4) {
        dequant_numel = std::max(dequant_numel, lin->in * lin->out);
      }
    }
    if (cfg.moe.is_moe_layer(layer)) {
      moe_stats.push_back(MoeLayerStats{
          .layer = layer, .tokens = std::vector<int64_t>(static_cast<size_t>(cfg.moe.experts))});
    }
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
  if (dt == DType::f32) {
    MESHTRAIN_CHECK(p.master.defined(),
                    "model: frozen parameter '{}' is held only as {} (LoRA in mixed precision); "
                    "an f32 pass needs a model built in fp32",
                    p.spec.name, p.compute.defined() ? dtype_name(p.compute.dtype()) : "nothing");
    return p.master.raw();
  }
  MESHTRAIN_CHECK(p.compute.defined(), "model: parameter '{}' has no {} compute copy", p.spec.name,
                  dtype_name(dt));
  return p.compute.raw();
}

const void* Model::Impl::linear_weight(const Linear& lin, DType dt) {
  const Parameter& first = model.params_[lin.weight];
  if (!first.spec.nf4) return weight(lin.weight, dt);
  trace::Span span("compute", "dequantize_nf4");
  ensure(ws.dequant, {dequant_numel}, dt, MemCategory::workspace);
  int64_t at = 0;
  for (size_t k = 0; k < lin.n_weights; ++k) {
    const Parameter& p = model.params_[lin.weight + k];
    backend.dequantize_nf4(p.nf4.raw(), p.spec.numel(), dt,
                           static_cast<char*>(ws.dequant.raw()) + at * dtype_size(dt),
                           nf4_layout(p.spec).form);
    at += p.spec.numel();
  }
  return ws.dequant.raw();
}

void Model::Impl::ready(size_t i) {
  MESHTRAIN_CHECK(i + 1 == next_ready, "model: gradient of '{}' (index {}) reported out of order",
                  model.params_[i].spec.name, i);
  next_ready = i;
}

Block Model::Impl::make_block(int64_t layer) const {
  // This rank's widths (the whole layer at tp 1).
  const int64_t d = cfg.dim, hd = cfg.head_dim(), h = hidden;
  const int64_t qkv_width = (heads + 2 * kv_heads) * hd, q_width = heads * hd;
  // A layer's parameters are contiguous on every stage that holds it; found
  // by name, as LoRA adapters (params.cpp) sit after their layer's weights.
  const ParamUnit& unit = model.units_[unit_of_layer[static_cast<size_t>(layer)]];
  const std::string prefix = block_param_prefix(cfg.family, layer);
  auto find = [&](const std::string& name) {
    for (size_t i = unit.first_param; i < unit.end_param; ++i) {
      if (model.params_[i].spec.name == prefix + name) return i;
    }
    return kNoParam;
  };
  auto param = [&](const std::string& name) {
    const size_t i = find(name);
    MESHTRAIN_CHECK(i != kNoParam, "model: registry has no '{}{}'", prefix, name);
    return i;
  };
  // The adapters of the modules of one GEMM, in output order.
  auto adapters = [&](Linear& lin, const std::vector<std::string>& modules) {
    int64_t out_begin = 0;
    for (const std::string& module : modules) {
      const size_t w = param(module + ".weight");
      const Shape& shape = model.params_[w].spec.shape;
      const int64_t out = lin.nn_linear ? shape[0] : shape[1];
      const size_t a = find(module + ".lora_A.weight");
      if (a != kNoParam) {
        lin.lora.push_back(LoraAdapter{a, param(module + ".lora_B.weight"),
                                       out_begin, out, model.params_[a].spec.split.split()});
      }
      out_begin += out;
    }
  };
  // The recipe's name map: a LayerNorm has a bias, a biased family's
  // fused GEMM has one bias vector after its weights.
  const Recipe& rc = cfg.recipe();
  auto norm = [&](const std::string& module) {
    return Norm{param(module + ".weight"),
                rc.norm == NormKind::layer ? param(module + ".bias") : kNoParam};
  };
  // A biased GEMM's bias: GPT-2's one tensor for its fused modules, else one
  // per module (Qwen2's q|k|v biases), adjacent in the registry.
  auto linear = [&](const std::vector<std::string>& modules, int64_t in, int64_t out,
                    bool biased) {
    return Linear{param(modules.front() + ".weight"), modules.size(),
                  biased ? param(modules.front() + ".bias") : kNoParam,
                  biased && !rc.linear_bias ? modules.size() : 1, in, out, !rc.conv1d, {}};
  };
  const auto& m = rc.gemm_modules;
  Block b;
  b.norm1 = norm(rc.norm_modules[0]);
  b.norm2 = norm(rc.norm_modules[1]);
  b.qkv = linear(m[0], d, qkv_width, rc.linear_bias || cfg.qkv_bias);
  if (cfg.qk_norm != QkNorm::none) {
    b.qk_norm = {param("self_attn.q_norm.weight"), param("self_attn.k_norm.weight")};
  }
  b.proj = linear(m[1], q_width, d, rc.linear_bias);
  Linear* gemms[] = {&b.qkv, &b.proj, &b.ff_in, &b.ff_out};
  if (!cfg.moe.is_moe_layer(layer)) {
    b.ff_in = linear(m[2], d, rc.ff_in_factor() * h, rc.linear_bias);
    b.ff_out = linear(m[3], h, d, rc.linear_bias);
  }
  for (size_t g = 0; g < m.size(); ++g) {
    if (gemms[g]->weight != kNoParam) adapters(*gemms[g], m[g]);
  }
  if (!cfg.moe.is_moe_layer(layer)) return b;
  // A MoE feed-forward (params.cpp moe_registry).
  MoeFfn& e = b.moe;
  e.router = param("mlp.gate.weight");
  e.selection_bias = find("mlp.gate.e_score_correction_bias");
  e.experts_in = param("mlp.experts.gate_up_proj");
  e.experts_out = param("mlp.experts.down_proj");
  // The shared experts are a tensor-parallel MLP: this rank's columns.
  if (const int64_t hs = cfg.moe.shared_hidden / tp.size(); hs > 0) {
    e.shared_in = Linear{param("mlp.shared_expert.gate_proj.weight"), 2, kNoParam, 1, d, 2 * hs,
                         true, {}};
    e.shared_out = Linear{param("mlp.shared_expert.down_proj.weight"), 1, kNoParam, 1, hs, d, true, {}};
    if (cfg.moe.shared_gate) e.shared_gate = param("mlp.shared_expert_gate.weight");
  }
  return b;
}

ops::AttentionDims Model::Impl::attention_dims(int64_t batch, int64_t seq) const {
  return ops::AttentionDims{batch,          seq, heads, kv_heads, cfg.head_dim(), row_positions,
                            cfg.sliding_window};
}

const int32_t* Model::Impl::upload(Tensor& slot, const int32_t* host, int64_t n) {
  if (host == nullptr) return nullptr;
  ensure(slot, {n}, DType::i32, MemCategory::workspace);
  backend.copy_from_host(host, slot);
  return slot.data<int32_t>();
}

void Model::Impl::weigh(ops::ClassifierArgs& args, const TokenLoss& loss) {
  const float* weights = loss.weights;
  if (loss.weigh) {
    // The pass's own token losses (the classifier's forward alone), then the
    // weights they give.
    ops::ClassifierArgs forward = args;
    forward.dh = nullptr, forward.dw = nullptr, forward.row_weights = nullptr;
    ensure(ws.row_losses, {args.rows}, DType::f32, MemCategory::workspace);
    forward.row_losses = ws.row_losses.data<float>();
    backend.fused_classifier(forward);
    backend.synchronize();
    host_losses.resize(static_cast<size_t>(args.rows));
    host_weights.assign(static_cast<size_t>(args.rows), 0.0f);
    backend.copy_to_host(ws.row_losses, host_losses.data());
    loss.weigh(host_losses.data(), host_weights.data());
    weights = host_weights.data();
  }
  if (weights != nullptr) {
    ensure(ws.row_weights, {args.rows}, DType::f32, MemCategory::workspace);
    backend.copy_from_host(weights, ws.row_weights);
    args.row_weights = ws.row_weights.data<float>();
  }
  if (loss.losses != nullptr) {
    ensure(ws.row_losses, {args.rows}, DType::f32, MemCategory::workspace);
    args.row_losses = ws.row_losses.data<float>();
  }
}

void Model::Impl::fetch_losses(const TokenLoss& loss, int64_t rows) {
  if (loss.losses == nullptr) return;
  backend.synchronize();
  MESHTRAIN_CHECK(ws.row_losses.numel() == rows, "model: {} token losses held for {} rows",
                  ws.row_losses.numel(), rows);
  backend.copy_to_host(ws.row_losses, loss.losses);
}

void Model::Impl::ensure(Tensor& t, const Shape& shape, DType dtype, MemCategory category) const {
  if (!t.defined() || t.shape() != shape || t.dtype() != dtype) {
    t = Tensor();  // free first, so the peak does not count both
    t = backend.allocate(shape, dtype, category);
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
    ops::KVCacheLayer* layer_cache = cache ? &cache->layers[l] : nullptr;
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

ops::NormArgs Model::Impl::norm_outputs(const Norm& norm, DType dt, Tensor& y, Tensor& mean,
                                        Tensor& rstd, int64_t rows, MemCategory category) {
  ensure(y, {rows, cfg.dim}, dt, category);
  ensure(rstd, {rows}, DType::f32, category);
  ops::NormArgs args{.w = master(norm.weight), .rstd = rstd.data<float>(), .eps = cfg.norm_eps};
  if (norm.layer_norm()) {
    ensure(mean, {rows}, DType::f32, category);
    args.layer_norm = true;
    args.b = master(norm.bias);
    args.mean = mean.data<float>();
  }
  return args;
}

void Model::Impl::norm_forward(const Norm& norm, const Tensor& x, DType dt, Tensor& y,
                               Tensor& mean, Tensor& rstd, int64_t rows, MemCategory category) {
  const ops::NormArgs a = norm_outputs(norm, dt, y, mean, rstd, rows, category);
  if (a.layer_norm) {
    backend.layernorm_forward(x.data<float>(), a.w, a.b, dt, y.raw(), a.mean, a.rstd, rows,
                              cfg.dim, a.eps);
  } else {
    backend.rmsnorm_forward(x.data<float>(), a.w, dt, y.raw(), a.rstd, rows, cfg.dim, a.eps);
  }
}

void Model::Impl::norm_backward(const Norm& norm, const Tensor& x, const Tensor& mean,
                                const Tensor& rstd, const float* dy, float* dx, int64_t rows) {
  const int64_t d = cfg.dim;
  if (norm.layer_norm()) {
    float* dw = norm_grad(norm.weight);
    backend.layernorm_backward(x.data<float>(), master(norm.weight), mean.data<float>(),
                               rstd.data<float>(), dy, dx, dw, norm_grad(norm.bias, 1), rows, d);
    ready(norm.bias);
  } else {
    backend.rmsnorm_backward(x.data<float>(), master(norm.weight), rstd.data<float>(), dy, dx,
                             norm_grad(norm.weight), rows, d);
  }
  ready(norm.weight);
}

void Model::Impl::linear_forward(const Linear& lin, DType dt, const void* x, int64_t rows, float* y,
                                 const float* addend) {
  ops::MatmulDims dims{.m = rows, .n = lin.out, .k = lin.in, .trans_b = lin.nn_linear};
  if (addend != nullptr) {
    backend.matmul_add(dims, dt, x, linear_weight(lin, dt), addend, y, bias_of(lin));
  } else {
    backend.matmul(dims, dt, x, linear_weight(lin, dt), DType::f32, y, 1.0f, false, bias_of(lin));
  }
  lora_forward(lin, dt, x, rows, y);
}

void Model::Impl::lora_dropout_mask(const Linear& lin, const LoraAdapter& ad, int64_t rows) {
  const ParamSpec& a = model.params_[ad.a].spec;
  const std::string module = a.name.substr(0, a.name.size() - std::string(".lora_A.weight").size());
  const uint64_t key =
      stream_key(dropout.seed, fmt::format("lora_dropout.{}.{}", dropout.step, module));
  // Global feature indices: a row-parallel A holds this rank's input columns.
  const int64_t in = lin.in, in_global = a.split.global_shape[1];
  const int64_t j0 = ad.row_parallel ? static_cast<int64_t>(tp.rank()) * in : 0, seq = dropout.seq;
  const float p = cfg.lora.dropout, keep = 1.0f / (1.0f - p);
  // Drawn on the host (the counter-based stream is host code) and uploaded.
  dropout.mask.resize(static_cast<size_t>(rows * in));
  float* mask = dropout.mask.data();
  const int64_t* samples = dropout.samples.data();
#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t token = samples[row / seq] * seq + row % seq;
    for (int64_t j = 0; j < in; ++j) {
      const auto index = static_cast<uint64_t>(token * in_global + j0 + j);
      mask[row * in + j] = uniform_at(key, index) >= p ? keep : 0.0f;
    }
  }
  ensure(ws.lora_mask, {rows, in}, DType::f32, MemCategory::workspace);
  backend.copy_from_host(mask, ws.lora_mask);
}

const void* Model::Impl::lora_dropped_input(const Linear& lin, const LoraAdapter& ad, DType dt,
                                            const void* x, int64_t rows) {
  if (!dropping()) return x;
  lora_dropout_mask(lin, ad, rows);
  const int64_t n = rows * lin.in;
  ensure(ws.lora_x32, {rows, lin.in}, DType::f32, MemCategory::workspace);
  float* xd = ws.lora_x32.data<float>();
  backend.convert(dt, x, DType::f32, xd, n);
  backend.mul_inplace(xd, ws.lora_mask.data<float>(), n);
  if (dt == DType::f32) return xd;
  ensure(ws.lora_x, {rows, lin.in}, dt, MemCategory::workspace);
  ws.lora_x.copy_from(ws.lora_x32);
  return ws.lora_x.raw();
}

const void* Model::Impl::lora_input_product(const Linear& lin, const LoraAdapter& ad, DType dt,
                                            const void* x_in, int64_t rows) {
  const int64_t r = cfg.lora.rank;
  const void* x = lora_dropped_input(lin, ad, dt, x_in, rows);
  ensure(ws.lora_u, {rows, r}, dt, MemCategory::workspace);
  const ops::MatmulDims dims{.m = rows, .n = r, .k = lin.in, .trans_b = true};
  if (!ad.row_parallel) {
    backend.matmul(dims, dt, x, weight(ad.a, dt), dt, ws.lora_u.raw());
    return ws.lora_u.raw();
  }
  // This rank's input columns give a partial x A^T: summed over tp in f32.
  ensure(ws.lora_u_sum, {rows, r}, DType::f32, MemCategory::workspace);
  backend.matmul(dims, dt, x, weight(ad.a, dt), DType::f32, ws.lora_u_sum.raw());
  tp_all_reduce_sum(tp, ws.lora_u_sum.data<float>(), rows * r);
  if (dt == DType::f32) return ws.lora_u_sum.raw();
  ws.lora_u.copy_from(ws.lora_u_sum);
  return ws.lora_u.raw();
}

void Model::Impl::lora_forward(const Linear& lin, DType dt, const void* x, int64_t rows, float* y) {
  if (!adapters_on) return;
  const int64_t r = cfg.lora.rank;
  for (const LoraAdapter& ad : lin.lora) {
    // u = x A^T [rows, r]; y[:, out_begin:] += scale * u B^T.
    const void* u = lora_input_product(lin, ad, dt, x, rows);
    // A row-parallel layer's y is a partial sum over tp: the term goes into one rank's.
    if (ad.row_parallel && tp.rank() != 0) continue;
    backend.matmul({.m = rows, .n = ad.out, .k = r, .trans_b = true, .ldc = lin.out}, dt, u,
                   weight(ad.b, dt), DType::f32, y + ad.out_begin, cfg.lora.scale(), true);
  }
}

void Model::Impl::lora_backward_input(const Linear& lin, DType dt, const void* dy, int64_t rows,
                                      float* dx) {
  if (lin.lora.empty()) return;
  const int64_t r = cfg.lora.rank;
  const size_t esize = dtype_size(dt);
  ensure(ws.lora_du, {3, rows, r}, DType::f32,  // at most 3 modules per GEMM (q|k|v)
         MemCategory::workspace);
  for (size_t i = 0; i < lin.lora.size(); ++i) {
    const LoraAdapter& ad = lin.lora[i];
    // du = scale * dY[:, out_begin:] B [rows, r]; dx += du A.
    float* du = ws.lora_du.data<float>() + static_cast<int64_t>(i) * rows * r;
    const char* dy_slice = static_cast<const char*>(dy) + static_cast<size_t>(ad.out_begin) * esize;
    backend.matmul({.m = rows, .n = r, .k = ad.out, .lda = lin.out}, dt, dy_slice, weight(ad.b, dt),
                   DType::f32, du, cfg.lora.scale());
    if (dx == nullptr) continue;
    const void* du_c = du;
    if (dt != DType::f32) {
      ensure(ws.lora_du_c, {rows, r}, dt, MemCategory::workspace);
      backend.convert(DType::f32, du, dt, ws.lora_du_c.raw(), rows * r);
      du_c = ws.lora_du_c.raw();
    }
    if (!dropping()) {
      backend.matmul({.m = rows, .n = lin.in, .k = r}, dt, du_c, weight(ad.a, dt), DType::f32, dx,
                     1.0f, true);
      continue;
    }
    // Through the dropout: dx += mask * (du A).
    ensure(ws.lora_x32, {rows, lin.in}, DType::f32, MemCategory::workspace);
    float* t = ws.lora_x32.data<float>();
    backend.matmul({.m = rows, .n = lin.in, .k = r}, dt, du_c, weight(ad.a, dt), DType::f32, t);
    lora_dropout_mask(lin, ad, rows);
    backend.add_product(dx, ws.lora_mask.data<float>(), t, rows * lin.in);
  }
}

void Model::Impl::lora_backward_weight(const Linear& lin, DType dt, const void* dy, const void* x,
                                       int64_t rows) {
  const int64_t r = cfg.lora.rank;
  const size_t esize = dtype_size(dt);
  // Reverse registry order: the last adapter's B first.
  for (size_t i = lin.lora.size(); i-- > 0;) {
    const LoraAdapter& ad = lin.lora[i];
    float* du = ws.lora_du.data<float>() + static_cast<int64_t>(i) * rows * r;
    // dB += scale * dY[:, out_begin:]^T u, with u = x A^T again (not kept).
    const void* u = lora_input_product(lin, ad, dt, x, rows);
    const char* dy_slice = static_cast<const char*>(dy) + static_cast<size_t>(ad.out_begin) * esize;
    backend.matmul({.m = ad.out, .n = r, .k = rows, .trans_a = true, .lda = lin.out}, dt, dy_slice,
                   u, DType::f32, grad(ad.b), cfg.lora.scale(), true);
    ready(ad.b);
    // dA += du^T x. A column-parallel layer's du is summed over tp first (each
    // rank's B rows give a partial); a row-parallel one's is whole already (B
    // replicated, dY over all outputs) and meets this rank's x columns.
    if (tp.active() && !ad.row_parallel) tp_all_reduce_sum(tp, du, rows * r);
    const void* du_c = du;
    if (dt != DType::f32) {
      ensure(ws.lora_du_c, {rows, r}, dt, MemCategory::workspace);
      backend.convert(DType::f32, du, dt, ws.lora_du_c.raw(), rows * r);
      du_c = ws.lora_du_c.raw();
    }
    backend.matmul({.m = r, .n = lin.in, .k = rows, .trans_a = true}, dt, du_c,
                   lora_dropped_input(lin, ad, dt, x, rows), DType::f32, grad(ad.a), 1.0f, true);
    ready(ad.a);
  }
}

void Model::Impl::linear_backward(const Linear& lin, DType dt, const void* dy, const float* dy_f32,
                                  const void* x, int64_t rows, float* dx, float* scratch) {
  if (dx != nullptr) {
    linear_backward_input(lin, dt, dy, rows, dx);
  } else {
    lora_backward_input(lin, dt, dy, rows, nullptr);
  }
  linear_backward_weight(lin, dt, dy, dy_f32, x, rows, scratch);
}

void Model::Impl::linear_backward_weight(const Linear& lin, DType dt, const void* dy,
                                         const float* dy_f32, const void* x, int64_t rows,
                                         float* scratch) {
  lora_backward_weight(lin, dt, dy, x, rows);
  // A frozen weight (LoRA's base) gets no gradient: its GEMM is skipped.
  if (trains(lin.weight)) {
    // dW += dY^T · X ([out, in], nn.Linear) or X^T · dY ([in, out], Conv1D).
    if (lin.nn_linear) {
      ops::MatmulDims dims{.m = lin.out, .n = lin.in, .k = rows, .trans_a = true};
      backend.matmul(dims, dt, dy, x, DType::f32, grad(lin.weight), 1.0f, true);
    } else {
      ops::MatmulDims dims{.m = lin.in, .n = lin.out, .k = rows, .trans_a = true};
      backend.matmul(dims, dt, x, dy, DType::f32, grad(lin.weight), 1.0f, true);
    }
  }
  if (lin.bias != kNoParam) {
    if (trains(lin.bias)) {
      if (dy_f32 == nullptr) {
        if (dt == DType::f32) {
          dy_f32 = static_cast<const float*>(dy);
        } else {
          backend.convert(dt, dy, DType::f32, scratch, rows * lin.out);
          dy_f32 = scratch;
        }
      }
      backend.bias_backward(dy_f32, grad(lin.bias), rows, lin.out);
    }
    for (size_t i = lin.n_biases; i-- > 0;) ready(lin.bias + i);
  }
  for (size_t i = lin.n_weights; i-- > 0;) ready(lin.weight + i);
}

void Model::Impl::linear_backward_input(const Linear& lin, DType dt, const void* dy, int64_t rows,
                                        float* dx) {
  // dX = dY · W ([out, in]) or dY · W^T ([in, out]).
  ops::MatmulDims dims{.m = rows, .n = lin.in, .k = lin.out, .trans_b = !lin.nn_linear};
  backend.matmul(dims, dt, dy, linear_weight(lin, dt), DType::f32, dx);
  lora_backward_input(lin, dt, dy, rows, dx);
}

const void* Model::Impl::residual_grad_compute(DType dt, const Tensor& dres, int64_t rows) {
  if (dt == DType::f32) return dres.raw();
  ensure(ws.dres_c, {rows, cfg.dim}, dt, MemCategory::workspace);
  ws.dres_c.copy_from(dres);
  return ws.dres_c.raw();
}

void Model::Impl::forward_block(int64_t layer, const Tensor& x, BlockActs& a, Tensor& out, DType dt,
                                int64_t batch, int64_t seq, ops::KVCacheLayer* cache,
                                int64_t pos0) {
  const Block& b = block(layer);
  const int64_t rows = batch * seq;
  const ops::AttentionDims dims = attention_dims(batch, seq);
  const MemCategory act = a.category;

  // Attention sub-block: mid = x + proj(attention(qkv(norm1(x)))).
  const void* xn1 = column_input(b.norm1, x, dt, a.xn1, a.mean1, a.rstd1, rows, act);
  ensure(ws.qkv, {rows, b.qkv.out}, DType::f32, MemCategory::workspace);
  linear_forward(b.qkv, dt, xn1, rows, ws.qkv.data<float>());
  if (b.qk_norm.enabled()) qk_norm_forward(b, a, rows);
  ensure(a.att, {rows, b.proj.in}, dt, act);
  if (cache != nullptr) {
    MESHTRAIN_CHECK(dt == DType::f32, "model: decoding runs in f32");
    backend.attention_decode(dims, rope_table(), ws.qkv.data<float>(), pos0, *cache,
                             a.att.data<float>());
  } else if (model.context_parallel().active()) {
    context_attention_forward(a, dt, batch, seq);
  } else {
    backend.attention_forward(dims, rope_table(), dt, ws.qkv.data<float>(), a.att.raw(), a.attn);
  }
  ensure(a.mid, x.shape(), DType::f32, act);
  // Feed-forward sub-block: out = mid + ff_out(act(ff_in(norm2(mid)))), or a mixture of experts.
  const void* xn2 = row_parallel_add_norm(b.proj, dt, a.att.raw(), rows, x, a.mid, b.norm2, a.xn2,
                                          a.mean2, a.rstd2, act);
  if (b.moe.enabled()) {
    moe_forward(layer, b, a, xn2, dt, rows, out);
    return;
  }
  ensure(a.ff_pre, {rows, b.ff_in.out}, DType::f32, act);
  linear_forward(b.ff_in, dt, xn2, rows, a.ff_pre.data<float>());
  mlp_activation(a.ff_pre, dt, a.ff_act, rows, hidden, act);
  row_parallel_add(b.ff_out, dt, a.ff_act.raw(), rows, a.mid, out);
}

ops::ContextDims Model::Impl::context_dims(int64_t batch, int64_t seq) const {
  MESHTRAIN_CHECK(row_positions != nullptr,
                  "model: a context-parallel pass needs its tokens' positions");
  return ops::ContextDims{
      batch, seq, heads, kv_heads, cfg.head_dim(), model.context_parallel().split(), row_positions};
}

void Model::Impl::context_attention_forward(BlockActs& a, DType dt, int64_t batch, int64_t seq) {
  const ops::ContextDims d = context_dims(batch, seq);
  if (model.context_parallel().method == CpComm::ring) return ring_attention_forward(a, dt, d);
  if (model.context_parallel().method == CpComm::alltoall) return ulysses_forward(a, dt, d);
  Communicator& group = *model.context_parallel().comm;
  ensure(ws.cp_kv, {d.kv_block()}, dt, MemCategory::comm);
  ensure(ws.cp_kv_all, {d.kv_block() * d.split.size}, dt, MemCategory::comm);
  backend.context_attention_project(d, rope_table(), dt, ws.qkv.data<float>(), a.attn,
                                    ws.cp_kv.raw());
  {
    trace::Span span("comm", "cp all-gather k/v");
    group.all_gather(ws.cp_kv.raw(), ws.cp_kv_all.raw(), d.kv_block(), comm_dtype(dt));
  }
  backend.context_attention_forward(d, dt, ws.cp_kv_all.raw(), a.attn, a.att.raw());
}

void Model::Impl::context_attention_backward(const BlockActs& a, DType dt, int64_t batch,
                                             int64_t seq, const float* d_att) {
  const ops::ContextDims d = context_dims(batch, seq);
  if (model.context_parallel().method == CpComm::ring)
    return ring_attention_backward(a, dt, d, d_att);
  if (model.context_parallel().method == CpComm::alltoall) return ulysses_backward(a, dt, d, d_att);
  Communicator& group = *model.context_parallel().comm;
  ensure(ws.cp_dkv_all, {d.kv_block() * d.split.size}, DType::f32, MemCategory::comm);
  ensure(ws.cp_dkv, {d.kv_block()}, DType::f32, MemCategory::comm);
  backend.context_attention_backward(d, rope_table(), dt, a.attn, d_att, ws.dqkv.raw(),
                                     ws.cp_dkv_all.data<float>());
  {
    trace::Span span("comm", "cp reduce-scatter dk/dv");
    group.reduce_scatter(ws.cp_dkv_all.raw(), ws.cp_dkv.raw(), d.kv_block(), CommDType::f32,
                         ReduceOp::sum);
  }
  backend.context_attention_finish(d, rope_table(), dt, ws.cp_dkv.data<float>(), nullptr,
                                   ws.dqkv.raw());
}

ops::AttentionDims Model::Impl::ulysses_dims(const ops::ContextDims& d) {
  Communicator& group = *model.context_parallel().comm;
  const int64_t n = d.split.size, rows = d.batch * d.local_seq;
  ensure(ws.ul_pos, {n * rows}, DType::i32, MemCategory::workspace);
  ensure(ws.ul_pos_seq, {n * rows}, DType::i32, MemCategory::workspace);
  group.all_gather(d.positions, ws.ul_pos.raw(), rows, CommDType::i32);
  backend.context_sequence(d, 1, DType::i32, ws.ul_pos.raw(), ws.ul_pos_seq.raw(), true);
  return ops::AttentionDims{d.batch,        d.seq(),       d.n_heads / n, d.n_kv_heads / n,
                            d.head_dim, ws.ul_pos_seq.data<int32_t>()};
}

namespace {

// An all-to-all of `count` elements with every member of `group`.
void all_to_all_even(Communicator& group, const void* send, void* recv, int64_t count,
                     CommDType dtype, const char* what) {
  trace::Span span("comm", what);
  const std::vector<int64_t> counts(static_cast<size_t>(group.size()), count);
  group.all_to_all(send, counts, recv, counts, dtype);
}

}  // namespace

void Model::Impl::ulysses_forward(BlockActs& a, DType dt, const ops::ContextDims& d) {
  Communicator& group = *model.context_parallel().comm;
  const int64_t n = d.split.size, rows = d.batch * d.local_seq;
  const int64_t q = heads * cfg.head_dim(), kv = kv_heads * cfg.head_dim(), width = q + 2 * kv;
  ensure(ws.ul_send32, {rows * width}, DType::f32, MemCategory::comm);
  ensure(ws.ul_recv32, {rows * width}, DType::f32, MemCategory::comm);
  ensure(ws.ul_send16, {rows * width}, dt, MemCategory::comm);
  ensure(ws.ul_recv16, {rows * width}, dt, MemCategory::comm);
  ensure(ws.ul_seq32, {rows * width}, DType::f32, MemCategory::workspace);
  ensure(ws.ul_seq16, {rows * width}, dt, MemCategory::workspace);
  const ops::AttentionDims whole = ulysses_dims(d);
  // This rank's tokens, every head -> the sequence, this rank's head group.
  backend.head_groups({rows, n, {q, kv, kv}}, DType::f32, ws.qkv.raw(), ws.ul_send32.raw(), true);
  all_to_all_even(group, ws.ul_send32.raw(), ws.ul_recv32.raw(), rows * width / n, CommDType::f32,
                  "cp all-to-all qkv");
  backend.context_sequence(d, width / n, DType::f32, ws.ul_recv32.raw(), ws.ul_seq32.raw(), true);
  backend.attention_forward(whole, rope_table(), dt, ws.ul_seq32.data<float>(), ws.ul_seq16.raw(),
                            a.attn);
  // And the output back: this rank's tokens, every head.
  backend.context_sequence(d, q / n, dt, ws.ul_send16.raw(), ws.ul_seq16.raw(), false);
  all_to_all_even(group, ws.ul_send16.raw(), ws.ul_recv16.raw(), rows * q / n, comm_dtype(dt),
                  "cp all-to-all out");
  backend.head_groups({rows, n, {q}}, dt, a.att.raw(), ws.ul_recv16.raw(), false);
}

void Model::Impl::ulysses_backward(const BlockActs& a, DType dt, const ops::ContextDims& d,
                                   const float* d_att) {
  Communicator& group = *model.context_parallel().comm;
  const int64_t n = d.split.size, rows = d.batch * d.local_seq;
  const int64_t q = heads * cfg.head_dim(), kv = kv_heads * cfg.head_dim(), width = q + 2 * kv;
  const ops::AttentionDims whole = ulysses_dims(d);
  backend.head_groups({rows, n, {q}}, DType::f32, d_att, ws.ul_send32.raw(), true);
  all_to_all_even(group, ws.ul_send32.raw(), ws.ul_recv32.raw(), rows * q / n, CommDType::f32,
                  "cp all-to-all d out");
  backend.context_sequence(d, q / n, DType::f32, ws.ul_recv32.raw(), ws.ul_seq32.raw(), true);
  backend.attention_backward(whole, rope_table(), dt, a.attn, ws.ul_seq32.data<float>(),
                             ws.ul_seq16.raw());
  backend.context_sequence(d, width / n, dt, ws.ul_send16.raw(), ws.ul_seq16.raw(), false);
  all_to_all_even(group, ws.ul_send16.raw(), ws.ul_recv16.raw(), rows * width / n, comm_dtype(dt),
                  "cp all-to-all d qkv");
  backend.head_groups({rows, n, {q, kv, kv}}, dt, ws.dqkv.raw(), ws.ul_recv16.raw(), false);
}

void Model::Impl::ring_attention_forward(BlockActs& a, DType dt, const ops::ContextDims& d) {
  Communicator& group = *model.context_parallel().comm;
  const int rank = group.rank(), n = group.size(), next = (rank + 1) % n, prev = (rank + n - 1) % n;
  const int64_t block = d.kv_block();
  const CommDType cdt = comm_dtype(dt);
  // This rank's block stays (saved for backward, an activation like the
  // kernels' saved tensors in every pass); two buffers take the others in turn.
  ensure(a.attn.k, {block}, dt, MemCategory::activations);
  a.attn.v = Tensor();
  a.attn.probs = Tensor();
  ensure(ws.cp_kv_all, {2 * block}, dt, MemCategory::comm);
  backend.context_attention_project(d, rope_table(), dt, ws.qkv.data<float>(), a.attn,
                                    a.attn.k.raw());
  const void* current = a.attn.k.raw();
  for (int step = 0; step < n; ++step) {
    Work transfer;
    void* incoming = nullptr;
    if (step + 1 < n) {  // the next block arrives while this one is attended
      incoming = ws.cp_kv_all.view((step % 2) * block, {block}).raw();
      transfer = group.send_recv_async({P2POp{true, const_cast<void*>(current), block, cdt, next},
                                        P2POp{false, incoming, block, cdt, prev}});
    }
    backend.ring_attention_forward_block(d, dt, (rank + n - step) % n, current, a.attn, ws.ring,
                                         step == 0);
    if (incoming != nullptr) {
      trace::Span span("comm", "cp ring wait");
      transfer.wait();
      current = incoming;
    }
  }
  backend.ring_attention_forward_finish(d, dt, ws.ring, a.attn, a.att.raw());
}

void Model::Impl::ring_attention_backward(const BlockActs& a, DType dt, const ops::ContextDims& d,
                                          const float* d_att) {
  Communicator& group = *model.context_parallel().comm;
  const int rank = group.rank(), n = group.size(), next = (rank + 1) % n, prev = (rank + n - 1) % n;
  const int64_t block = d.kv_block();
  const CommDType cdt = comm_dtype(dt);
  ensure(ws.cp_kv_all, {2 * block}, dt, MemCategory::comm);
  ensure(ws.cp_dkv_all, {2 * block}, DType::f32, MemCategory::comm);
  ensure(ws.cp_dq, {d.batch * d.n_heads * d.local_seq * d.head_dim}, DType::f32,
         MemCategory::workspace);
  ws.cp_dq.zero();
  // The accumulator of the block in hand's dK/dV travels with it.
  ws.cp_dkv_all.view(0, {block}).zero();
  float* acc = ws.cp_dkv_all.data<float>();
  float* arriving = acc + block;
  const void* current = a.attn.k.raw();
  for (int step = 0; step < n; ++step) {
    Work transfer;
    void* incoming = nullptr;
    if (step + 1 < n) {
      incoming = ws.cp_kv_all.view((step % 2) * block, {block}).raw();
      transfer = group.send_recv_async({P2POp{true, const_cast<void*>(current), block, cdt, next},
                                        P2POp{false, incoming, block, cdt, prev}});
    }
    backend.ring_attention_backward_block(d, dt, (rank + n - step) % n, current, a.attn, d_att,
                                          a.att.raw(), ws.cp_dq.data<float>(), acc);
    {
      // The block's gradients so far go on with it; the previous rank's come in.
      trace::Span span("comm", "cp ring dk/dv");
      group
          .send_recv_async({P2POp{true, acc, block, CommDType::f32, next},
                            P2POp{false, arriving, block, CommDType::f32, prev}})
          .wait();
      if (incoming != nullptr) transfer.wait();
    }
    std::swap(acc, arriving);
    if (incoming != nullptr) current = incoming;
  }
  // After n steps the accumulator in hand is this rank's block's, summed over the group.
  backend.context_attention_finish(d, rope_table(), dt, acc, ws.cp_dq.data<float>(), ws.dqkv.raw());
}

std::array<ops::GroupNormDims, 2> Model::Impl::qk_norm_dims(const Block& b, int64_t rows) const {
  const int64_t hd = cfg.head_dim(), q = heads * hd, k = kv_heads * hd;
  const bool per_head = cfg.qk_norm == QkNorm::head;
  return {ops::GroupNormDims{rows, b.qkv.out, q, per_head ? hd : q, cfg.norm_eps},
          ops::GroupNormDims{rows, b.qkv.out, k, per_head ? hd : k, cfg.norm_eps}};
}

void Model::Impl::qk_norm_forward(const Block& b, BlockActs& a, int64_t rows) {
  const auto [q, k] = qk_norm_dims(b, rows);
  ensure(a.qk, {rows, q.count + k.count}, DType::f32, a.category);
  ensure(a.qk_rstd, {rows * (q.groups() + k.groups())}, DType::f32, a.category);
  float* x = ws.qkv.data<float>();
  backend.group_rmsnorm_forward(q, x, master(b.qk_norm.q), a.qk.data<float>(),
                                a.qk_rstd.data<float>());
  backend.group_rmsnorm_forward(k, x + q.count, master(b.qk_norm.k),
                                a.qk.data<float>() + rows * q.count,
                                a.qk_rstd.data<float>() + rows * q.groups());
}

void Model::Impl::qk_norm_backward(const Block& b, const BlockActs& a, DType dt, int64_t rows) {
  const auto [q, k] = qk_norm_dims(b, rows);
  // Both weights' gradients in one buffer: under tp each rank saw its heads
  // only (per-head norm; full norm refuses tp), so they are summed over tp.
  ensure(ws.qk_norm_grads, {q.width + k.width}, DType::f32, MemCategory::workspace);
  ws.qk_norm_grads.zero();
  float* dw = ws.qk_norm_grads.data<float>();
  char* dy = static_cast<char*>(ws.dqkv.raw());
  backend.group_rmsnorm_backward(q, a.qk.data<float>(), master(b.qk_norm.q),
                                 a.qk_rstd.data<float>(), dt, dy, dw);
  backend.group_rmsnorm_backward(k, a.qk.data<float>() + rows * q.count, master(b.qk_norm.k),
                                 a.qk_rstd.data<float>() + rows * q.groups(), dt,
                                 dy + static_cast<size_t>(q.count) * dtype_size(dt), dw + q.width);
  if (tp.active()) tp_all_reduce_sum(tp, dw, q.width + k.width);
  if (trains(b.qk_norm.k)) backend.add_inplace(grad(b.qk_norm.k), dw + q.width, k.width);
  ready(b.qk_norm.k);
  if (trains(b.qk_norm.q)) backend.add_inplace(grad(b.qk_norm.q), dw, q.width);
  ready(b.qk_norm.q);
}

void Model::Impl::mlp_activation(const Tensor& pre, DType dt, Tensor& act, int64_t rows,
                                 int64_t width, MemCategory category) {
  ensure(act, {rows, width}, dt, category);
  if (cfg.recipe().feed_forward == FeedForward::swiglu) {
    backend.swiglu_forward(pre.data<float>(), dt, act.raw(), rows, width);
  } else {
    backend.gelu_forward(pre.data<float>(), dt, act.raw(), rows * width);
  }
}

const float* Model::Impl::ffn_backward(const Linear& in, const Linear& out, DType dt,
                                      const void* dy, const float* dy_f32, const Tensor& pre,
                                      const Tensor& act, const Tensor& x, int64_t rows,
                                      int64_t width) {
  ensure(ws.dff_c, {rows, in.out}, dt, MemCategory::workspace);
  float* dff = ws.dff.data<float>();
  linear_backward(out, dt, dy, dy_f32, act.raw(), rows, dff, nullptr);
  if (cfg.recipe().feed_forward == FeedForward::swiglu) {
    backend.swiglu_backward(pre.data<float>(), dff, dt, ws.dff_c.raw(), rows, width);
  } else {
    backend.gelu_backward(pre.data<float>(), dff, dt, ws.dff_c.raw(), rows * width);
  }
  return column_parallel_backward(in, dt, ws.dff_c.raw(), x, rows, dff);
}

void Model::Impl::backward_block(int64_t layer, const Tensor& x, BlockActs& a, DType dt,
                                 int64_t batch, int64_t seq) {
  const Block& b = block(layer);
  const int64_t rows = batch * seq, srows = shard_rows(rows), h = hidden;
  const MemCategory wsc = MemCategory::workspace;
  ensure(ws.dx, {rows, dx_width()}, DType::f32, wsc);
  ensure(ws.dff, {rows, std::max({h, b.qkv.out, cfg.moe.shared_hidden})}, DType::f32, wsc);
  ensure(ws.dqkv, {rows, b.qkv.out}, dt, wsc);
  float* dres = ws.dres.data<float>();
  float* dx = ws.dx.data<float>();
  float* dff = ws.dff.data<float>();

  // Feed-forward sub-block, in reverse.
  const float* dxn = nullptr;
  if (b.moe.enabled()) {
    dxn = moe_backward(layer, b, a, dt, rows);
  } else {
    const Tensor& dy = full_residual_grad(rows);
    dxn = ffn_backward(b.ff_in, b.ff_out, dt, residual_grad_compute(dt, dy, rows),
                       dy.data<float>(), a.ff_pre, a.ff_act, a.xn2, rows, h);
  }
  norm_backward(b.norm2, a.mid, a.mean2, a.rstd2, dxn, dres, srows);  // dres += d(norm2 input)

  // Attention sub-block, in reverse.
  const Tensor* dy = &full_residual_grad(rows);
  const void* dres_c = residual_grad_compute(dt, *dy, rows);
  linear_backward(b.proj, dt, dres_c, dy->data<float>(), a.att.raw(), rows, dx, nullptr);
  if (model.context_parallel().active()) {
    context_attention_backward(a, dt, batch, seq, dx);
  } else {
    backend.attention_backward(attention_dims(batch, seq), rope_table(), dt, a.attn, dx,
                               ws.dqkv.raw());
  }
  if (b.qk_norm.enabled()) qk_norm_backward(b, a, dt, rows);
  dxn = column_parallel_backward(b.qkv, dt, ws.dqkv.raw(), a.xn1, rows, dff);
  norm_backward(b.norm1, x, a.mean1, a.rstd1, dxn, dres, srows);
  flush_norm_grads();
}

}  // namespace meshtrain
