#include "meshtrain/parallel/ddp/ddp.h"

#include <cmath>

#include "meshtrain/util/error.h"

namespace meshtrain {

std::vector<GradBucket> make_grad_buckets(const std::vector<Parameter>& params,
                                          size_t bucket_bytes, bool split_experts) {
  // Over the trainable parameters only (frozen ones have no gradient): their
  // gradients are contiguous in the flat grad buffer, in registry order.
  std::vector<GradBucket> buckets;
  size_t end = params.size();
  while (end > 0 && !params[end - 1].spec.trainable) --end;
  // Whether the trainable parameter i belongs in another group than `expert`.
  auto other_group = [&](size_t i, bool expert) {
    return split_experts && params[i].spec.trainable && params[i].spec.expert != expert;
  };
  while (end > 0) {
    const bool expert = split_experts && params[end - 1].spec.expert;
    size_t first = end, bytes = 0;
    // At least one parameter per bucket, however small bucket_bytes is.
    do {
      --first;
      if (params[first].spec.trainable) {
        bytes += static_cast<size_t>(params[first].spec.numel()) * sizeof(float);
      }
    } while (first > 0 && bytes < bucket_bytes && !other_group(first - 1, expert));
    while (!params[first].spec.trainable) ++first;
    GradBucket b;
    b.expert = expert;
    b.first_param = first;
    b.end_param = end;
    b.offset = params[first].grad_offset;
    b.numel = params[end - 1].grad_offset + params[end - 1].spec.numel() - b.offset;
    buckets.push_back(b);
    end = first;
    while (end > 0 && !params[end - 1].spec.trainable) --end;
  }
  return buckets;
}

std::vector<size_t> bucket_first_units(const std::vector<GradBucket>& buckets,
                                       const std::vector<ParamUnit>& units) {
  std::vector<size_t> first_units;
  for (const GradBucket& b : buckets) {
    size_t u = 0;
    while (u < units.size() && units[u].end_param <= b.first_param) ++u;
    MESHTRAIN_CHECK(u < units.size(), "ddp: bucket at parameter {} lies outside every unit",
                    b.first_param);
    first_units.push_back(u);
  }
  return first_units;
}

DistributedDataParallel::DistributedDataParallel(Model& model, Communicator& dp,
                                                 const DdpOptions& options, Communicator* experts)
    : model_(model), dp_(dp), experts_(experts), options_(options) {
  MESHTRAIN_CHECK(std::isfinite(options.bucket_mb) && options.bucket_mb > 0,
                  "ddp: parallel.bucket_mb must be > 0, got {}", options.bucket_mb);
  MESHTRAIN_CHECK(model.storage() == ParamStorage::flat,
                  "ddp: needs the model's flat gradient buffer (flat parameter storage)");
  MESHTRAIN_CHECK(!model.unit_hooks.after, "ddp: the model already has a unit_hooks.after hook");
  buckets_ = make_grad_buckets(model.params(),
                               static_cast<size_t>(options.bucket_mb * 1024.0 * 1024.0),
                               experts_ != nullptr);
  bucket_units_ = bucket_first_units(buckets_, model.units());
  model_.unit_hooks.after = [this](size_t unit, UnitPass pass) { on_unit_done(unit, pass); };
}

DistributedDataParallel::~DistributedDataParallel() {
  model_.unit_hooks.after = nullptr;
  // The buffers the pending calls use belong to the model: let them finish.
  for (Work& w : pending_) {
    try {
      w.wait();
    } catch (...) {  // already failing; the error was or will be reported elsewhere
    }
  }
}

void DistributedDataParallel::begin_micro_batch(bool last) {
  MESHTRAIN_CHECK(pending_.empty(), "ddp: a micro-batch began before the previous sync finished");
  syncing_ = last;
  next_bucket_ = 0;
}

void DistributedDataParallel::on_unit_done(size_t unit, UnitPass pass) {
  if (pass != UnitPass::backward || !syncing_ || !options_.overlap) return;
  // Units complete in decreasing order (the model checks), so every bucket
  // starting in this unit or a later one is complete.
  while (next_bucket_ < buckets_.size() && bucket_units_[next_bucket_] >= unit) {
    launch(next_bucket_++);
  }
}

void DistributedDataParallel::launch(size_t bucket) {
  const GradBucket& b = buckets_[bucket];
  float* grads = model_.flat_grad().data<float>() + b.offset;
  Communicator& group = b.expert ? *experts_ : dp_;
  pending_.push_back(group.all_reduce_async(grads, b.numel, CommDType::f32, ReduceOp::avg));
}

void DistributedDataParallel::finish_gradient_sync() {
  MESHTRAIN_CHECK(syncing_, "ddp: finish_gradient_sync without a final micro-batch");
  timing_ = DdpSyncTiming{};
  timing_.backward_end = CommClock::now();
  while (next_bucket_ < buckets_.size()) launch(next_bucket_++);
  CommTimeline timeline;
  for (Work& w : pending_) {
    const CommClock::time_point began = CommClock::now();
    w.wait();
    CallRecord r = w.record();
    timeline.add(r, began, CommClock::now());
    timing_.calls.push_back(r);
  }
  pending_.clear();
  syncing_ = false;
  timing_.sync_end = CommClock::now();
  timing_.comm_seconds = timeline.in_flight_seconds();
  timing_.exposed_seconds = timeline.exposed_seconds();
}

}  // namespace meshtrain
