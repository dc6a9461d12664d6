// Data parallelism: every dp rank holds the whole model, runs its share of
// the global batch, and averages gradients over the dp group before the
// optimizer step, overlapping that averaging with the rest of backward.
//
// Buckets are contiguous ranges of the model's flat gradient buffer, formed
// in reverse registry order (the order backward completes gradients) up to
// bucket_mb each, so a bucket is all-reduced in place with no copy. On the
// last micro-batch of a step, Model::unit_hooks.after(u, backward) tells us
// when unit u's gradients are final; a bucket whose every overlapped unit is
// final is all-reduced (avg) at once on the communication thread while
// backward continues. Earlier micro-batches
// only accumulate locally (no communication). finish_gradient_sync() issues
// whatever is left (everything, with overlap off) and waits: afterwards every
// rank holds the same averaged gradients, so clipping and the optimizer step
// are the single-rank ones.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/model/model.h"

namespace meshtrain {

struct DdpOptions {
  double bucket_mb =
      25;               // MiB of gradients per bucket (the last one may be larger by one parameter)
  bool overlap = true;  // all-reduce buckets during backward; false: all after backward
};

struct GradBucket {
  size_t first_param = 0, end_param = 0;  // registry indices [first, end)
  int64_t offset = 0, numel = 0;          // elements of the flat gradient buffer
  bool expert = false;  // routed experts' gradients: averaged over the expert-data-parallel group
};

// The unit holding each bucket's first parameter: units finish backward in
// decreasing order, so a bucket is complete once that unit is.
std::vector<size_t> bucket_first_units(const std::vector<GradBucket>& buckets,
                                       const std::vector<ParamUnit>& units);

// The last synchronised step, for metrics and tests.
struct DdpSyncTiming {
  CommClock::time_point backward_end;  // the last micro-batch's backward returned
  CommClock::time_point sync_end;      // every bucket averaged
  // CommTimeline over the buckets' all-reduces: wall time in flight, and the
  // part of it finish_gradient_sync waited for (never more).
  double comm_seconds = 0;
  double exposed_seconds = 0;
  std::vector<CallRecord> calls;       // the buckets' all-reduces, in issue order
};

// Splits params (registry order) into buckets of about bucket_bytes, from the
// last parameter backwards. Bucket 0 holds the last parameters. split_experts:
// a bucket holds routed experts' gradients only (ParamSpec::expert) or none.
std::vector<GradBucket> make_grad_buckets(const std::vector<Parameter>& params,
                                          size_t bucket_bytes, bool split_experts = false);

class DistributedDataParallel {
 public:
  // Installs the model's unit_hooks.after; `model` (flat storage) and `dp` must outlive this.
  // experts: under expert parallelism, the expert-data-parallel group the
  // routed experts' gradients are averaged over (expert_parallel.h: the model
  // has scaled them by 1 / ep); null: every gradient over dp.
  DistributedDataParallel(Model& model, Communicator& dp, const DdpOptions& options,
                          Communicator* experts = nullptr);
  ~DistributedDataParallel();  // waits for pending all-reduces, removes the hook
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  // Call before each micro-batch's forward_backward; `last` on the step's
  // final micro-batch (the only one that communicates).
  void begin_micro_batch(bool last);
  // After the final micro-batch's backward: issues the buckets not yet issued,
  // waits for all. The gradients are then the average over the dp group.
  void finish_gradient_sync();

  const std::vector<GradBucket>& buckets() const { return buckets_; }
  const DdpSyncTiming& last_sync() const { return timing_; }
  Communicator& dp() { return dp_; }

 private:
  void on_unit_done(size_t unit, UnitPass pass);
  void launch(size_t bucket);

  Model& model_;
  Communicator& dp_;
  Communicator* experts_;
  DdpOptions options_;
  std::vector<GradBucket> buckets_;
  std::vector<size_t> bucket_units_;  // bucket_first_units(buckets_, ...)
  std::vector<Work> pending_;  // one per bucket issued this step
  size_t next_bucket_ = 0;     // the next bucket to issue
  bool syncing_ = false;       // inside the final micro-batch's backward
  DdpSyncTiming timing_;
};

}  // namespace meshtrain
