#include "meshtrain/parallel/zero/sharded.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include "meshtrain/backend/backend.h"
#include "meshtrain/util/error.h"
#include "meshtrain/util/trace.h"

namespace meshtrain::zero {
namespace {

constexpr size_t kNone = static_cast<size_t>(-1);

}  // namespace

struct ShardedDataParallel::Piece {
  int64_t begin = 0, end = 0;                            // shard elements
  size_t exp_avg = 0, exp_avg_sq = 0, master = kNone;    // store chunk ids
  size_t compute = kNone;  // stage 3, parameters in the store: a 2-byte flat's compute values
  size_t chunk(State state) const {
    return state == State::master ? master : state == State::exp_avg ? exp_avg : exp_avg_sq;
  }
  // The values a stage-3 gather sends (a f32 flat's master shard is its compute shard).
  size_t values() const { return compute != kNone ? compute : master; }
};

struct ShardedDataParallel::Flat {
  Tensor full;                 // [padded] compute dtype; stage 3 only while gathered
  Work gather;                 // the all-gather into `full`, until waited for
  bool gather_pending = false;
  Tensor compute_shard;        // stage 3 with parameters resident: [shard] compute dtype
  Tensor master_alias;         // f32 flats: the master shard within the compute values
  Tensor grad_full;            // [padded] f32; stage 1 persistent, else per micro-batch
  Tensor grad_shard;           // stages 2, 3: [shard] f32
  bool shard_written = false;  // a reduce-scatter already wrote grad_shard this step
  std::vector<ShardSegment> segments;
  std::vector<Piece> pieces;
};

struct ShardedDataParallel::Reduce {
  enum class Then { nothing, add_to_shard, copy_to_full };
  size_t flat = 0;
  Work work;
  Tensor send, recv;  // kept alive until the call completes
  Then then = Then::nothing;
};

ShardedDataParallel::ShardedDataParallel(Model& model, Communicator& dp, const AdamWConfig& adamw,
                                         const ZeroOptions& options, Communicator* experts)
    : model_(model),
      dp_(dp),
      experts_(experts),
      adamw_(adamw),
      options_(options),
      rank_(dp.rank()) {
  MESHTRAIN_CHECK(options.stage >= 1 && options.stage <= 3,
                  "zero: stage must be 1, 2 or 3, got {}", options.stage);
  MESHTRAIN_CHECK(model.storage() == ParamStorage::external,
                  "zero: the model must be built with ParamStorage::external");
  MESHTRAIN_CHECK(!model.unit_hooks.before && !model.unit_hooks.after,
                  "zero: the model already has unit hooks");
  MESHTRAIN_CHECK(options.piece_elems > 0, "zero: piece_elems must be > 0, got {}",
                  options.piece_elems);
  MESHTRAIN_CHECK(options.max_inflight_reduces >= 1,
                  "zero: max_inflight_reduces (parallel.max_inflight_reduces) must be >= 1, got {}",
                  options.max_inflight_reduces);
  MESHTRAIN_CHECK(options.pipeline_micro_batches >= 0,
                  "zero: pipeline_micro_batches must be >= 0, got {}",
                  options.pipeline_micro_batches);
  check_adamw_config(adamw);
  std::vector<ParamSpec> specs;
  for (const Parameter& p : model.params()) specs.push_back(p.spec);
  layout_ = make_zero_layout(specs, model.units(), model.precision(), dp.size(),
                             experts != nullptr ? experts->size() : 0);
  MESHTRAIN_CHECK(experts == nullptr || experts->rank() == rank_ / (dp.size() / experts->size()),
                  "zero: dp rank {} is not rank {} of the expert-data-parallel group (comm/mesh.h)",
                  rank_, experts != nullptr ? experts->rank() : 0);
  for (const FlatParam& fp : layout_.flats) {
    MESHTRAIN_CHECK(fp.trainable || options.stage <= 2 || options.offload.tier == OffloadTier::none,
                    "zero: frozen parameters (lora.rank > 0) at stage 3 cannot be offloaded "
                    "(parallel.offload = \"none\" or parallel.zero <= 2)");
  }

  backwards_.assign(model.units().size(), 0);
  deferred_.assign(model.units().size(), false);
  // A stage's tied embedding copy: the stages sum its gradient before the reduce.
  const StageLayers& layers = model.stage_layers();
  if (options.pipeline_micro_batches > 0 && model.config().tie_embeddings &&
      layers.first != layers.last) {
    for (size_t u = 0; u < deferred_.size(); ++u) deferred_[u] = model.units()[u].name == "embed";
  }

  MemoryTracker& tracker = model.backend().tracker();
  const int stage = options.stage;
  params_in_store_ = stage == 3 && options.offload.tier != OffloadTier::none;
  std::vector<OffloadChunkSpec> chunks;
  flats_.resize(layout_.flats.size());
  for (size_t i = 0; i < flats_.size(); ++i) {
    const FlatParam& fp = layout_.flats[i];
    Flat& f = flats_[i];
    f.segments = fp.segments(group_rank(i));
    if (stage <= 2) {
      f.full = model_.backend().allocate({fp.padded}, fp.dtype, MemCategory::params);
      if (fp.dtype == DType::f32) {
        f.master_alias = f.full.view(fp.shard_begin(group_rank(i)), {fp.shard});
      }
      bind_values(i);
    } else if (!params_in_store_) {
      f.compute_shard = model_.backend().allocate({fp.shard}, fp.dtype, MemCategory::params);
      if (fp.dtype == DType::f32) f.master_alias = f.compute_shard;
    }
    if (!fp.trainable) continue;  // frozen: values only
    if (stage == 1) {
      f.grad_full = model_.backend().allocate({fp.padded}, DType::f32, MemCategory::grads);
      bind_grads(i, true);
    } else {
      f.grad_shard = model_.backend().allocate({fp.shard}, DType::f32, MemCategory::grads);
    }
    const std::string name = fmt::format("{}.{}{}", model.units()[fp.unit].name,
                                         dtype_name(fp.dtype), fp.expert ? ".experts" : "");
    for (int64_t begin = 0; begin < fp.shard; begin += options.piece_elems) {
      Piece piece;
      piece.begin = begin;
      piece.end = std::min(fp.shard, begin + options.piece_elems);
      const int64_t n = piece.end - piece.begin, k = begin / options.piece_elems;
      piece.exp_avg = chunks.size();
      chunks.push_back({fmt::format("{}.exp_avg.{}", name, k), n});
      piece.exp_avg_sq = chunks.size();
      chunks.push_back({fmt::format("{}.exp_avg_sq.{}", name, k), n});
      if (!f.master_alias.defined()) {
        piece.master = chunks.size();
        chunks.push_back({fmt::format("{}.master.{}", name, k), n});
      }
      if (params_in_store_ && fp.dtype != DType::f32) {
        piece.compute = chunks.size();
        chunks.push_back({fmt::format("{}.compute.{}", name, k), n, fp.dtype});
      }
      f.pieces.push_back(piece);
    }
  }
  check_offload_budget(chunks);
  param_schedule_ = predicted_param_schedule();
  OffloadOptions store = options.offload;
  store.resident_category = MemCategory::optimizer;
  store.device = &model.backend();
  store_ = std::make_unique<OffloadStore>(fmt::format("zero_state.rank{}", rank_),
                                          std::move(chunks), store, tracker);
  model_.unit_hooks.before = [this](size_t u, UnitPass pass) { before(u, pass); };
  model_.unit_hooks.after = [this](size_t u, UnitPass pass) { after(u, pass); };
  model_.nf4_writer = [this](size_t param, std::span<const uint8_t> packed) {
    write_packed(param, packed);
  };
}

void ShardedDataParallel::check_offload_budget(const std::vector<OffloadChunkSpec>& chunks) const {
  const size_t budget = options_.offload.budget_bytes;
  if (options_.offload.tier == OffloadTier::none || budget == 0) return;
  // The optimizer step holds one piece's chunks at once (exp_avg, exp_avg_sq, the f32
  // master, the compute values); a gather holds one values chunk. The largest piece decides.
  size_t need = 0;
  std::string what;
  for (const Flat& f : flats_) {
    for (const Piece& p : f.pieces) {
      size_t bytes = 0;
      for (size_t id : {p.exp_avg, p.exp_avg_sq, p.master, p.compute}) {
        if (id == kNone) continue;
        bytes += static_cast<size_t>(chunks[id].numel) * dtype_size(chunks[id].dtype);
      }
      if (bytes > need) {
        need = bytes;
        what = chunks[p.exp_avg].name;
      }
    }
  }
  MESHTRAIN_CHECK(need <= budget,
                  "parallel.offload_budget_mb: a resident budget of {} bytes is less than the {} "
                  "bytes the optimizer step holds at once for one piece ('{}' and its other "
                  "states{}; pieces of {} elements); raise parallel.offload_budget_mb to at least "
                  "{:.3f}",
                  budget, need, what, params_in_store_ ? " and parameters" : "",
                  options_.piece_elems, static_cast<double>(need) / (1024.0 * 1024.0));
}

// The first step's stage-3 gather order, from the model's unit order (forward_backward's
// hooks): forward embed, layers, head; the tied embedding again as the output layer
// (prefetched at the head's forward); with reshard_after_forward the layers again in
// backward, last to first, then an untied embedding. A pipeline stage keeps each unit from
// its first use to its last backward: its units once, in forward order.
std::vector<size_t> ShardedDataParallel::predicted_param_schedule() const {
  const size_t units = layout_.unit_flats.size();
  std::vector<size_t> order;
  auto add = [&](size_t u) {
    for (size_t i : layout_.unit_flats[u]) order.push_back(i);
  };
  for (size_t u = 0; u < units; ++u) add(u);
  if (options_.pipeline_micro_batches > 0 || !options_.reshard_after_forward || units < 2) {
    return order;
  }
  const ModelConfig& c = model_.config();
  const bool tied = c.tied_output();
  if (tied) add(0);
  for (size_t u = units - 2; u >= 1; --u) add(u);
  if (!tied) add(0);
  return order;
}

ShardedDataParallel::~ShardedDataParallel() {
  model_.unit_hooks = UnitHooks{};
  model_.nf4_writer = nullptr;
  // Pending calls use our buffers: let them finish.
  for (Reduce& r : reduces_) {
    try {
      r.work.wait();
    } catch (...) {  // already failing; reported elsewhere
    }
  }
  for (Flat& f : flats_) {
    try {
      if (f.gather_pending) f.gather.wait();
    } catch (...) {
    }
  }
  for (Parameter& p : model_.params()) {
    p.master = Tensor();
    p.compute = Tensor();
    p.grad = Tensor();
    p.nf4 = Tensor();
  }
}

void ShardedDataParallel::bind_values(size_t flat) {
  const FlatParam& fp = layout_.flats[flat];
  const Tensor& full = flats_[flat].full;
  for (const FlatMember& m : fp.members) {
    Parameter& p = model_.params()[m.param];
    if (fp.packed) {
      p.nf4 = full.defined() ? full.view(m.offset, {m.numel}) : Tensor();
      continue;
    }
    Tensor view = full.defined() ? full.view(m.offset, p.spec.shape) : Tensor();
    (fp.dtype == DType::f32 ? p.master : p.compute) = std::move(view);
  }
}

void ShardedDataParallel::bind_grads(size_t flat, bool bound) {
  const FlatParam& fp = layout_.flats[flat];
  const Tensor& grads = flats_[flat].grad_full;
  for (const FlatMember& m : fp.members) {
    Parameter& p = model_.params()[m.param];
    p.grad = bound ? grads.view(m.offset, p.spec.shape) : Tensor();
  }
}

void ShardedDataParallel::finish(Work& work) {
  const CommClock::time_point start = CommClock::now();
  work.wait();
  timing_.timeline.add(work.record(), start, CommClock::now());
  timing_.comm_seconds = timing_.timeline.in_flight_seconds();
  timing_.exposed_seconds = timing_.timeline.exposed_seconds();
  work = Work();
}

void ShardedDataParallel::gather_async(size_t flat) {
  trace::Span span("zero", "gather issue", static_cast<int64_t>(flat));
  const FlatParam& fp = layout_.flats[flat];
  Flat& f = flats_[flat];
  f.full = model_.backend().allocate({fp.padded}, fp.dtype, MemCategory::params);
  std::vector<int64_t> counts(static_cast<size_t>(fp.ranks), fp.shard);
  const void* send = nullptr;
  if (params_in_store_) {
    // The shard streams from the store into its place in the gathered unit: in place.
    const Tensor own = f.full.view(fp.shard_begin(group_rank(flat)), {fp.shard});
    stream_in_params(flat, own);
    send = own.raw();
  } else {
    send = f.compute_shard.raw();
  }
  f.gather = group(flat).all_gather_async(send, f.full.raw(), counts, comm_dtype(fp.dtype));
  timing_.bytes += f.full.bytes();
  f.gather_pending = true;
}

Communicator& ShardedDataParallel::group(size_t flat) {
  return layout_.flats[flat].expert ? *experts_ : dp_;
}

void ShardedDataParallel::wait_gather(size_t flat) {
  Flat& f = flats_[flat];
  if (!f.gather_pending) return;
  trace::Span span("zero", "gather wait", static_cast<int64_t>(flat));
  finish(f.gather);
  f.gather_pending = false;
}

void ShardedDataParallel::release_params(size_t flat) {
  Flat& f = flats_[flat];
  if (!f.full.defined()) return;
  wait_gather(flat);
  f.full = Tensor();
  bind_values(flat);  // unbinds: the views held the storage
}

void ShardedDataParallel::stream_in_params(size_t flat, const Tensor& dst) {
  Flat& f = flats_[flat];
  if (recording_) recorded_.push_back(flat);
  if (store_->next_in_pass() != f.pieces.front().values()) announce_params(flat);
  for (const Piece& p : f.pieces) {
    const size_t id = p.values();
    Tensor t = store_->acquire(id);
    dst.view(p.begin, {t.numel()}).copy_from(t);  // on the device, through its allocator
    t = Tensor();
    store_->release(id, false);
  }
  ++param_pass_next_;
}

// Starts a store pass over the predicted gathers from `flat` on: the schedule from the
// first position at or after the current one that gathers `flat` (else from the start);
// a flat the schedule does not name is announced alone.
void ShardedDataParallel::announce_params(size_t flat) {
  end_param_pass();
  const std::vector<size_t>& s = param_schedule_;
  size_t from = s.size();
  for (size_t k = 0; k < s.size() && from == s.size(); ++k) {  // (never empty: every unit)
    const size_t at = (param_pass_next_ + k) % s.size();
    if (s[at] == flat) from = at;
  }
  std::vector<size_t> order;
  const size_t end = from < s.size() ? s.size() : 0;
  auto add = [&](size_t i) {
    for (const Piece& p : flats_[i].pieces) order.push_back(p.values());
  };
  if (from == s.size()) add(flat);
  for (size_t k = from; k < end; ++k) add(s[k]);
  param_pass_next_ = from < s.size() ? from : s.size();
  store_->begin_pass(std::move(order));
}

void ShardedDataParallel::end_param_pass() {
  if (params_in_store_ && store_->in_pass()) store_->end_pass();
}

size_t ShardedDataParallel::prefetch_target(size_t unit, UnitPass pass) const {
  if (pass == UnitPass::backward) return unit > 0 ? unit - 1 : kNone;
  if (unit + 1 < layout_.unit_flats.size()) return unit + 1;
  // The head's forward: with tied embeddings the token embedding is the output layer next.
  const ModelConfig& c = model_.config();
  return c.tied_output() ? 0 : kNone;
}

void ShardedDataParallel::before(size_t unit, UnitPass pass) {
  const int stage = options_.stage;
  for (size_t i : layout_.unit_flats[unit]) {
    Flat& f = flats_[i];
    if (stage == 3) {
      const CommClock::time_point needed = CommClock::now();
      if (!f.full.defined()) gather_async(i);
      if (f.gather_pending) {
        Work work = f.gather;  // shares the state: its record stays readable
        wait_gather(i);
        timing_.gathers.push_back({unit, pass, needed, work.record()});
      }
      bind_values(i);
    } else {
      wait_gather(i);  // the update's all-gather
    }
    if (pass == UnitPass::backward && stage >= 2 && layout_.flats[i].trainable &&
        !f.grad_full.defined()) {
      f.grad_full = model_.backend().allocate({layout_.flats[i].padded}, DType::f32, MemCategory::grads);
      bind_grads(i, true);
    }
  }
  if (stage == 3 && options_.prefetch) {
    const size_t next = prefetch_target(unit, pass);
    if (next != kNone) {
      if (trace::enabled()) trace::instant("zero", "prefetch", fmt::format(R"("unit":{})", next));
      for (size_t i : layout_.unit_flats[next]) {
        if (!flats_[i].full.defined()) gather_async(i);
      }
    }
  }
}

void ShardedDataParallel::after(size_t unit, UnitPass pass) {
  const int stage = options_.stage;
  const size_t head = layout_.unit_flats.size() - 1;
  const int64_t pipeline = options_.pipeline_micro_batches;
  if (pipeline > 0 && pass == UnitPass::backward) {
    MESHTRAIN_CHECK(++backwards_[unit] <= pipeline,
                    "zero: unit {} ran more backwards than the step's {} micro-batches",
                    model_.units()[unit].name, pipeline);
  }
  for (size_t i : layout_.unit_flats[unit]) {
    const bool trainable = layout_.flats[i].trainable;  // frozen: released, never reduced
    if (pass == UnitPass::forward) {
      // Backward starts with the head: never free it after forward.
      // Pipelines keep units gathered until their last backward.
      if (stage == 3 && options_.reshard_after_forward && unit != head && pipeline == 0) {
        release_params(i);
      }
      continue;
    }
    if (pipeline > 0) {
      if (backwards_[unit] < pipeline) continue;
      if (stage == 3) release_params(i);
      if (trainable && !deferred_[unit]) reduce_scatter_grads(i);
      continue;
    }
    if (stage == 3) release_params(i);
    if (trainable && (stage >= 2 || last_micro_batch_)) reduce_scatter_grads(i);
  }
}

void ShardedDataParallel::reduce_scatter_grads(size_t flat) {
  const FlatParam& fp = layout_.flats[flat];
  Flat& f = flats_[flat];
  // The limiter: the oldest call's buffers go before this one's receive shard comes.
  while (static_cast<int64_t>(reduces_.size()) >= options_.max_inflight_reduces) {
    finish_oldest_reduce();
  }
  Reduce r;
  r.flat = flat;
  r.send = f.grad_full;
  if (options_.stage == 1) {
    r.recv = model_.backend().allocate({fp.shard}, DType::f32, MemCategory::grads);
    r.then = Reduce::Then::copy_to_full;
  } else if (!f.shard_written) {
    r.recv = f.grad_shard;  // the step's first contribution: no addition needed
    f.shard_written = true;
  } else {
    r.recv = model_.backend().allocate({fp.shard}, DType::f32, MemCategory::grads);
    r.then = Reduce::Then::add_to_shard;
  }
  std::vector<int64_t> counts(static_cast<size_t>(fp.ranks), fp.shard);
  r.work = group(flat).reduce_scatter_async(r.send.raw(), r.recv.raw(), counts, CommDType::f32,
                                            ReduceOp::avg);
  timing_.bytes += r.send.bytes();
  if (options_.stage >= 2) {
    bind_grads(flat, false);
    f.grad_full = Tensor();  // freed when the call completes (r.send)
  }
  reduces_.push_back(std::move(r));
}

void ShardedDataParallel::finish_oldest_reduce() {
  // In issue order: an accumulation adds after the shard's first write.
  Reduce& r = reduces_.front();
  finish(r.work);
  const FlatParam& fp = layout_.flats[r.flat];
  Flat& f = flats_[r.flat];
  const Tensor received = r.recv.view(0, {fp.shard});
  if (r.then == Reduce::Then::add_to_shard) {
    model_.backend().add_inplace(f.grad_shard.data<float>(), received.data<float>(), fp.shard);
  } else if (r.then == Reduce::Then::copy_to_full) {
    f.grad_full.view(fp.shard_begin(group_rank(r.flat)), {fp.shard}).copy_from(received);
  }
  reduces_.erase(reduces_.begin());
}

void ShardedDataParallel::finish_reduces() {
  // No polling elsewhere: completed calls keep their buffers until the
  // limiter (reduce_scatter_grads) or a sync retires them, so that what is
  // alive depends on the issue order only.
  while (!reduces_.empty()) finish_oldest_reduce();
}

void ShardedDataParallel::begin_micro_batch(bool first, bool last) {
  last_micro_batch_ = last;
  if (!first) return;
  MESHTRAIN_CHECK(reduces_.empty(), "zero: a step began before the previous sync finished");
  timing_ = ZeroStepTiming{};
  step_store_stats_ = store_->stats();
  recorded_.clear();
  recording_ = params_in_store_;
  std::fill(backwards_.begin(), backwards_.end(), 0);
  for (size_t i = 0; i < flats_.size(); ++i) {
    Flat& f = flats_[i];
    if (!layout_.flats[i].trainable) continue;
    if (options_.stage == 1) {
      f.grad_full.zero();
    } else {
      f.grad_shard.zero();
      f.shard_written = false;
    }
  }
}

void ShardedDataParallel::finish_gradient_sync() {
  const int64_t pipeline = options_.pipeline_micro_batches;
  for (size_t u = 0; pipeline > 0 && u < backwards_.size(); ++u) {
    MESHTRAIN_CHECK(backwards_[u] == pipeline,
                    "zero: unit {} ran {} backwards in a step of {} micro-batches",
                    model_.units()[u].name, backwards_[u], pipeline);
    if (!deferred_[u]) continue;
    for (size_t i : layout_.unit_flats[u]) {
      if (layout_.flats[i].trainable) reduce_scatter_grads(i);
    }
  }
  // Stage 3: a prefetch may have gathered a unit after its last backward.
  for (size_t i = 0; pipeline > 0 && options_.stage == 3 && i < flats_.size(); ++i) {
    release_params(i);
  }
  finish_reduces();
  for (const Flat& f : flats_) {
    MESHTRAIN_CHECK(options_.stage == 1 || !f.grad_full.defined(),
                    "zero: a unit's backward did not finish (after(u, backward) missing)");
  }
}

float* ShardedDataParallel::grad_shard(size_t flat) {
  Flat& f = flats_[flat];
  if (options_.stage == 1) {
    return f.grad_full.data<float>() + layout_.flats[flat].shard_begin(group_rank(flat));
  }
  return f.grad_shard.data<float>();
}

std::vector<std::span<float>> ShardedDataParallel::grad_shards() {
  std::vector<std::span<float>> out;
  for (size_t i = 0; i < flats_.size(); ++i) {
    if (!layout_.flats[i].trainable) continue;
    out.emplace_back(grad_shard(i), static_cast<size_t>(layout_.flats[i].shard));
  }
  return out;
}

double ShardedDataParallel::grad_norm(Communicator* stages) {
  MESHTRAIN_CHECK(reduces_.empty(), "zero: grad_norm before finish_gradient_sync");
  // Padding is zero; each shard's sum has a fixed blocking.
  double sum = 0;
  const TensorParallel& tp = model_.tensor_parallel();
  const bool per_param = tp.active() || stages != nullptr;
  for (size_t i = 0; i < flats_.size(); ++i) {
    if (!layout_.flats[i].trainable) continue;
    if (!per_param) {
      sum += model_.backend().sum_squares(grad_shard(i), layout_.flats[i].shard);
      continue;
    }
    // Parameters replicated over tp count on tp rank 0 only; a stage's tied
    // output layer is the first stage's embedding, counted there.
    for (const ShardSegment& s : flats_[i].segments) {
      if (model_.param_is_duplicate(s.param)) continue;
      if (!counts_once_over_tp(tp, model_.params()[s.param].spec)) continue;
      sum += model_.backend().sum_squares(grad_shard(i) + s.shard_offset, s.numel);
    }
  }
  dp_.all_reduce(&sum, 1, CommDType::f64, ReduceOp::sum);
  sum = tp_sum(tp, sum);
  if (stages != nullptr) stages->all_reduce(&sum, 1, CommDType::f64, ReduceOp::sum);
  return std::sqrt(sum);
}

Tensor ShardedDataParallel::compute_values(size_t flat) {
  const FlatParam& fp = layout_.flats[flat];
  Flat& f = flats_[flat];
  if (options_.stage == 3) return f.compute_shard;
  return f.full.view(fp.shard_begin(group_rank(flat)), {fp.shard});
}

void ShardedDataParallel::step(float lr, float grad_scale) {
  MESHTRAIN_CHECK(reduces_.empty(), "zero: step before finish_gradient_sync");
  for (size_t i = 0; i < flats_.size(); ++i) wait_gather(i);  // sources of pending gathers
  ++step_count_;
  end_param_pass();
  if (recording_ && !recorded_.empty()) param_schedule_ = recorded_;  // the next step's order
  recording_ = false;
  param_pass_next_ = 0;
  std::vector<size_t> order;
  for (const Flat& f : flats_) {
    for (const Piece& p : f.pieces) {
      order.push_back(p.exp_avg);
      order.push_back(p.exp_avg_sq);
      if (p.master != kNone) order.push_back(p.master);
      if (p.compute != kNone) order.push_back(p.compute);
    }
  }
  store_->begin_pass(std::move(order));
  const std::vector<Parameter>& params = model_.params();
  for (size_t i = 0; i < flats_.size(); ++i) {
    Flat& f = flats_[i];
    if (!layout_.flats[i].trainable) continue;  // frozen: never written
    float* g = grad_shard(i);
    const DType dtype = layout_.flats[i].dtype;
    const auto esize = static_cast<int64_t>(dtype_size(dtype));
    char* resident_compute = dtype != DType::f32 && !params_in_store_
                                 ? static_cast<char*>(compute_values(i).raw())
                                 : nullptr;
    for (const Piece& p : f.pieces) {
      Tensor m = store_->acquire(p.exp_avg);
      Tensor v = store_->acquire(p.exp_avg_sq);
      Tensor master = p.master != kNone ? store_->acquire(p.master) : Tensor();
      Tensor stored_compute = p.compute != kNone ? store_->acquire(p.compute) : Tensor();
      for (const ShardSegment& s : f.segments) {
        const int64_t lo = std::max(s.shard_offset, p.begin);
        const int64_t hi = std::min(s.shard_offset + s.numel, p.end);
        if (lo >= hi) continue;
        const int64_t k = lo - p.begin;  // within the piece's chunks
        float* w = master.defined() ? master.data<float>() + k : f.master_alias.data<float>() + lo;
        char* compute = stored_compute.defined()
                            ? static_cast<char*>(stored_compute.raw()) + k * esize
                        : resident_compute != nullptr ? resident_compute + lo * esize
                                                      : nullptr;
        model_.backend().adamw_update(
            adamw_hyper(adamw_, params[s.param].spec, lr, step_count_, grad_scale), w, g + lo,
            m.data<float>() + k, v.data<float>() + k, ops::ComputeCopy(compute, dtype), hi - lo);
      }
      // Our handles go first: the store may free a buffer once released.
      m = v = master = stored_compute = Tensor();
      store_->release(p.exp_avg, true);
      store_->release(p.exp_avg_sq, true);
      if (p.master != kNone) store_->release(p.master, true);
      if (p.compute != kNone) store_->release(p.compute, true);
    }
  }
  store_->end_pass();
  const OffloadStats now = store_->stats();
  timing_.offload.bytes_read = now.bytes_read - step_store_stats_.bytes_read;
  timing_.offload.bytes_written = now.bytes_written - step_store_stats_.bytes_written;
  timing_.offload.ready_at_acquire = now.ready_at_acquire - step_store_stats_.ready_at_acquire;
  timing_.offload.waited_at_acquire = now.waited_at_acquire - step_store_stats_.waited_at_acquire;
  timing_.offload.wait_seconds = now.wait_seconds - step_store_stats_.wait_seconds;
  if (options_.stage <= 2) all_gather_updated(false);
}

void ShardedDataParallel::all_gather_updated(bool frozen_too) {
  for (size_t i = 0; i < flats_.size(); ++i) {
    const FlatParam& fp = layout_.flats[i];
    Flat& f = flats_[i];
    if ((!fp.trainable && !frozen_too) || fp.packed) continue;  // packed: written whole
    wait_gather(i);
    std::vector<int64_t> counts(static_cast<size_t>(fp.ranks), fp.shard);
    f.gather =
        group(i).all_gather_async(compute_values(i).raw(), f.full.raw(), counts,
                                  comm_dtype(fp.dtype));
    timing_.bytes += f.full.bytes();
    f.gather_pending = true;
  }
}

void ShardedDataParallel::quiesce() {
  finish_reduces();
  for (size_t i = 0; i < flats_.size(); ++i) {
    wait_gather(i);
    if (options_.stage == 3) release_params(i);
  }
  end_param_pass();  // what follows (checkpoints, loads) reads the store outside a pass
  param_pass_next_ = 0;  // the next gather begins a forward
}

// --- state in and out (initialisation, checkpoints) ---

std::vector<float> ShardedDataParallel::parameter_values(size_t param) {
  const Parameter& p = model_.params()[param];
  MESHTRAIN_CHECK(param_compute_dtype(p.spec, model_.precision()) == DType::f32,
                  "zero: parameter_values of '{}', which has a compute copy", p.spec.name);
  const size_t flat = layout_.param_flat[param];
  std::vector<float> values(static_cast<size_t>(p.spec.numel()), 0.0f);
  if (options_.stage <= 2) {
    wait_gather(flat);
    model_.copy_master_to_host(p, values.data());
    return values;
  }
  for (const ShardSegment& s : flats_[flat].segments) {
    if (s.param != param) continue;
    read_state(flat, State::master, s.shard_offset, s.shard_offset + s.numel,
               values.data() + s.param_offset);
  }
  group(flat).all_reduce(values.data(), p.spec.numel(), CommDType::f32, ReduceOp::sum);
  return values;
}

void ShardedDataParallel::add_to_parameter(size_t param, std::span<const float> delta) {
  Parameter& p = model_.params()[param];
  MESHTRAIN_CHECK(static_cast<int64_t>(delta.size()) == p.spec.numel() &&
                      param_compute_dtype(p.spec, model_.precision()) == DType::f32,
                  "zero: add_to_parameter of '{}' needs {} values and an f32 parameter",
                  p.spec.name, p.spec.numel());
  const size_t flat = layout_.param_flat[param];
  if (options_.stage <= 2) {
    wait_gather(flat);
    model_.add_to_master(p, delta);
    return;
  }
  std::vector<float> values;
  for (const ShardSegment& s : flats_[flat].segments) {
    if (s.param != param) continue;
    values.resize(static_cast<size_t>(s.numel));
    read_state(flat, State::master, s.shard_offset, s.shard_offset + s.numel, values.data());
    for (int64_t k = 0; k < s.numel; ++k) {
      values[static_cast<size_t>(k)] += delta[static_cast<size_t>(s.param_offset + k)];
    }
    write_state(flat, State::master, s.shard_offset, s.shard_offset + s.numel, values.data());
  }
}

void ShardedDataParallel::read_state(size_t flat, State state, int64_t begin, int64_t end,
                                     float* out) {
  const Flat& f = flats_[flat];
  const FlatParam& fp = layout_.flats[flat];
  Backend& backend = model_.backend();
  const int64_t n = end - begin;
  if (state == State::master && f.master_alias.defined()) {
    backend.copy_to_host(f.master_alias.view(begin, {n}), out);
    return;
  }
  if (!fp.trainable) {  // frozen: no moments; a 2-byte flat's values are its compute copy
    if (state != State::master) {
      std::fill_n(out, n, 0.0f);
      return;
    }
    std::vector<char> values(static_cast<size_t>(n) * dtype_size(fp.dtype));
    backend.copy_to_host(compute_values(flat).view(begin, {n}), values.data());
    convert(fp.dtype, values.data(), DType::f32, out, static_cast<size_t>(n));
    return;
  }
  for (const Piece& p : f.pieces) {
    const int64_t lo = std::max(begin, p.begin), hi = std::min(end, p.end);
    if (lo >= hi) continue;
    const size_t id = p.chunk(state);
    Tensor t = store_->acquire(id);
    backend.copy_to_host(t.view(lo - p.begin, {hi - lo}), out + (lo - begin));
    t = Tensor();
    store_->release(id, false);
  }
}

void ShardedDataParallel::write_state(size_t flat, State state, int64_t begin, int64_t end,
                                      const float* in) {
  const FlatParam& fp = layout_.flats[flat];
  Flat& f = flats_[flat];
  Backend& backend = model_.backend();
  const int64_t n = end - begin;
  if (state == State::master) {
    // The compute copy: rounded on the host, then copied in.
    std::vector<char> rounded;
    auto write_compute = [&](const float* from, int64_t count, const Tensor& to) {
      rounded.resize(static_cast<size_t>(count) * dtype_size(fp.dtype));
      convert(DType::f32, from, fp.dtype, rounded.data(), static_cast<size_t>(count));
      backend.copy_from_host(rounded.data(), to);
    };
    if (fp.dtype != DType::f32 && !params_in_store_) {
      write_compute(in, n, compute_values(flat).view(begin, {n}));
    }
    for (const Piece& p : f.pieces) {  // parameters in the store: the compute chunks
      const int64_t lo = std::max(begin, p.begin), hi = std::min(end, p.end);
      if (p.compute == kNone || lo >= hi) continue;
      Tensor t = store_->acquire(p.compute);
      write_compute(in + (lo - begin), hi - lo, t.view(lo - p.begin, {hi - lo}));
      t = Tensor();
      store_->release(p.compute, true);
    }
    if (f.master_alias.defined()) {
      backend.copy_from_host(in, f.master_alias.view(begin, {n}));
      return;
    }
  }
  for (const Piece& p : f.pieces) {
    const int64_t lo = std::max(begin, p.begin), hi = std::min(end, p.end);
    if (lo >= hi) continue;
    const size_t id = p.chunk(state);
    Tensor t = store_->acquire(id);
    backend.copy_from_host(in + (lo - begin), t.view(lo - p.begin, {hi - lo}));
    t = Tensor();
    store_->release(id, true);
  }
}

void ShardedDataParallel::init_weights(uint64_t seed) {
  quiesce();
  const std::vector<Parameter>& params = model_.params();
  std::vector<float> values, whole;
  for (size_t i = 0; i < flats_.size(); ++i) {
    if (layout_.flats[i].packed) continue;  // below
    values.assign(static_cast<size_t>(layout_.flats[i].shard), 0.0f);
    for (const ShardSegment& s : flats_[i].segments) {
      // A parameter's values depend on (seed, name, index) only.
      const ParamSpec& spec = params[s.param].spec;
      whole.resize(static_cast<size_t>(spec.numel()));
      init_parameter(spec, seed, whole.data());
      std::memcpy(values.data() + s.shard_offset, whole.data() + s.param_offset,
                  static_cast<size_t>(s.numel) * sizeof(float));
    }
    write_state(i, State::master, 0, layout_.flats[i].shard, values.data());
  }
  // QLoRA's NF4 base: quantised whole as Model::init_weights does (write_packed keeps
  // this rank's words).
  for (Parameter& p : model_.params()) {
    if (!p.spec.nf4) continue;
    const ParamSpec global = whole_spec(p.spec);
    whole.resize(static_cast<size_t>(global.numel()));
    init_parameter(global, seed, whole.data());
    model_.copy_nf4_from_global(p, whole.data());
  }
  if (options_.stage <= 2) all_gather_updated(true);
}

void ShardedDataParallel::load_full(State state, const float* full) {
  quiesce();
  const std::vector<Parameter>& params = model_.params();
  std::vector<float> values;
  for (size_t i = 0; i < flats_.size(); ++i) {
    if (layout_.flats[i].packed) continue;  // not state
    values.assign(static_cast<size_t>(layout_.flats[i].shard), 0.0f);
    for (const ShardSegment& s : flats_[i].segments) {
      std::memcpy(values.data() + s.shard_offset, full + params[s.param].offset + s.param_offset,
                  static_cast<size_t>(s.numel) * sizeof(float));
    }
    write_state(i, state, 0, layout_.flats[i].shard, values.data());
  }
  if (state == State::master && options_.stage <= 2) all_gather_updated(true);
}

void ShardedDataParallel::gather_full(State state, int root, float* full) {
  quiesce();
  MESHTRAIN_CHECK(rank_ != root || full != nullptr, "zero: gather_full without a buffer on root");
  MemoryTracker& tracker = model_.backend().tracker();
  const std::vector<Parameter>& params = model_.params();
  for (size_t i = 0; i < flats_.size(); ++i) {
    const FlatParam& fp = layout_.flats[i];
    if (fp.packed) continue;  // not state
    Tensor shard({fp.shard}, DType::f32, MemCategory::workspace, tracker);
    Tensor all({fp.padded}, DType::f32, MemCategory::workspace, tracker);
    read_state(i, state, 0, fp.shard, shard.data<float>());
    group(i).all_gather(shard.raw(), all.raw(), fp.shard, CommDType::f32);
    if (rank_ != root) continue;
    for (const FlatMember& m : fp.members) {
      std::memcpy(full + params[m.param].offset, all.data<float>() + m.offset,
                  static_cast<size_t>(m.numel) * sizeof(float));
    }
  }
}

void ShardedDataParallel::write_packed(size_t param, std::span<const uint8_t> packed) {
  const size_t flat = layout_.param_flat[param];
  const FlatParam& fp = layout_.flats[flat];
  Flat& f = flats_[flat];
  const int64_t words = fp.packed ? nf4_layout(model_.params()[param].spec).bytes / 4 : -1;
  MESHTRAIN_CHECK(static_cast<int64_t>(packed.size()) == 4 * words,
                  "zero: '{}' is not a packed NF4 weight of {} bytes",
                  model_.params()[param].spec.name, packed.size());
  quiesce();
  Backend& backend = model_.backend();
  if (options_.stage <= 2) {  // the whole packed flat on every rank
    backend.copy_from_host(packed.data(), f.full.view(layout_.param_offset[param], {words}));
    return;
  }
  for (const ShardSegment& s : f.segments) {
    if (s.param != param) continue;
    backend.copy_from_host(packed.data() + 4 * s.param_offset,
                           f.compute_shard.view(s.shard_offset, {s.numel}));
  }
}

}  // namespace meshtrain::zero
