// Memory per rank, by the engine's MemoryTracker categories (params, grads,
// optimizer, activations, workspace, comm, offloaded: host memory) plus an
// allowance for allocator fragmentation. Formulas and sources: docs/plan.md.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "meshtrain/model/config.h"
#include "meshtrain/parallel/context/context_parallel.h"

namespace meshtrain::plan {

// The model's activation-checkpointing modes (model/config.h), by the same names.
using meshtrain::parse_recompute;
using meshtrain::Recompute;
using meshtrain::RecomputePolicy;
using meshtrain::recompute_name;
// Printed and parsed by these names, in this order (memory.cpp).
// DualPipe (DeepSeek-V3 section 3.2.1): two pipelines in opposite directions,
// each rank holding stage r and stage p - 1 - r, a forward chunk of one
// micro-batch overlapped with a backward chunk of another.
enum class Schedule { gpipe, one_f_one_b, interleaved, dualpipe };
enum class Offload { none, optimizer };
enum class Optimizer { adamw, sgd };

std::string_view schedule_name(Schedule s);
Schedule parse_schedule(std::string_view name);
std::string_view offload_name(Offload o);
Offload parse_offload(std::string_view name);
std::string_view optimizer_name(Optimizer o);
Optimizer parse_optimizer(std::string_view name);

// Bytes per parameter of each model state, the ZeRO paper's 2 + 2 + K.
// Mixed-precision Adam: 16-bit weights and gradients, K = 12 (fp32 master
// copy, momentum, variance). The master copy counts as optimizer state here,
// as in the paper (the CPU engine counts it under params: engine_memory).
struct StateBytes {
  double weights = 2;
  double grads = 2;
  double optimizer = 12;
};
StateBytes state_bytes(Precision precision, Optimizer optimizer);

struct ModelStates {
  double params = 0, grads = 0, optimizer = 0;
  double total() const { return params + grads + optimizer; }
};
// Per rank for `psi` parameters replicated over `n` data-parallel ranks.
// ZeRO stage 1 shards the optimizer state, 2 also the gradients, 3 also the
// weights (Rajbhandari et al. 2020, section 5 and figure 1).
ModelStates model_state_memory(double psi, const StateBytes& bytes, int zero_stage, int64_t n);

// DeepSpeed's documented estimators (deepspeed "Memory Requirements" page,
// estimate_zero2/3_model_states_mem_needs, no offload): bytes per GPU.
double deepspeed_zero2_gpu_bytes(double params, int64_t gpus_per_node, int64_t nodes);
double deepspeed_zero3_gpu_bytes(double params, double largest_layer_params,
                                 int64_t gpus_per_node, int64_t nodes);

// One micro-batch through one transformer layer on one tensor-parallel rank.
struct ActivationShape {
  ModelConfig model;
  int64_t seq = 0, micro_batch = 1, tp = 1;
  bool sequence_parallel = false;
  Recompute recompute = Recompute::none;
  bool dropout = false;   // GPT-style dropout masks (1 byte per value)
  double value_bytes = 2; // 16-bit activations
  int64_t cp = 1;         // context parallelism: each rank keeps seq / cp positions
  // Bytes per value of what the linear layers keep for their weight gradient
  // (their inputs, and SwiGLU's, whose output is one): FP8 GEMMs keep them
  // in 8 bits (1; DeepSeek-V3 section 3.3.3); 0: value_bytes.
  double linear_input_bytes = 0;
};
// Korthikanti et al. 2022, section 4 (generalised to GQA, MLA and gated MLPs):
//   kept whole under TP without SP: norm inputs 4sbh, attention and MLP inputs
//   2sbh each, dropout masks sbh each; split by tp: Q 2sb*qk, K and V 2sb*k and
//   2sb*v, attention output 2sb*values (plan/transformer.h AttentionShape; 2sbh,
//   2sb*kv, 2sb*kv, 2sbh for MHA), MLP (gated 6sbf, else 4sbf); never split:
//   MLA's latents 2sb*latent; attention core (2 + 3*dropout) * a*s^2*b,
//   dropped by selective recomputation, which for a gated MLP also keeps only
//   gate|up (4sbf) and recomputes their product;
//   full recomputation keeps only the layer input, 2sbh (/tp with SP).
//   With context parallelism s is seq / cp (the core: a (seq / cp) seq b).
//   MLA under selective recomputation keeps the latents, not the Q, K and V
//   its up-projections write (AttentionShape::from_latent). FP8 GEMMs keep
//   the attention and MLP inputs, the o-projection's input and the MLP's
//   values at linear_input_bytes.
double layer_activation_bytes(const ActivationShape& shape);
// Extra activation bytes per micro-batch on the first stage (embedding dropout
// mask) and the last stage (final norm input, output-layer input, fp32 logits 4sbv/t).
double first_stage_activation_bytes(const ActivationShape& shape);
double last_stage_activation_bytes(const ActivationShape& shape);

// How many micro-batches' worth of a stage's layers stage `stage` holds at its
// peak (Narayanan et al. 2021; Korthikanti et al. 2022, section 4.2.3):
//   GPipe m; 1F1B min(p - stage, m);
//   interleaved (v chunks) min(2(p - stage - 1) + (v - 1)p + 1, m v) / v,
//   which for stage 0 is p (1 + (p - 1)/(p v)); DualPipe min(p + 1, m)
//   (DeepSeek-V3 table 2).
double inflight_microbatches(Schedule schedule, int64_t p, int64_t v, int64_t m, int64_t stage);
// Idle fraction of the ideal step: (p - 1) / (v m).
double bubble_fraction(int64_t p, int64_t v, int64_t m);

struct MemoryBreakdown {
  double params = 0, grads = 0, optimizer = 0, activations = 0, workspace = 0, comm = 0;
  double fragmentation = 0;  // allowance on top of the tracked categories
  double offloaded = 0;      // host memory (not counted in device_total)
  double tracked() const { return params + grads + optimizer + activations + workspace + comm; }
  double device_total() const { return tracked() + fragmentation; }
};
// (category name, bytes) in the engine's order (mem_category_name, incl.
// "offloaded"), then "fragmentation".
std::vector<std::pair<std::string, double>> categories(const MemoryBreakdown& m);

// What the CPU engine allocates for one rank of a run (train/ config): f32
// master + bf16 compute copies of matmul weights (params), f32 grads, AdamW
// moments, and the activations Model::forward_backward keeps for one
// micro-batch under `recompute` (model/model_impl.h BlockActs and the one
// shared set of recomputed tensors; exact). Workspace is estimated. Under
// context parallelism (`cp` > 1, `method`: parallel.cp_comm) a rank runs seq
// / cp tokens against the whole sequence's keys (Ulysses: the sequence for
// heads / cp): its activations, and the exchange buffers as comm (exact).
MemoryBreakdown engine_memory(const ModelConfig& model, Precision precision, int64_t micro_batch,
                              int64_t seq, const RecomputePolicy& recompute = {}, int64_t cp = 1,
                              CpComm method = CpComm::allgather);

}  // namespace meshtrain::plan
