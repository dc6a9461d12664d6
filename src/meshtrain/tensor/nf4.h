// 4-bit NormalFloat with double quantisation (QLoRA, Dettmers et al. 2023),
// exactly as bitsandbytes' quantize_4bit(quant_type="nf4", blocksize=64,
// compress_statistics=True) defines it on the CPU reference path:
//
//   level 1: per block b of 64 elements, absmax_b = max |x|;
//            q_i = bucketize(clamp(x_i * (1 / absmax_b), -1, 1), NF4 midpoints)
//            (the first level whose upper midpoint is >= the value), two codes per
//            byte, the first element in the high nibble.
//   level 2: offset = mean(absmax); per group g of 256 blocks,
//            s_g = max |absmax_b - offset|;
//            c_b = bucketize(clamp((absmax_b - offset) * (1 / s_g), -1, 1),
//            dynamic-map midpoints) (bitsandbytes' signed 8-bit dynamic map).
//   dequant: x~_i = NF4[q_i] * (DYN[c_b] * s_g + offset), in f32, then rounded
//            (nearest even) to the compute dtype.
//
// Every multiplication and comparison above is in f32, as bitsandbytes does
// them; the mean is summed in f64 and rounded once. One tensor's packed state is
// one byte buffer (Layout, Form::whole): [s f32 x groups][offset f32]
// [c u8 x blocks][q u8 x n/2], padded to 4 bytes.
//
// A slice (Form::slice; tensor parallelism, whose cuts fall between blocks):
// some blocks of a tensor quantised whole, each with its absmax as the whole
// tensor's dequantisation forms it (DYN[c_b] * s_g + offset, f32):
// [absmax f32 x blocks][q u8 x n/2]. Its values are bit for bit the whole
// tensor's at those blocks (the offset and the groups' scales are the whole
// tensor's, which no slice holds alone), for 4.5 bits per weight instead of
// 4.127. docs/finetune.md#qlora.
#pragma once

#include <array>
#include <cstdint>
#include <span>

namespace meshtrain::nf4 {

inline constexpr int64_t kBlock = 64;         // elements per absmax (level 1)
inline constexpr int64_t kScaleBlock = 256;   // absmax values per second-level scale

// The 16 NF4 levels (bitsandbytes' table, as f32), ascending; level 7 is 0.
const std::array<float, 16>& levels();
// bitsandbytes' create_dynamic_map(signed=True): 256 ascending f32 values in [-1, 1].
const std::array<float, 256>& dynamic_map();

enum class Form : uint8_t { whole, slice };

// Where one tensor's pieces lie in its packed byte buffer (-1: not in this form).
struct Layout {
  Form form = Form::whole;
  int64_t n = 0;                 // elements (a multiple of kBlock)
  int64_t blocks = 0, groups = 0;
  int64_t scales_at = -1;        // whole: f32 s_g, `groups` of them
  int64_t offset_at = -1;        // whole: f32 offset
  int64_t codes_at = -1;         // whole: u8 c_b, `blocks` of them
  int64_t absmax_at = -1;        // slice: f32 absmax_b, `blocks` of them
  int64_t packed_at = 0;         // u8 q pairs, n / 2 bytes
  int64_t bytes = 0;             // the whole buffer, padded to 4 bytes
};
// Throws Error unless n > 0 and n % kBlock == 0.
Layout layout(int64_t n, Form form = Form::whole);

// Block b's absmax in f32: stored (slice), or DYN[c_b] * s_g + offset (whole).
float block_absmax(std::span<const uint8_t> packed, const Layout& l, int64_t b);

// Quantises x[0, n) into out (layout(n).bytes bytes).
void quantize(std::span<const float> x, std::span<uint8_t> out);
// The slice form of the whole tensor `whole` (n_whole elements, Form::whole)
// at `blocks` (block indices, in the slice's order) into out.
void slice(std::span<const uint8_t> whole, int64_t n_whole, std::span<const int64_t> blocks,
           std::span<uint8_t> out);
// The dequantised values in f32 (the reference the backends' dequantize_nf4 equals).
void dequantize(std::span<const uint8_t> packed, std::span<float> out, Form form = Form::whole);

}  // namespace meshtrain::nf4
