// Model construction, the flat parameter buffers and the public passes.
// The per-block math is in block.cpp.
#include "meshtrain/model/model.h"

#include "meshtrain/backend/cpu/cross_entropy.h"
#include "meshtrain/backend/cpu/embedding.h"
#include "meshtrain/backend/cpu/matmul.h"
#include "meshtrain/model/model_impl.h"
#include "meshtrain/util/error.h"

namespace meshtrain {

Model::Model(const ModelConfig& config, Precision precision, cpu::CpuContext& ctx)
    : config_(config), precision_(precision), ctx_(ctx) {
  config_.validate();
  std::vector<ParamSpec> specs = build_param_specs(config_);
  int64_t total = 0, compute_total = 0;
  for (const ParamSpec& spec : specs) {
    total += spec.numel();
    if (spec.matmul_weight) compute_total += spec.numel();
  }
  MemoryTracker& tracker = ctx.tracker();
  flat_master_ = Tensor({total}, DType::f32, MemCategory::params, tracker);
  flat_grad_ = Tensor({total}, DType::f32, MemCategory::grads, tracker);
  // Only matmul weights get compute copies, packed in registry order (so q|k|v
  // and gate|up stay adjacent there too).
  const bool bf16 = precision_ == Precision::bf16;
  if (bf16) flat_compute_ = Tensor({compute_total}, DType::bf16, MemCategory::params, tracker);
  int64_t offset = 0, compute_offset = 0;
  params_.reserve(specs.size());
  for (ParamSpec& spec : specs) {
    Parameter p;
    p.offset = offset;
    p.master = flat_master_.view(offset, spec.shape);
    p.grad = flat_grad_.view(offset, spec.shape);
    if (bf16 && spec.matmul_weight) {
      p.compute = flat_compute_.view(compute_offset, spec.shape);
      compute_offset += spec.numel();
    }
    offset += spec.numel();
    p.spec = std::move(spec);
    params_.push_back(std::move(p));
  }
  impl_ = std::make_unique<Impl>(*this);
}

Model::~Model() = default;

const Parameter& Model::param(const std::string& name) const {
  for (const Parameter& p : params_) {
    if (p.spec.name == name) return p;
  }
  fail("unknown parameter '{}' in {} model", name, family_name(config_.family));
}

Parameter& Model::param(const std::string& name) {
  return const_cast<Parameter&>(static_cast<const Model&>(*this).param(name));
}

void Model::init_weights(uint64_t seed) {
  for (Parameter& p : params_) init_parameter(p.spec, seed, p.master.data<float>());
  sync_compute_weights();
}

void Model::sync_compute_weights() {
  for (Parameter& p : params_) {
    if (p.compute.defined()) p.compute.copy_from(p.master);
  }
}

void Model::zero_grads() { flat_grad_.zero(); }

double Model::forward_backward(const int32_t* tokens, const int32_t* targets, int64_t batch,
                               int64_t seq, float grad_scale) {
  Impl& m = *impl_;
  const DType dt = compute_dtype(precision_);
  const int64_t rows = batch * seq, d = config_.dim;
  m.check_tokens(targets, rows, true, "target");
  m.forward_trunk(m.train, tokens, batch, seq, dt, true);

  m.ensure(m.ws.dx, {rows, d}, DType::f32, MemCategory::workspace);
  m.ensure(m.ws.dres, {rows, d}, DType::f32, MemCategory::workspace);
  cpu::ClassifierArgs args;
  args.rows = rows;
  args.dim = d;
  args.vocab = config_.vocab_size;
  args.compute = dt;
  args.h = m.train.hn.raw();
  args.w = m.weight(m.output, dt);
  args.targets = targets;
  args.grad_scale = grad_scale;
  args.dh = m.ws.dx.data<float>();
  args.dw = m.grad(m.output);
  const double loss = cpu::fused_classifier(ctx_, args);

  m.next_ready = params_.size();
  if (m.output != m.embed) m.ready(m.output);
  const Tensor& last = m.train.residual.back();
  m.ws.dres.zero();
  m.norm_backward(m.final_norm, last, m.train.mean_f, m.train.rstd_f, m.ws.dx.data<float>(),
                  m.ws.dres.data<float>(), rows);
  for (int64_t l = config_.n_layers - 1; l >= 0; --l) {
    const size_t i = static_cast<size_t>(l);
    m.backward_block(l, m.train.residual[i], m.train.blocks[i], dt, batch, seq);
  }
  float* dpositions = m.positions != kNoParam ? m.grad(m.positions) : nullptr;
  cpu::embedding_backward(tokens, m.ws.dres.data<float>(), m.grad(m.embed), dpositions, batch, seq,
                          d);
  if (m.positions != kNoParam) m.ready(m.positions);
  m.ready(m.embed);
  return loss;
}

double Model::forward_loss(const int32_t* tokens, const int32_t* targets, int64_t batch,
                           int64_t seq) {
  Impl& m = *impl_;
  const DType dt = compute_dtype(precision_);
  m.check_tokens(targets, batch * seq, true, "target");
  Activations acts;
  m.forward_trunk(acts, tokens, batch, seq, dt, false);
  cpu::ClassifierArgs args;
  args.rows = batch * seq;
  args.dim = config_.dim;
  args.vocab = config_.vocab_size;
  args.compute = dt;
  args.h = acts.hn.raw();
  args.w = m.weight(m.output, dt);
  args.targets = targets;
  return cpu::fused_classifier(ctx_, args);
}

void Model::forward_logits(const int32_t* tokens, int64_t batch, int64_t seq, float* logits) {
  Impl& m = *impl_;
  const DType dt = compute_dtype(precision_);
  Activations acts;
  m.forward_trunk(acts, tokens, batch, seq, dt, false);
  cpu::MatmulDims dims{.m = batch * seq, .n = config_.vocab_size, .k = config_.dim,
                       .trans_b = true};
  cpu::matmul(ctx_, dims, dt, acts.hn.raw(), m.weight(m.output, dt), DType::f32, logits);
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
    cpu::KVCacheLayer layer;
    layer.k = Tensor(shape, DType::f32, MemCategory::activations, ctx_.tracker());
    layer.v = Tensor(shape, DType::f32, MemCategory::activations, ctx_.tracker());
    cache.layers.push_back(std::move(layer));
  }
  return cache;
}

// Decoding runs in f32 on the master weights in both precisions: it is not a
// training path, and f32 keeps sampling independent of the compute copies.
void Model::decode(const int32_t* tokens, int64_t batch, int64_t n_new, KVCache& cache,
                   float* last_logits) {
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
  m.forward_trunk(acts, tokens, batch, n_new, DType::f32, false, &cache);
  // Logits of each sequence's last position only.
  Tensor last({batch, d}, DType::f32, MemCategory::workspace, ctx_.tracker());
  for (int64_t b = 0; b < batch; ++b) {
    last.view(b * d, {d}).copy_from(acts.hn.view((b * n_new + n_new - 1) * d, {d}));
  }
  cpu::MatmulDims dims{.m = batch, .n = config_.vocab_size, .k = d, .trans_b = true};
  cpu::matmul(ctx_, dims, DType::f32, last.raw(), m.master(m.output), DType::f32, last_logits);
  cache.length += n_new;
}

}  // namespace meshtrain
