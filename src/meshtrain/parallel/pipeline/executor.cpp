#include "meshtrain/parallel/pipeline/executor.h"

#include <chrono>
#include <deque>
#include <map>
#include <tuple>

#include "meshtrain/util/error.h"
#include "meshtrain/util/trace.h"

namespace meshtrain::pipeline {

std::vector<std::pair<int64_t, int64_t>> split_layers(int64_t n_layers, int total_stages,
                                                      const std::vector<int64_t>& split) {
  std::vector<std::pair<int64_t, int64_t>> ranges;
  if (!split.empty()) {
    MESHTRAIN_CHECK(static_cast<int>(split.size()) == total_stages,
                    "pipeline: parallel.pp_split has {} entries; pp x virtual_stages = {}",
                    split.size(), total_stages);
    int64_t begin = 0;
    for (int64_t n : split) {
      MESHTRAIN_CHECK(n >= 1, "pipeline: parallel.pp_split: every stage needs >= 1 layer, got {}",
                      n);
      ranges.emplace_back(begin, begin + n);
      begin += n;
    }
    MESHTRAIN_CHECK(begin == n_layers,
                    "pipeline: parallel.pp_split sums to {} layers; the model has n_layers = {}",
                    begin, n_layers);
    return ranges;
  }
  MESHTRAIN_CHECK(n_layers >= total_stages,
                  "pipeline: model.n_layers = {} is fewer than pp x virtual_stages = {} stages",
                  n_layers, total_stages);
  const int64_t base = n_layers / total_stages, extra = n_layers % total_stages;
  int64_t begin = 0;
  for (int s = 0; s < total_stages; ++s) {
    const int64_t n = base + (s < extra ? 1 : 0);
    ranges.emplace_back(begin, begin + n);
    begin += n;
  }
  return ranges;
}

StageLayers stage_layers(int64_t n_layers, const PipelineShape& shape, int rank,
                         const std::vector<int64_t>& split) {
  const auto ranges = split_layers(n_layers, shape.total_stages(), split);
  StageLayers stage;
  for (int c = 0; c < shape.virtual_stages; ++c) {
    stage.chunks.push_back(ranges[static_cast<size_t>(c * shape.stages + rank)]);
  }
  stage.first = rank == 0;
  stage.last = rank == shape.stages - 1;
  return stage;
}

Executor::Executor(Model& model, Communicator& pp, ScheduleKind kind, const PipelineShape& shape,
                   int64_t batch, int64_t seq)
    : model_(model), pp_(pp), kind_(kind), shape_(shape), batch_(batch), seq_(seq) {
  MESHTRAIN_CHECK(pp.size() == shape.stages, "pipeline: pp group has {} ranks, schedule {}",
                  pp.size(), shape.stages);
  MESHTRAIN_CHECK(static_cast<int>(model.stage_layers().chunks.size()) == shape.virtual_stages,
                  "pipeline: the stage model runs {} chunks, the schedule {}",
                  model.stage_layers().chunks.size(), shape.virtual_stages);
  actions_ = make_schedule(kind, shape)[static_cast<size_t>(pp.rank())];
  message_elems_ = model.stage_rows(batch, seq) * model.config().dim;
  // Agree the message size once: every rank's size must equal rank 0's.
  int64_t range[2] = {message_elems_, -message_elems_};
  pp.all_reduce(range, 2, CommDType::i64, ReduceOp::max);
  MESHTRAIN_CHECK(range[0] == -range[1],
                  "pipeline: stages disagree on the activation size: {} to {} elements per "
                  "message (micro-batch {} x seq {} x dim {} on this rank)",
                  -range[1], range[0], batch, seq, model.config().dim);
}

double Executor::run(std::span<const MicroBatchRef> micro_batches, float grad_scale) {
  using Clock = std::chrono::steady_clock;
  auto seconds = [](Clock::time_point a, Clock::time_point b) {
    return std::chrono::duration<double>(b - a).count();
  };
  MESHTRAIN_CHECK(static_cast<int>(micro_batches.size()) == shape_.micro_batches,
                  "pipeline: {} micro-batches given, the schedule has {}", micro_batches.size(),
                  shape_.micro_batches);
  timing_ = StepTiming{};
  const auto start = Clock::now();
  MemoryTracker& tracker = model_.backend().tracker();
  using Key = std::tuple<bool, int, int>;  // (grad, chunk, micro-batch)
  std::map<Key, Tensor> received, outgoing;
  std::vector<Work> works(actions_.size());  // by send_recv action
  struct Sending {
    size_t action = 0;  // the send_recv that posted it
    Work work;
    Tensor buffer;  // kept alive until the send is known complete
  };
  std::deque<Sending> sending;
  auto wait = [&](Work& work) {
    const auto t = Clock::now();
    work.wait();
    timing_.wait_seconds += seconds(t, Clock::now());
  };
  const int last_vs = shape_.total_stages() - 1;
  double loss = 0;
  for (size_t k = 0; k < actions_.size(); ++k) {
    const Action& a = actions_[k];
    if (a.kind == ActionKind::send_recv) {
      std::vector<P2POp> ops;
      std::vector<Tensor> sent;
      for (const Transfer& t : a.transfers) {
        const Key key{t.grad, t.chunk, t.micro_batch};
        Tensor buffer;
        if (t.send) {
          auto found = outgoing.find(key);
          MESHTRAIN_CHECK(found != outgoing.end(), "pipeline: nothing to send for chunk {} mb {}",
                          t.chunk, t.micro_batch);
          buffer = std::move(found->second);
          outgoing.erase(found);
          sent.push_back(buffer);
        } else {
          buffer = Tensor({message_elems_}, DType::f32, MemCategory::comm, tracker);
          received[key] = buffer;
        }
        ops.push_back(P2POp{t.send, buffer.raw(), message_elems_, CommDType::f32, t.peer, t.tag});
      }
      works[k] = pp_.send_recv_async(std::move(ops));
      for (Tensor& buffer : sent) sending.push_back(Sending{k, works[k], std::move(buffer)});
      continue;
    }
    if (a.receive >= 0) {
      // Waiting for a receive completes its batch: the batch's sent buffers
      // go now. Sent buffers are freed only here or at the step's end (never
      // when a poll happens to see them done), so the comm peak follows from
      // the schedule alone (train/memory_plan.cpp walks the same actions).
      const auto posted = static_cast<size_t>(a.receive);
      {
        trace::Span span("pipeline", "wait", a.micro_batch);
        wait(works[posted]);
      }
      std::erase_if(sending, [&](const Sending& s) { return s.action == posted; });
    }
    const MicroBatchRef& mb = micro_batches[static_cast<size_t>(a.micro_batch)];
    const int vs = a.chunk * shape_.stages + pp_.rank();
    const bool backward = a.kind == ActionKind::backward;
    Tensor in;
    if (auto found = received.find(Key{backward, a.chunk, a.micro_batch}); found != received.end()) {
      in = std::move(found->second);
      received.erase(found);
    }
    const bool sends = backward ? vs > 0 : vs < last_vs;
    Tensor out = sends ? Tensor({message_elems_}, DType::f32, MemCategory::comm, tracker) : Tensor();
    const auto t = Clock::now();
    trace::Span span("pipeline", backward ? "B" : "F", a.micro_batch);
    span.args(R"("micro_batch":{},"chunk":{},"stage":{})", a.micro_batch, a.chunk, vs);
    if (backward) {
      loss += model_.stage_backward(a.chunk, a.micro_batch, mb.tokens, mb.targets, grad_scale,
                                    in.defined() ? in.data<float>() : nullptr,
                                    out.defined() ? out.data<float>() : nullptr, mb.loss);
    } else {
      model_.stage_forward(a.chunk, a.micro_batch, mb.tokens,
                           in.defined() ? in.data<float>() : nullptr, batch_, seq_,
                           out.defined() ? out.data<float>() : nullptr, mb.positions);
      timing_.peak_in_flight = std::max(timing_.peak_in_flight, model_.stage_in_flight());
    }
    timing_.busy_seconds += seconds(t, Clock::now());
    if (sends) outgoing[Key{backward, a.chunk, a.micro_batch}] = std::move(out);
  }
  for (Sending& s : sending) wait(s.work);
  sending.clear();
  MESHTRAIN_CHECK(model_.stage_in_flight() == 0 && outgoing.empty() && received.empty(),
                  "pipeline: the schedule left {} activations held, {} messages unsent, {} unused",
                  model_.stage_in_flight(), outgoing.size(), received.size());
  timing_.total_seconds = seconds(start, Clock::now());
  return loss;
}

}  // namespace meshtrain::pipeline
