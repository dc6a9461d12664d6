// Model construction, the flat parameter buffers and the public passes.
// The per-block math is in block.cpp.
#include "meshtrain/model/model.h"

#include <fmt/format.h>

#include <algorithm>
#include <functional>
#include <numeric>

#include "meshtrain/backend/backend.h"
#include "meshtrain/model/model_impl.h"
#include "meshtrain/tensor/nf4.h"
#include "meshtrain/util/error.h"
#include "meshtrain/util/trace.h"

namespace meshtrain {

Model::Model(const ModelConfig& config, Precision precision, Backend& backend, ParamStorage storage,
             const TensorParallel& tp, const StageLayers& stage, const ExpertParallel& ep)
    : config_(config),
      precision_(precision),
      backend_(backend),
      storage_(storage),
      tp_(tp),
      stage_(stage),
      ep_(ep) {
  config_.validate();
  check_tensor_parallel_split(config_, tp_.size());
  std::vector<ParamSpec> specs =
      build_param_specs(config_, tp_.rank(), tp_.size(), ep_.rank(), ep_.size());
  select_stage(specs);
  // Flat buffers in registry order: master (parameters with an f32 master),
  // grad (trainable ones), compute (matmul weights in mixed precision, so
  // q|k|v and gate|up stay adjacent there too).
  const DType narrow = compute_dtype(precision_);
  const bool mixed = narrow != DType::f32;
  int64_t master_total = 0, compute_total = 0, nf4_words = 0;
  for (const ParamSpec& spec : specs) {
    num_params_ += spec.numel();
    if (spec.trainable) num_trainable_ += spec.numel();
    if (param_has_master(spec, precision_)) master_total += spec.numel();
    if (spec.matmul_weight && !spec.nf4) compute_total += spec.numel();
    if (spec.nf4) nf4_words += nf4_layout(spec).bytes / 4;
  }
  holds_nf4_ = nf4_words > 0;
  const bool flat = storage_ == ParamStorage::flat;
  if (flat && holds_nf4_) flat_nf4_ = backend.allocate({nf4_words}, DType::i32, MemCategory::params);
  if (flat) {
    flat_master_ = backend.allocate({master_total}, DType::f32, MemCategory::params);
    flat_grad_ = backend.allocate({num_trainable_}, DType::f32, MemCategory::grads);
  }
  if (flat && mixed) {
    flat_compute_ = backend.allocate({compute_total}, narrow, MemCategory::params);
  }
  int64_t offset = 0, master_offset = 0, grad_offset = 0, compute_offset = 0, nf4_offset = 0;
  params_.reserve(specs.size());
  for (ParamSpec& spec : specs) {
    Parameter p;
    p.offset = offset;
    p.grad_offset = spec.trainable ? grad_offset : -1;
    const bool has_master = param_has_master(spec, precision_);
    if (flat) {
      if (has_master) p.master = flat_master_.view(master_offset, spec.shape);
      if (spec.trainable) p.grad = flat_grad_.view(grad_offset, spec.shape);
      if (mixed && spec.matmul_weight && !spec.nf4) {
        p.compute = flat_compute_.view(compute_offset, spec.shape);
        compute_offset += spec.numel();
      }
    }
    if (flat && spec.nf4) {
      const int64_t words = nf4_layout(spec).bytes / 4;
      p.nf4 = flat_nf4_.view(nf4_offset, {words});
      nf4_offset += words;
    }
    offset += spec.numel();
    if (has_master) master_offset += spec.numel();
    if (spec.trainable) grad_offset += spec.numel();
    p.spec = std::move(spec);
    params_.push_back(std::move(p));
  }
  impl_ = std::make_unique<Impl>(*this);
}

Model::~Model() = default;

void Model::Impl::before(size_t unit, UnitPass pass) {
  if (model.unit_hooks.before) model.unit_hooks.before(unit, pass);
  if (model.storage_ == ParamStorage::external) check_bound(unit, pass);
}

void Model::Impl::after(size_t unit, UnitPass pass) {
  MESHTRAIN_CHECK(pass == UnitPass::forward || next_ready == model.units_[unit].first_param,
                  "model: unit '{}' finished backward with gradients still missing",
                  model.units_[unit].name);
  if (model.unit_hooks.after) model.unit_hooks.after(unit, pass);
}

namespace {

void check_view(const Tensor& view, DType dtype, const Parameter& p, const char* field,
                const ParamUnit& unit) {
  MESHTRAIN_CHECK(view.defined() && view.dtype() == dtype && view.numel() == p.spec.numel(),
                  "model: external storage: parameter '{}' (unit '{}') needs its {} view bound "
                  "({} x {}) before the model uses it; found {}",
                  p.spec.name, unit.name, field, dtype_name(dtype), shape_str(p.spec.shape),
                  view.defined() ? fmt::format("{} x {}", dtype_name(view.dtype()),
                                               shape_str(view.shape()))
                                 : std::string("nothing"));
}

// q|k|v and gate|up run as one GEMM over adjacent weights. A routed MoE
// layer has no dense feed-forward: its ff_in / ff_out hold no weight.
void check_adjacent(const std::vector<Parameter>& params, const Linear& lin, Precision precision) {
  if (lin.weight == kNoParam) return;
  if (params[lin.weight].spec.nf4) return;  // dequantised together into one workspace
  for (size_t k = 1; k < lin.n_weights; ++k) {
    const Parameter& prev = params[lin.weight + k - 1];
    const Parameter& p = params[lin.weight + k];
    const bool f32 = param_compute_dtype(p.spec, precision) == DType::f32;
    const Tensor& a = f32 ? prev.master : prev.compute;
    const Tensor& b = f32 ? p.master : p.compute;
    const bool values = static_cast<const char*>(a.raw()) + a.bytes() == b.raw();
    const bool grads = !prev.grad.defined() || !p.grad.defined() ||
                       static_cast<const char*>(prev.grad.raw()) + prev.grad.bytes() ==
                           p.grad.raw();
    MESHTRAIN_CHECK(values && grads,
                    "model: external storage: '{}' must directly follow '{}' in memory (value "
                    "and grad views): they are one GEMM",
                    p.spec.name, prev.spec.name);
  }
}

}  // namespace

void Model::Impl::check_bound(size_t unit, UnitPass pass) const {
  const ParamUnit& u = model.units_[unit];
  const std::vector<Parameter>& params = model.params_;
  for (size_t i = u.first_param; i < u.end_param; ++i) {
    const Parameter& p = params[i];
    if (p.spec.nf4) {
      const int64_t words = nf4_layout(p.spec).bytes / 4;
      MESHTRAIN_CHECK(p.nf4.defined() && p.nf4.dtype() == DType::i32 && p.nf4.numel() == words,
                      "model: external storage: NF4 weight '{}' (unit '{}') needs its nf4 view "
                      "bound (i32 x {}) before the model uses it",
                      p.spec.name, u.name, words);
      continue;
    }
    const DType dt = param_compute_dtype(p.spec, model.precision_);
    check_view(dt == DType::f32 ? p.master : p.compute, dt, p, dt == DType::f32 ? "master" : "compute",
               u);
    // The embedding lookup reads a bound f32 master of a bf16 embedding.
    if (dt != DType::f32 && p.master.defined()) check_view(p.master, DType::f32, p, "master", u);
    if (pass == UnitPass::backward && p.spec.trainable) check_view(p.grad, DType::f32, p, "grad", u);
  }
  if (layer_of_unit[unit] >= 0) {
    const Block& b = block(layer_of_unit[unit]);
    for (const Linear* lin : {&b.qkv, &b.proj, &b.ff_in, &b.ff_out}) {
      check_adjacent(params, *lin, model.precision_);
    }
  }
}

const Parameter& Model::param(const std::string& name) const {
  for (const Parameter& p : params_) {
    if (p.spec.name == name) return p;
  }
  fail("unknown parameter '{}' in {} model", name, family_name(config_.family));
}

Parameter& Model::param(const std::string& name) {
  return const_cast<Parameter&>(static_cast<const Model&>(*this).param(name));
}

void Model::require_flat(const char* what) const {
  if (storage_ == ParamStorage::external) {
    fail("model: {} needs flat parameter storage; this model's parameters are external "
         "(bound by their owner, e.g. ZeRO)",
         what);
  }
}

std::vector<TensorSplit> Model::param_splits() const {
  std::vector<TensorSplit> splits;
  splits.reserve(params_.size());
  for (const Parameter& p : params_) splits.push_back(p.spec.split);
  return splits;
}

Tensor& Model::flat_master() {
  require_flat("flat_master()");
  return flat_master_;
}

Tensor& Model::flat_grad() {
  require_flat("flat_grad()");
  return flat_grad_;
}

void Model::init_weights(uint64_t seed) {
  require_flat("init_weights");
  // Drawn on the host, uploaded through the backend.
  std::vector<float> values;
  std::vector<char> narrow;
  for (Parameter& p : params_) {
    if (p.spec.nf4) {  // quantised whole, then sliced: the tp = 1 values on every layout
      const ParamSpec whole = whole_spec(p.spec);
      values.resize(static_cast<size_t>(whole.numel()));
      init_parameter(whole, seed, values.data());
      copy_nf4_from_global(p, values.data());
      continue;
    }
    values.resize(static_cast<size_t>(p.spec.numel()));
    init_parameter(p.spec, seed, values.data());
    if (p.master.defined()) {
      copy_master_from_host(p, values.data());
      continue;
    }
    narrow.resize(p.compute.bytes());  // a frozen compute-only weight
    convert(DType::f32, values.data(), p.compute.dtype(), narrow.data(), values.size());
    backend_.copy_from_host(narrow.data(), p.compute);
  }
  sync_compute_weights();
}

namespace {

// The value views of state-space elements [offset, offset + count): an f32
// master, or (a frozen mixed-precision weight) its compute copy, converted on
// the host; an NF4 weight's runs go to `quantized` (read_values / write_values).
// to_model: copy `values` into the model, else out of it.
void copy_values(Backend& backend, std::vector<Parameter>& params, int64_t total, int64_t offset,
                 int64_t count, float* values, bool to_model,
                 const std::function<void(Parameter&, int64_t, int64_t, float*)>& quantized) {
  MESHTRAIN_CHECK(offset >= 0 && count >= 0 && offset + count <= total,
                  "model: state range [{}, {}) outside {} elements", offset, offset + count,
                  total);
  if (!to_model) backend.synchronize();
  std::vector<char> narrow;
  for_each_state_run(params, offset, count, [&](Parameter& p, int64_t at, int64_t n, int64_t pos) {
    if (p.spec.nf4) return quantized(p, at, n, values + pos);
    const Tensor& value = p.master.defined() ? p.master : p.compute;
    const Tensor run = value.view(at, {n});
    if (value.dtype() == DType::f32) {
      if (to_model) {
        backend.copy_from_host(values + pos, run);
      } else {
        backend.copy_to_host(run, values + pos);
      }
      return;
    }
    narrow.resize(run.bytes());
    if (to_model) {
      convert(DType::f32, values + pos, run.dtype(), narrow.data(), static_cast<size_t>(n));
      backend.copy_from_host(narrow.data(), run);
    } else {
      backend.copy_to_host(run, narrow.data());
      convert(run.dtype(), narrow.data(), DType::f32, values + pos, static_cast<size_t>(n));
    }
  });
}

}  // namespace

void Model::read_values(int64_t offset, int64_t count, float* out) {
  require_flat("read_values");
  std::vector<float> whole;
  copy_values(backend_, params_, num_params_, offset, count, out, false,
              [&](Parameter& p, int64_t at, int64_t n, float* values) {
                whole.resize(static_cast<size_t>(p.spec.numel()));
                copy_master_to_host(p, whole.data());
                std::copy_n(whole.begin() + at, n, values);
              });
}

void Model::write_values(int64_t offset, int64_t count, const float* in) {
  require_flat("write_values");
  copy_values(backend_, params_, num_params_, offset, count, const_cast<float*>(in), true,
              [&](Parameter& p, int64_t at, int64_t n, float* values) {
                // Quantised once the whole tensor has arrived (loaders write
                // each element once, in pieces).
                NF4Staging& s = nf4_staging_[p.offset];
                s.values.resize(static_cast<size_t>(p.spec.numel()));
                std::copy_n(values, n, s.values.begin() + at);
                s.written += n;
                if (s.written < p.spec.numel()) return;
                copy_master_from_host(p, s.values.data());
                nf4_staging_.erase(p.offset);
              });
}

void Model::copy_master_to_host(const Parameter& p, float* dst) const {
  backend_.synchronize();
  if (!p.spec.nf4) return backend_.copy_to_host(p.master, dst);
  MESHTRAIN_CHECK(p.nf4.defined(), "model: NF4 weight '{}' is not held here (ZeRO-3 shards it)",
                  p.spec.name);
  std::vector<uint8_t> packed(p.nf4.bytes());
  backend_.copy_to_host(p.nf4, packed.data());
  nf4::dequantize(packed, {dst, static_cast<size_t>(p.spec.numel())}, nf4_layout(p.spec).form);
}

namespace {

// `n` values quantised as one tensor, in `form` (a slice of all its blocks).
std::vector<uint8_t> quantize_as(const float* values, int64_t n, nf4::Form form) {
  std::vector<uint8_t> whole(static_cast<size_t>(nf4::layout(n).bytes));
  nf4::quantize({values, static_cast<size_t>(n)}, whole);
  if (form == nf4::Form::whole) return whole;
  std::vector<int64_t> blocks(static_cast<size_t>(n / nf4::kBlock));
  std::iota(blocks.begin(), blocks.end(), int64_t{0});
  std::vector<uint8_t> sliced(static_cast<size_t>(nf4::layout(n, form).bytes));
  nf4::slice(whole, n, blocks, sliced);
  return sliced;
}

}  // namespace

void Model::copy_master_from_host(Parameter& p, const float* src) {
  if (!p.spec.nf4) return backend_.copy_from_host(src, p.master);
  backend_.copy_from_host(quantize_as(src, p.spec.numel(), nf4_layout(p.spec).form).data(), p.nf4);
}

void Model::copy_nf4_from_global(Parameter& p, const float* global) {
  MESHTRAIN_CHECK(p.spec.nf4, "model: '{}' is not an NF4 weight", p.spec.name);
  const int64_t n = shape_numel(p.spec.split.global_shape);
  std::vector<uint8_t> packed = quantize_as(global, n, nf4::Form::whole);
  const nf4::Layout layout = nf4_layout(p.spec);
  if (layout.form == nf4::Form::slice) {
    std::vector<uint8_t> sliced(static_cast<size_t>(layout.bytes));
    nf4::slice(packed, n, nf4_slice_blocks(p.spec), sliced);
    packed = std::move(sliced);
  }
  if (p.nf4.defined()) return backend_.copy_from_host(packed.data(), p.nf4);
  MESHTRAIN_CHECK(nf4_writer != nullptr, "model: NF4 weight '{}' has no storage bound",
                  p.spec.name);
  nf4_writer(static_cast<size_t>(&p - params_.data()), packed);
}

void Model::add_to_master(Parameter& p, std::span<const float> delta) {
  MESHTRAIN_CHECK(static_cast<int64_t>(delta.size()) == p.spec.numel() && !p.compute.defined(),
                  "model: add_to_master of '{}' needs {} values and an f32 parameter",
                  p.spec.name, p.spec.numel());
  std::vector<float> values(delta.size());
  copy_master_to_host(p, values.data());
  for (size_t k = 0; k < values.size(); ++k) values[k] += delta[k];
  copy_master_from_host(p, values.data());
}

void Model::sync_compute_weights() {
  require_flat("sync_compute_weights");
  for (Parameter& p : params_) {
    if (p.compute.defined() && p.master.defined()) p.compute.copy_from(p.master);
  }
}

void Model::zero_grads() {
  require_flat("zero_grads");
  flat_grad_.zero();
}

void Model::set_adapters_enabled(bool on) { impl_->adapters_on = on; }

void Model::set_lora_dropout(uint64_t seed, int64_t step, std::vector<int64_t> samples) {
  impl_->dropout.seed = seed;
  impl_->dropout.step = step;
  impl_->dropout.samples = std::move(samples);
}

namespace {

// Adapter dropout on for one training pass (model.h set_lora_dropout).
struct DropoutScope {
  bool& active;
  DropoutScope(bool& flag, bool on) : active(flag) { active = on; }
  ~DropoutScope() { active = false; }
};

}  // namespace

double Model::forward_backward(const int32_t* tokens, const int32_t* targets, int64_t batch,
                               int64_t seq, float grad_scale, const int32_t* positions,
                               const TokenLoss& loss_out) {
  require_whole("forward_backward");
  Impl& m = *impl_;
  const Impl::PassPositions pass(m, positions, batch * seq);
  const bool drop = config_.lora.enabled() && config_.lora.dropout > 0;
  MESHTRAIN_CHECK(!drop || static_cast<int64_t>(m.dropout.samples.size()) == batch,
                  "model: lora.dropout needs set_lora_dropout with the sample index of each of "
                  "the micro-batch's {} rows (got {})",
                  batch, m.dropout.samples.size());
  m.dropout.seq = seq;
  DropoutScope dropping(m.dropout.active, drop);
  const DType dt = compute_dtype(precision_);
  const int64_t rows = batch * seq, d = config_.dim;
  m.check_tokens(targets, rows, true, "target");
  m.aux_weight = grad_scale * static_cast<float>(rows);
  const Tensor& last = m.forward_trunk(m.train, tokens, batch, seq, dt, true);
  m.before(m.head_unit, UnitPass::forward);
  const void* hn = m.column_input(m.final_norm, last, dt, m.train.hn, m.train.mean_f,
                                  m.train.rstd_f, rows, m.train.category);
  m.after(m.head_unit, UnitPass::forward);

  // The fused classifier computes the loss and its gradients in one call: in
  // training it belongs to the head's backward.
  m.next_ready = params_.size();
  m.before(m.head_unit, UnitPass::backward);
  if (m.tied) m.before(m.embed_unit, UnitPass::backward);
  m.ensure(m.ws.dx, {rows, m.dx_width()}, DType::f32, MemCategory::workspace);
  m.ensure(m.ws.dres, {m.shard_rows(rows), d}, DType::f32, MemCategory::workspace);
  ops::ClassifierArgs args = m.classifier_args(hn, targets, rows, dt);
  args.grad_scale = grad_scale;
  args.dh = m.ws.dx.data<float>();
  args.dw = m.trains(m.output) ? m.grad(m.output) : nullptr;
  m.weigh(args, loss_out);
  trace::Span classifier_span("backward", "classifier");
  const double loss = backend_.fused_classifier(args);
  m.fetch_losses(loss_out, rows);
  if (!m.tied) m.ready(m.output);
  m.ws.dres.zero();
  m.norm_backward(m.final_norm, last, m.train.mean_f, m.train.rstd_f, m.reduce_input_grad(rows),
                  m.ws.dres.data<float>(), m.shard_rows(rows));
  m.flush_norm_grads();
  m.after(m.head_unit, UnitPass::backward);
  classifier_span.end();
  for (int64_t l = config_.n_layers - 1; l >= 0; --l) {
    const size_t i = static_cast<size_t>(l);
    m.before(m.layer_unit(l), UnitPass::backward);
    m.train_backward_block(l, m.train.residual[i], m.train.blocks[i], m.train.residual[i + 1], dt,
                           batch, seq);
    m.after(m.layer_unit(l), UnitPass::backward);
  }
  if (!m.tied) m.before(m.embed_unit, UnitPass::backward);
  m.embed_backward(tokens, batch, seq);
  if (m.positions != kNoParam) m.ready(m.positions);
  m.ready(m.embed);
  m.after(m.embed_unit, UnitPass::backward);
  return loss;
}

double Model::forward_loss(const int32_t* tokens, const int32_t* targets, int64_t batch,
                           int64_t seq, const int32_t* positions, const TokenLoss& loss_out) {
  require_whole("forward_loss");
  Impl& m = *impl_;
  const Impl::PassPositions pass(m, positions, batch * seq);
  const DType dt = compute_dtype(precision_);
  m.check_tokens(targets, batch * seq, true, "target");
  Activations acts;
  const Tensor& last = m.forward_trunk(acts, tokens, batch, seq, dt, false);
  double loss = 0;
  m.head_forward(acts, last, dt, [&] {
    ops::ClassifierArgs args = m.classifier_args(acts.head_input, targets, batch * seq, dt);
    m.weigh(args, loss_out);
    loss = backend_.fused_classifier(args);
    m.fetch_losses(loss_out, batch * seq);
  });
  return loss;
}

void Model::forward_logits(const int32_t* tokens, int64_t batch, int64_t seq, float* logits,
                           const int32_t* positions) {
  require_whole("forward_logits");
  Impl& m = *impl_;
  const Impl::PassPositions pass(m, positions, batch * seq);
  const DType dt = compute_dtype(precision_);
  Activations acts;
  const Tensor& last = m.forward_trunk(acts, tokens, batch, seq, dt, false);
  m.head_forward(acts, last, dt, [&] {
    const int64_t rows = batch * seq;
    // This rank's vocabulary columns (all of them without tp), then every
    // rank's slices, copied to the host and into place.
    const int64_t vl = m.vocab_rows, n = tp_.size();
    Tensor local = backend_.allocate({n, rows, vl}, DType::f32, MemCategory::workspace);
    ops::MatmulDims dims{.m = rows, .n = vl, .k = config_.dim, .trans_b = true};
    backend_.matmul(dims, dt, acts.head_input, m.weight(m.output, dt), DType::f32,
                    local.data<float>() + tp_.rank() * rows * vl);
    if (tp_.active()) tp_all_gather_rows(tp_, local.raw(), rows, vl, DType::f32);
    backend_.synchronize();
    if (!tp_.active()) {
      backend_.copy_to_host(local, logits);
      return;
    }
    std::vector<float> slices(static_cast<size_t>(local.numel()));
    backend_.copy_to_host(local, slices.data());
    const TensorSplit& split = params_[m.output].spec.split;
    for (int r = 0; r < n; ++r) {
      const int64_t valid = split.for_rank(r).chunk_valid(), first = r * split.chunk();
      for (int64_t i = 0; valid > 0 && i < rows; ++i) {
        const float* src = slices.data() + (r * rows + i) * vl;
        std::copy(src, src + valid, logits + i * config_.vocab_size + first);
      }
    }
  });
}

KVCache Model::make_kv_cache(int64_t batch, int64_t max_seq) {
  MESHTRAIN_CHECK(batch > 0, "kv cache: batch must be > 0, got {}", batch);
  MESHTRAIN_CHECK(max_seq > 0 && max_seq <= config_.max_seq_len,
                  "kv cache: max_seq {} must be in [1, model.max_seq_len {}]", max_seq,
                  config_.max_seq_len);
  KVCache cache;
  cache.batch = batch;
  cache.max_seq = max_seq;
  const Shape shape{batch, config_.n_kv_heads, max_seq, config_.head_dim()};
  for (int64_t l = 0; l < config_.n_layers; ++l) {
    ops::KVCacheLayer layer;
    layer.k = backend_.allocate(shape, DType::f32, MemCategory::activations);
    layer.v = backend_.allocate(shape, DType::f32, MemCategory::activations);
    cache.layers.push_back(std::move(layer));
  }
  return cache;
}

// Decoding runs in f32 on the master weights in both precisions: it is not a
// training path, and f32 keeps sampling independent of the compute copies.
void Model::decode(const int32_t* tokens, int64_t batch, int64_t n_new, KVCache& cache,
                   float* last_logits) {
  require_flat("decode (it reads every f32 master weight)");
  require_whole("decode");
  MESHTRAIN_CHECK(!tp_.active(), "decode: not supported under tensor parallelism (tp = {})",
                  tp_.size());
  MESHTRAIN_CHECK(!ep_.active(), "decode: not supported under expert parallelism (ep = {})",
                  ep_.size());
  Impl& m = *impl_;
  const int64_t d = config_.dim, pos0 = cache.length;
  MESHTRAIN_CHECK(batch == cache.batch, "decode: batch {} differs from the kv cache's batch {}",
                  batch, cache.batch);
  MESHTRAIN_CHECK(n_new > 0 && pos0 + n_new <= cache.max_seq,
                  "decode: {} new tokens at position {} exceed the kv cache length {}", n_new, pos0,
                  cache.max_seq);
  MESHTRAIN_CHECK(static_cast<int64_t>(cache.layers.size()) == config_.n_layers,
                  "decode: kv cache has {} layers, model has {}", cache.layers.size(),
                  config_.n_layers);
  Activations acts;
  const Tensor& residual = m.forward_trunk(acts, tokens, batch, n_new, DType::f32, false, &cache);
  m.head_forward(acts, residual, DType::f32, [&] {
    // Logits of each sequence's last position only.
    Tensor last = backend_.allocate({batch, d}, DType::f32, MemCategory::workspace);
    for (int64_t b = 0; b < batch; ++b) {
      last.view(b * d, {d}).copy_from(acts.hn.view((b * n_new + n_new - 1) * d, {d}));
    }
    Tensor logits = backend_.allocate({batch, config_.vocab_size}, DType::f32,
                                      MemCategory::workspace);
    ops::MatmulDims dims{.m = batch, .n = config_.vocab_size, .k = d, .trans_b = true};
    backend_.matmul(dims, DType::f32, last.raw(), m.master(m.output), DType::f32, logits.raw());
    backend_.synchronize();
    backend_.copy_to_host(logits, last_logits);
  });
  cache.length += n_new;
}

}  // namespace meshtrain
