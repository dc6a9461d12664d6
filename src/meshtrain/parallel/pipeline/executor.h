// Runs one rank's pipeline schedule (schedule.h) on a stage model: forwards
// and backwards through Model::stage_forward / stage_backward, activations and
// gradients exchanged with the neighbouring stages by asynchronous send_recv
// batches over the pp communicator, so a send overlaps the next compute.
//
// Every message of a step has the same shape, [stage_rows(batch, seq), dim]
// f32, agreed once by the pp group when the executor is built (an Error on
// every rank names both sizes when the stages disagree).
#pragma once

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/model/model.h"
#include "meshtrain/parallel/pipeline/schedule.h"

namespace meshtrain::pipeline {

struct MicroBatchRef {
  const int32_t* tokens = nullptr;   // [batch * seq]
  const int32_t* targets = nullptr;  // [batch * seq]
  const int32_t* positions = nullptr;  // [batch * seq] packed records, or nullptr (Model::stage_forward)
  TokenLoss loss;  // the head chunk's per-token weights and losses (model.h)
};

// One step on this rank.
struct StepTiming {
  double total_seconds = 0;  // the schedule, first action to the last send's completion
  double busy_seconds = 0;   // in stage forward / backward
  double wait_seconds = 0;   // blocked on a transfer: a peer's activation or gradient (the
                             // bubble, as this rank sees it) or the last sends
  double other_seconds() const { return total_seconds - busy_seconds - wait_seconds; }
  size_t peak_in_flight = 0;  // micro-batches whose activations were held at once
};

class Executor {
 public:
  // Collective over pp (the shape agreement). model must be a stage whose
  // chunks match shape.virtual_stages; model and pp must outlive this.
  Executor(Model& model, Communicator& pp, ScheduleKind kind, const PipelineShape& shape,
           int64_t batch, int64_t seq);

  // Runs this rank's actions on shape.micro_batches micro-batches. Gradients
  // are added with grad_scale; returns the sum of token losses (non-zero on
  // the last stage only).
  double run(std::span<const MicroBatchRef> micro_batches, float grad_scale);

  // Forward only (evaluation), micro-batch by micro-batch through every
  // chunk: the sum of token losses (non-zero on the last stage only). Every
  // micro-batch has the step's shape (batch x seq).
  double evaluate(std::span<const MicroBatchRef> micro_batches);

  const RankSchedule& actions() const { return actions_; }
  const PipelineShape& shape() const { return shape_; }
  ScheduleKind kind() const { return kind_; }
  const StepTiming& last_timing() const { return timing_; }
  int64_t micro_batch_rows() const { return batch_; }

 private:
  Model& model_;
  Communicator& pp_;
  ScheduleKind kind_;
  PipelineShape shape_;
  int64_t batch_ = 0, seq_ = 0, message_elems_ = 0;
  RankSchedule actions_;
  StepTiming timing_;
};

// Layer ranges [first, end) of the p * v virtual stages in order: `split`
// (layers per virtual stage, summing to n_layers) or, when empty, as even as
// possible (the first n_layers % (p * v) virtual stages get one more).
// Throws Error naming the numbers when a stage would get no layer.
std::vector<std::pair<int64_t, int64_t>> split_layers(int64_t n_layers, int total_stages,
                                                      const std::vector<int64_t>& split);
// The part of the model pipeline rank `rank` holds (virtual stages c * p + rank).
StageLayers stage_layers(int64_t n_layers, const PipelineShape& shape, int rank,
                         const std::vector<int64_t>& split);

// The whole model's gradient norm from its stages (collective over pp and
// tp): every global element once (tp: tp_counts_once; a tied output layer's
// copy on the last stage skipped).
double pipeline_grad_norm(const Model& model, Communicator& pp);

// Checkpoints and export: the whole model's flat tensor (registry order of
// build_param_specs(config, tp rank, tp size), the single-rank layout) from
// every stage's flat `local` (its params() order), assembled on pp rank
// `root`; the others get an empty vector. Collective over pp.
std::vector<float> gather_stages(Communicator& pp, const Model& model, const PipelineShape& shape,
                                 const std::vector<int64_t>& split, const float* local, int root);

// The inverse for one stage: its flat tensor (params() order) from the whole
// model's (the layout gather_stages returns). No communication.
void select_stage(const Model& model, const float* whole, float* local);

}  // namespace meshtrain::pipeline
