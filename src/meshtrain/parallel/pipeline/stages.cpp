// What the training loop needs from a pipeline beyond one step's schedule:
// evaluation, the gradient norm over stages, the whole model gathered.
#include <cmath>

#include "meshtrain/backend/backend.h"
#include "meshtrain/parallel/pipeline/executor.h"
#include "meshtrain/util/error.h"

namespace meshtrain::pipeline {

double Executor::evaluate(std::span<const MicroBatchRef> micro_batches) {
  const int p = shape_.stages, rank = pp_.rank(), last_vs = shape_.total_stages() - 1;
  MemoryTracker& tracker = model_.backend().tracker();
  const int tag_base = 2 * shape_.total_stages() * shape_.micro_batches;  // past the step's tags
  double loss = 0;
  std::vector<Work> sends;
  std::vector<Tensor> buffers;
  for (size_t i = 0; i < micro_batches.size(); ++i) {
    const int mb = static_cast<int>(i);
    for (int c = 0; c < shape_.virtual_stages; ++c) {
      const int vs = c * p + rank;
      Tensor in, out;
      if (vs > 0) {
        in = Tensor({message_elems_}, DType::f32, MemCategory::comm, tracker);
        pp_.send_recv_async({P2POp{false, in.raw(), message_elems_, CommDType::f32, (vs - 1) % p,
                                   tag_base + vs}})
            .wait();
      }
      if (vs < last_vs) out = Tensor({message_elems_}, DType::f32, MemCategory::comm, tracker);
      model_.stage_forward(c, mb, micro_batches[i].tokens,
                           in.defined() ? in.data<float>() : nullptr, batch_, seq_,
                           out.defined() ? out.data<float>() : nullptr, micro_batches[i].positions);
      if (vs == last_vs) {
        loss += model_.stage_loss(c, mb, micro_batches[i].targets, micro_batches[i].loss);
      } else {
        sends.push_back(pp_.send_recv_async(
            {P2POp{true, out.raw(), message_elems_, CommDType::f32, (vs + 1) % p, tag_base + vs + 1}}));
        buffers.push_back(std::move(out));
      }
    }
    // Forward only: nothing of this micro-batch is needed again.
    model_.drop_stage_activations();
  }
  for (Work& w : sends) w.wait();
  return loss;
}

double pipeline_grad_norm(const Model& model, Communicator& pp) {
  double total = grad_sum_squares(model);
  pp.all_reduce(&total, 1, CommDType::f64, ReduceOp::sum);
  return std::sqrt(total);
}

std::vector<float> gather_stages(Communicator& pp, const Model& model, const PipelineShape& shape,
                                 const std::vector<int64_t>& split, const float* local, int root) {
  const ModelConfig& config = model.config();
  const TensorParallel& tp = model.tensor_parallel();
  const std::vector<ParamSpec> specs = build_param_specs(config, tp.rank(), tp.size());
  std::vector<int64_t> offsets(specs.size() + 1, 0);
  for (size_t i = 0; i < specs.size(); ++i) offsets[i + 1] = offsets[i] + specs[i].numel();
  auto held = [&](int r) {
    return stage_param_indices(config, stage_layers(config.n_layers, shape, r, split));
  };
  auto numel = [&](const std::vector<size_t>& indices) {
    int64_t n = 0;
    for (size_t g : indices) n += specs[g].numel();
    return n;
  };
  if (pp.rank() != root) {
    pp.send(local, numel(held(pp.rank())), CommDType::f32, root);
    return {};
  }
  std::vector<float> full(static_cast<size_t>(offsets.back()));
  std::vector<float> part;
  for (int r = 0; r < pp.size(); ++r) {
    const std::vector<size_t> indices = held(r);
    const float* from = local;
    if (r != root) {
      part.resize(static_cast<size_t>(numel(indices)));
      pp.recv(part.data(), static_cast<int64_t>(part.size()), CommDType::f32, r);
      from = part.data();
    }
    // A tied output layer arrives twice with equal values; either copy will do.
    for (size_t g : indices) {
      std::copy(from, from + specs[g].numel(), full.begin() + offsets[g]);
      from += specs[g].numel();
    }
  }
  return full;
}

void select_stage(const Model& model, const float* whole, float* local) {
  const TensorParallel& tp = model.tensor_parallel();
  const std::vector<ParamSpec> specs = build_param_specs(model.config(), tp.rank(), tp.size());
  std::vector<int64_t> offsets(specs.size() + 1, 0);
  for (size_t i = 0; i < specs.size(); ++i) offsets[i + 1] = offsets[i] + specs[i].numel();
  const std::vector<size_t> held = stage_param_indices(model.config(), model.stage_layers());
  const std::vector<Parameter>& params = model.params();
  for (size_t i = 0; i < held.size(); ++i) {
    std::copy(whole + offsets[held[i]], whole + offsets[held[i] + 1], local + params[i].offset);
  }
}

}  // namespace meshtrain::pipeline
