// Fine-tuning plans: full, LoRA (Hu et al. 2021) and QLoRA (Dettmers et al.
// 2023). The base weights are frozen (no gradients, no optimizer state) in
// bf16 or 4-bit NF4 with double quantization; only the adapters train.
#pragma once

#include <cstdint>
#include <string_view>

#include "meshtrain/model/config.h"

namespace meshtrain::plan {

enum class FinetuneMethod { none, full, lora, qlora };  // none = pre-training
enum class LoraTargets { all, qv };  // every linear of a block (QLoRA), or W_q and W_v (LoRA paper)

std::string_view finetune_name(FinetuneMethod m);
FinetuneMethod parse_finetune(std::string_view name);
std::string_view lora_targets_name(LoraTargets t);
LoraTargets parse_lora_targets(std::string_view name);

struct Finetune {
  FinetuneMethod method = FinetuneMethod::none;
  int64_t rank = 16;
  LoraTargets targets = LoraTargets::all;
  bool adapters() const { return method == FinetuneMethod::lora || method == FinetuneMethod::qlora; }
};

// NF4 with double quantization (QLoRA section 3): 4 bits per weight, an 8-bit
// scale per block of 64 and an fp32 scale per 256 of those: 4 + 8/64 + 32/(64*256)
// = 4.127 bits.
inline constexpr double kNf4DoubleQuantBits = 4.0 + 8.0 / 64.0 + 32.0 / (64.0 * 256.0);
// A tensor-parallel rank's slice of an NF4 weight (meshtrain's nf4::Form::slice,
// tensor/nf4.h): each block's scale as the whole tensor's dequantisation forms
// it, in f32: 4 + 32/64 = 4.5 bits.
inline constexpr double kNf4SliceBits = 4.0 + 32.0 / 64.0;

// Trainable adapter parameters of one block: r (in + out) per targeted linear.
double lora_layer_params(const ModelConfig& model, const Finetune& f);
// Bytes per frozen base GEMM weight: 2 (bf16), or for QLoRA
// kNf4DoubleQuantBits / 8 (tp 1) or kNf4SliceBits / 8 (every block GEMM
// weight split over tp > 1 ranks).
double frozen_weight_bytes(const Finetune& f, int64_t tp = 1);

}  // namespace meshtrain::plan
