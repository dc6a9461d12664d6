// The parameter registry: every parameter has a global name (Hugging Face
// Llama / GPT-2 names), a global shape, a role (weight decay or not) and an
// initialisation rule. By default the model stores all parameters in three
// flat buffers (f32 master, f32 grads, bf16 or f16 compute copy), in registry order,
// so the optimizer, clipping and gradient buckets work on contiguous memory;
// with external storage (model.h) an owner such as ZeRO binds them instead.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "meshtrain/model/config.h"
#include "meshtrain/parallel/tensor/split.h"
#include "meshtrain/tensor/nf4.h"
#include "meshtrain/tensor/tensor.h"

namespace meshtrain {

enum class ParamRole { decay, no_decay };

enum class InitKind { normal, zeros, ones };

struct ParamSpec {
  std::string name;   // e.g. "model.layers.3.self_attn.q_proj.weight"
  Shape shape;        // this rank's shape: split.local_shape() (the global shape at tp 1)
  // Tensor parallelism: how the global tensor (split.global_shape, as Hugging
  // Face stores it) is divided over the tp ranks; kind none = replicated.
  TensorSplit split;
  ParamRole role = ParamRole::decay;
  InitKind init = InitKind::normal;
  float init_std = 0.02f;
  // Used as a GEMM operand (linear layers, the output layer, a tied embedding):
  // gets a compute copy (bf16 / f16) in mixed precision and counts toward model FLOPs.
  bool matmul_weight = false;
  // The share of it one token's pass uses: top_k / experts for routed
  // experts (config.h MoeConfig), else 1 (model FLOPs count active parameters).
  double active = 1.0;
  // A GEMM operand kept in f32 whatever the precision (a MoE router, a shared
  // expert's gate): no compute copy, but counted toward model FLOPs.
  bool f32_gemm = false;
  // A routed expert's tensor (global [E, ...]): under expert parallelism its
  // rows (experts) are split over the ep group (`split`, kind rows; experts
  // are never split over tp) and its gradients are averaged over the
  // expert-data-parallel group (parallel/expert/expert_parallel.h).
  bool expert = false;
  // Updated by the optimizer. LoRA (config.h LoraConfig) freezes every base
  // parameter: it gets no gradient, no optimizer state and (mixed precision,
  // matmul weights) no f32 master, only its compute copy.
  bool trainable = true;
  bool lora_adapter = false;  // a LoRA A or B matrix ("<module>.lora_A.weight")
  // QLoRA (lora.quantize_base = nf4): a frozen block linear's weight held as
  // NF4 (Parameter::nf4), neither master nor compute copy. Not checkpoint
  // state: it is rebuilt from the run's start (init, train.init_from).
  bool nf4 = false;
  int64_t numel() const { return shape_numel(shape); }
};

// The dtype the model computes with: compute_dtype(precision) for matmul weights in bf16 / fp16
// precision (read from Parameter::compute, or an NF4 weight dequantised to it), else f32 (read
// from master).
DType param_compute_dtype(const ParamSpec& spec, Precision precision);
// Whether the parameter has an f32 master copy: trainable ones always, frozen
// ones only when they compute in f32 (a frozen bf16 weight is its bf16 copy).
bool param_has_master(const ParamSpec& spec, Precision precision);

// An NF4 weight's packed layout: the whole tensor's, or under tensor
// parallelism its rank's slice of the tensor quantised whole (nf4::Form::slice);
// throws a config Error naming it unless that slice is whole NF4 blocks.
nf4::Layout nf4_layout(const ParamSpec& spec);
// The global blocks a tp slice of `spec` holds, in its order (nf4::slice).
std::vector<int64_t> nf4_slice_blocks(const ParamSpec& spec);
// The parameter as one tp rank holds it at tp = 1: the whole tensor.
ParamSpec whole_spec(const ParamSpec& spec);

struct Parameter {
  ParamSpec spec;
  // Element offset in the state space (every parameter, registry order: the
  // shard map's local offsets; also set in external storage).
  int64_t offset = 0;
  // Trainable parameters: offset in the flat gradient / optimizer buffers,
  // which hold the trainable parameters only, in registry order (== offset
  // without frozen parameters). -1 for a frozen parameter.
  int64_t grad_offset = 0;
  Tensor master;       // f32 view into the flat master buffer
  Tensor grad;         // f32 view into the flat grad buffer
  Tensor compute;      // bf16 / f16 view (mixed precision, matmul weights only); else undefined
  Tensor nf4;          // spec.nf4: its packed bytes (nf4::Layout), held in an i32 tensor
};

// fn(param, first element in it, element count, position in the range) for
// every parameter of `params` (registry order) overlapping state-space
// elements [offset, offset + count) (Parameter::offset).
template <typename Params, typename Fn>
void for_each_state_run(Params& params, int64_t offset, int64_t count, Fn&& fn) {
  auto it = std::upper_bound(params.begin(), params.end(), offset,
                             [](int64_t o, const Parameter& p) { return o < p.offset; });
  if (it != params.begin()) --it;
  for (; it != params.end() && it->offset < offset + count; ++it) {
    const int64_t begin = std::max(offset, it->offset);
    const int64_t end = std::min(offset + count, it->offset + it->spec.numel());
    if (begin < end) fn(*it, begin - it->offset, end - begin, begin - offset);
  }
}

// A unit: a contiguous registry range the model reads, and completes the
// gradients of, together: "embed" (token embeddings, + GPT-2 positions),
// "layers.<i>" (one per block), "head" (final norm, + untied lm_head).
struct ParamUnit {
  std::string name;
  size_t first_param = 0, end_param = 0;  // registry indices [first, end)
};

// Fills `out` (f32, spec.numel() elements) with the parameter's initial values:
// a function of (seed, spec.name, global element index) only, so a tp slice
// holds exactly its part of the tp = 1 values (padding: zeros).
void init_parameter(const ParamSpec& spec, uint64_t seed, float* out);

// A block's parameters: layer `layer`'s name prefix ("model.layers.3."), and
// its four GEMMs (model/block.cpp Block: qkv, proj, ff_in, ff_out), each with
// the modules it fuses in output order ("self_attn.q_proj"), whose weights
// (and LoRA adapters) are "<prefix><module>.weight" / ".lora_A.weight".
std::string block_param_prefix(Family family, int64_t layer);
std::array<std::vector<std::string>, 4> block_gemm_modules(Family family);

// The registry of a model shape, in flat-buffer order: embeddings, then per
// layer, then the final norm and (untied llama) lm_head. Llama's q/k/v and
// gate/up projections are adjacent so one GEMM covers each group.
// Under tensor parallelism (tp_size > 1) the shapes are rank tp_rank's slices
// (Megatron's split: q/k/v by heads, o by its input; gate/up/c_fc by output,
// down/c_proj by input; c_attn per q/k/v; embeddings and lm_head by vocabulary
// rows, padded; norms, positions and the biases of row-parallel layers replicated).
// Under expert parallelism (ep_size > 1) the routed experts' tensors are
// rank ep_rank's experts (ParamSpec::expert).
std::vector<ParamSpec> build_param_specs(const ModelConfig& config, int tp_rank = 0,
                                         int tp_size = 1, int ep_rank = 0, int ep_size = 1);
// Throws Error on every rank, naming the field, unless n_heads, n_kv_heads and
// hidden_dim divide by tp.
void check_tensor_parallel_split(const ModelConfig& config, int tp);
// The units of that registry, in registry order; they cover it exactly once.
std::vector<ParamUnit> build_param_units(const ModelConfig& config);

}  // namespace meshtrain
