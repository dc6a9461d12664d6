// Pipeline stages: which parameters a stage holds, and the stage passes that
// run one chunk of layers on one micro-batch with its activations kept until
// that micro-batch's backward (parallel/pipeline drives them).
#include <fmt/format.h>

#include "meshtrain/backend/backend.h"
#include "meshtrain/model/model_impl.h"
#include "meshtrain/util/error.h"

namespace meshtrain {

std::vector<size_t> stage_param_indices(const ModelConfig& config, const StageLayers& stage) {
  const int64_t layers = config.n_layers;
  const std::vector<ParamUnit> units = build_param_units(config);
  std::vector<size_t> held;
  if (stage.whole()) {
    for (size_t i = 0; i < units.back().end_param; ++i) held.push_back(i);
    return held;
  }
  int64_t prev_end = 0;
  for (const auto& [first, end] : stage.chunks) {
    MESHTRAIN_CHECK(first >= prev_end && first < end && end <= layers,
                    "pipeline stage: layer ranges must be increasing, non-empty and within "
                    "model.n_layers = {}; got [{}, {})",
                    layers, first, end);
    prev_end = end;
  }
  MESHTRAIN_CHECK(!(stage.first && stage.last) || stage.chunks.size() == 1,
                  "pipeline stage: a stage that is both first and last runs one chunk, got {}",
                  stage.chunks.size());
  auto holds_layer = [&](int64_t l) {
    for (const auto& [first, end] : stage.chunks) {
      if (l >= first && l < end) return true;
    }
    return false;
  };
  for (const ParamUnit& u : units) {
    size_t end_param = u.end_param;
    bool keep = false;
    if (u.name == "embed") {
      keep = stage.first || (stage.last && config.tie_embeddings);
      // A last stage needs only the token embedding (the output layer), not positions.
      if (!stage.first) end_param = u.first_param + 1;
    } else if (u.name == "head") {
      keep = stage.last;
    } else {
      keep = holds_layer(std::stoll(u.name.substr(u.name.find('.') + 1)));
    }
    for (size_t i = u.first_param; keep && i < end_param; ++i) held.push_back(i);
  }
  return held;
}

StageParams select_stage_params(const ModelConfig& config, const StageLayers& stage,
                                std::vector<ParamSpec> specs) {
  StageParams out;
  out.units = build_param_units(config);
  if (stage.whole()) {
    out.specs = std::move(specs);
    return out;
  }
  const std::vector<size_t> held = stage_param_indices(config, stage);
  if (held.size() == specs.size()) {  // one stage holding everything
    out.specs = std::move(specs);
    return out;
  }
  // Units: the runs of held parameters within each global unit.
  std::vector<ParamUnit> units;
  out.local_index.assign(specs.size(), static_cast<size_t>(-1));
  size_t global_unit = 0;
  for (size_t g : held) {
    while (out.units[global_unit].end_param <= g) ++global_unit;
    if (units.empty() || units.back().name != out.units[global_unit].name) {
      units.push_back(ParamUnit{out.units[global_unit].name, out.specs.size(), out.specs.size()});
    }
    out.local_index[g] = out.specs.size();
    out.specs.push_back(std::move(specs[g]));
    units.back().end_param = out.specs.size();
  }
  out.units = std::move(units);
  return out;
}

void Model::select_stage(std::vector<ParamSpec>& specs) {
  StageParams selected = select_stage_params(config_, stage_, std::move(specs));
  if (stage_.whole()) {
    stage_.chunks = {{0, config_.n_layers}};
    stage_.first = stage_.last = true;
  }
  specs = std::move(selected.specs);
  units_ = std::move(selected.units);
  local_index_ = std::move(selected.local_index);
}

void Model::require_whole(const char* what) const {
  if (!local_index_.empty()) {
    fail("model: {} needs the whole model; this is a pipeline stage (use stage_forward / "
         "stage_backward)",
         what);
  }
}

bool Model::param_is_duplicate(size_t i) const {
  return !stage_.first && config_.tie_embeddings && i == impl_->embed;
}

int64_t Model::stage_rows(int64_t batch, int64_t seq) const {
  return impl_->shard_rows(batch * seq);
}

size_t Model::stage_in_flight() const { return impl_->staged.size(); }

void Model::drop_stage_activations() { impl_->staged.clear(); }

namespace {

struct ChunkRole {
  int64_t first = 0, end = 0;
  bool embeds = false, head = false;
};

ChunkRole chunk_role(const StageLayers& stage, int chunk) {
  MESHTRAIN_CHECK(chunk >= 0 && static_cast<size_t>(chunk) < stage.chunks.size(),
                  "pipeline stage: chunk {} out of range (this stage runs {})", chunk,
                  stage.chunks.size());
  const auto [first, end] = stage.chunks[static_cast<size_t>(chunk)];
  return ChunkRole{first, end, stage.first && chunk == 0,
                   stage.last && static_cast<size_t>(chunk) + 1 == stage.chunks.size()};
}

}  // namespace

void Model::stage_forward(int chunk, int64_t micro_batch, const int32_t* tokens,
                          const float* input, int64_t batch, int64_t seq, float* output,
                          const int32_t* positions) {
  Impl& m = *impl_;
  MESHTRAIN_CHECK(!config_.lora.enabled() || config_.lora.dropout == 0.0f,
                  "lora.dropout = {} under pipeline parallelism (parallel.pp > 1) is not "
                  "implemented yet: use lora.dropout = 0 or parallel.pp = 1",
                  config_.lora.dropout);
  const ChunkRole role = chunk_role(stage_, chunk);
  const std::pair<int, int64_t> key{chunk, micro_batch};
  MESHTRAIN_CHECK(!m.staged.contains(key),
                  "pipeline stage: chunk {} micro-batch {} is already in flight", chunk,
                  micro_batch);
  MESHTRAIN_CHECK(batch > 0 && seq > 0 && seq <= config_.max_seq_len,
                  "model: batch {} and seq {} must be > 0 and seq <= model.max_seq_len {}", batch,
                  seq, config_.max_seq_len);
  const int64_t rows = batch * seq, d = config_.dim, n = role.end - role.first;
  MESHTRAIN_CHECK(!m.sp || rows % tp_.size() == 0,
                  "model: sequence parallel needs batch x seq = {} x {} divisible by tp = {}", batch,
                  seq, tp_.size());
  const DType dt = compute_dtype(precision_);
  Activations& acts = m.staged[key];
  acts.batch = batch;
  acts.seq = seq;
  if (positions != nullptr) acts.positions.assign(positions, positions + batch * seq);
  const Impl::PassPositions pass(m, positions, batch * seq);
  acts.residual.resize(static_cast<size_t>(n + 1));
  acts.blocks.resize(static_cast<size_t>(n));
  for (Tensor& r : acts.residual) {
    m.ensure(r, {m.shard_rows(rows), d}, DType::f32, MemCategory::activations);
  }
  if (role.embeds) {
    m.check_tokens(tokens, rows, false, "token");
    m.before(m.embed_unit, UnitPass::forward);
    m.embed_tokens(tokens, batch, seq, 0, acts.residual[0]);
    m.after(m.embed_unit, UnitPass::forward);
  } else {
    backend_.copy_from_host(input, acts.residual[0]);
  }
  for (int64_t l = role.first; l < role.end; ++l) {
    const size_t i = static_cast<size_t>(l - role.first);
    m.before(m.layer_unit(l), UnitPass::forward);
    m.train_forward_block(l, role.first, acts.residual[i], acts.blocks[i], acts.residual[i + 1],
                          dt, batch, seq);
    m.after(m.layer_unit(l), UnitPass::forward);
  }
  const Tensor& last = acts.residual.back();
  if (role.head) {
    m.before(m.head_unit, UnitPass::forward);
    acts.head_input = m.column_input(m.final_norm, last, dt, acts.hn, acts.mean_f, acts.rstd_f,
                                     rows, MemCategory::activations);
    m.after(m.head_unit, UnitPass::forward);
  } else {
    backend_.synchronize();
    backend_.copy_to_host(last, output);
  }
}

double Model::stage_loss(int chunk, int64_t micro_batch, const int32_t* targets,
                         const TokenLoss& loss_out) {
  Impl& m = *impl_;
  const ChunkRole role = chunk_role(stage_, chunk);
  auto found = m.staged.find({chunk, micro_batch});
  MESHTRAIN_CHECK(role.head && found != m.staged.end(),
                  "pipeline stage: no held head forward for chunk {} micro-batch {}", chunk,
                  micro_batch);
  Activations& acts = found->second;
  const int64_t rows = acts.batch * acts.seq;
  m.check_tokens(targets, rows, true, "target");
  m.before(m.head_unit, UnitPass::forward);
  if (m.tied) m.before(m.embed_unit, UnitPass::forward);
  ops::ClassifierArgs args =
      m.classifier_args(acts.head_input, targets, rows, compute_dtype(precision_));
  m.weigh(args, loss_out);
  const double loss = backend_.fused_classifier(args);
  m.fetch_losses(loss_out, rows);
  if (m.tied) m.after(m.embed_unit, UnitPass::forward);
  m.after(m.head_unit, UnitPass::forward);
  m.staged.erase(found);
  return loss;
}

double Model::stage_backward(int chunk, int64_t micro_batch, const int32_t* tokens,
                             const int32_t* targets, float grad_scale, const float* output_grad,
                             float* input_grad, const TokenLoss& loss_out) {
  Impl& m = *impl_;
  const ChunkRole role = chunk_role(stage_, chunk);
  auto found = m.staged.find({chunk, micro_batch});
  MESHTRAIN_CHECK(found != m.staged.end(),
                  "pipeline stage: backward of chunk {} micro-batch {} before its forward", chunk,
                  micro_batch);
  Activations& acts = found->second;
  const int64_t batch = acts.batch, seq = acts.seq, rows = batch * seq, d = config_.dim;
  const DType dt = compute_dtype(precision_);
  const int32_t* positions = acts.positions.empty() ? nullptr : acts.positions.data();
  const Impl::PassPositions pass(m, positions, rows);
  m.ensure(m.ws.dres, {m.shard_rows(rows), d}, DType::f32, MemCategory::workspace);
  m.aux_weight = grad_scale * static_cast<float>(rows);
  // Gradients complete in reverse registry order from the chunk's last unit.
  m.next_ready = units_[role.head ? m.head_unit : m.layer_unit(role.end - 1)].end_param;
  double loss = 0;
  if (role.head) {
    m.check_tokens(targets, rows, true, "target");
    m.ensure(m.ws.dx, {rows, m.dx_width()}, DType::f32, MemCategory::workspace);
    m.before(m.head_unit, UnitPass::backward);
    if (m.tied) m.before(m.embed_unit, UnitPass::backward);
    ops::ClassifierArgs args = m.classifier_args(acts.head_input, targets, rows, dt);
    args.grad_scale = grad_scale;
    args.dh = m.ws.dx.data<float>();
    args.dw = m.trains(m.output) ? m.grad(m.output) : nullptr;  // frozen (LoRA): none
    m.weigh(args, loss_out);
    loss = backend_.fused_classifier(args);
    m.fetch_losses(loss_out, rows);
    if (!m.tied) m.ready(m.output);
    m.ws.dres.zero();
    m.norm_backward(m.final_norm, acts.residual.back(), acts.mean_f, acts.rstd_f,
                    m.reduce_input_grad(rows), m.ws.dres.data<float>(), m.shard_rows(rows));
    m.flush_norm_grads();
    m.after(m.head_unit, UnitPass::backward);
  } else {
    backend_.copy_from_host(output_grad, m.ws.dres);
  }
  for (int64_t l = role.end - 1; l >= role.first; --l) {
    const size_t i = static_cast<size_t>(l - role.first);
    m.before(m.layer_unit(l), UnitPass::backward);
    m.train_backward_block(l, acts.residual[i], acts.blocks[i], acts.residual[i + 1], dt, batch,
                           seq);
    m.after(m.layer_unit(l), UnitPass::backward);
  }
  if (role.embeds) {
    if (!(m.tied && role.head)) m.before(m.embed_unit, UnitPass::backward);
    m.embed_backward(tokens, batch, seq);
    if (m.positions != kNoParam) m.ready(m.positions);
    m.ready(m.embed);
    m.after(m.embed_unit, UnitPass::backward);
  } else {
    backend_.synchronize();
    backend_.copy_to_host(m.ws.dres, input_grad);
    if (role.head && m.tied) {
      // The output layer is this stage's copy of the token embedding.
      m.next_ready = m.embed + 1;
      m.ready(m.embed);
      m.after(m.embed_unit, UnitPass::backward);
    }
  }
  m.staged.erase(found);
  return loss;
}

}  // namespace meshtrain
