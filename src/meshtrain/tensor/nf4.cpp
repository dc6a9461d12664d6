#include "meshtrain/tensor/nf4.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "meshtrain/util/error.h"

namespace meshtrain::nf4 {
namespace {

// Midpoints between neighbouring code values (f32, as bitsandbytes' bounds).
template <size_t N>
std::array<float, N - 1> midpoints(const std::array<float, N>& code) {
  std::array<float, N - 1> bounds{};
  for (size_t k = 0; k + 1 < N; ++k) bounds[k] = (code[k] + code[k + 1]) / 2.0f;
  return bounds;
}

// torch.bucketize(v, bounds, right=False): the number of bounds below v.
template <size_t N>
uint8_t bucketize(float v, const std::array<float, N>& bounds) {
  return static_cast<uint8_t>(std::lower_bound(bounds.begin(), bounds.end(), v) - bounds.begin());
}

// torch.linspace(start, end, steps) in f32 as torch 2 computes it: each half
// stepped from its own end, one rounding per value (a fused multiply-add).
// (Debian's torch 1.13 rounds differently in 42 of the map's values; current
// bitsandbytes runs on torch 2.)
std::vector<float> linspace(float start, float end, int64_t steps) {
  const float step = (end - start) / static_cast<float>(steps - 1);
  std::vector<float> out(static_cast<size_t>(steps));
  for (int64_t i = 0; i < steps; ++i) {
    out[static_cast<size_t>(i)] = i < steps / 2
                                      ? std::fma(step, static_cast<float>(i), start)
                                      : std::fma(-step, static_cast<float>(steps - i - 1), end);
  }
  return out;
}

std::array<float, 256> make_dynamic_map() {
  // Exponent e = 0..6 scales 2^e fraction means by 10^(e - 6), with both signs;
  // then 0 and 1.
  std::vector<float> data;
  for (int e = 0; e < 7; ++e) {
    const std::vector<float> bounds = linspace(0.1f, 1.0f, (int64_t{1} << e) + 1);
    const auto scale = static_cast<float>(std::pow(10.0, e - 6));
    for (int sign : {1, -1}) {
      for (size_t k = 0; k + 1 < bounds.size(); ++k) {
        data.push_back(static_cast<float>(sign) * scale * ((bounds[k] + bounds[k + 1]) / 2.0f));
      }
    }
  }
  data.push_back(0.0f);
  data.push_back(1.0f);
  MESHTRAIN_CHECK(data.size() == 256, "nf4: the dynamic map has {} values", data.size());
  std::sort(data.begin(), data.end());
  std::array<float, 256> map{};
  std::copy(data.begin(), data.end(), map.begin());
  return map;
}

// clamp(x * (1 / max(absmax, 1e-38)), -1, 1): bitsandbytes' scaling.
float scaled(float x, float absmax) {
  return std::clamp(x * (1.0f / std::max(absmax, 1e-38f)), -1.0f, 1.0f);
}

float max_abs(std::span<const float> x) {
  float m = 0.0f;
  for (float v : x) m = std::max(m, std::fabs(v));
  return m;
}

}  // namespace

const std::array<float, 16>& levels() {
  // The quantiles of N(0, 1) normalised to [-1, 1] (QLoRA's appendix; bitsandbytes' table).
  static const std::array<float, 16> table = {
      -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
      -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
      0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f, 0.33791524171829224f,
      0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f, 1.0f};
  return table;
}

const std::array<float, 256>& dynamic_map() {
  static const std::array<float, 256> map = make_dynamic_map();
  return map;
}

Layout layout(int64_t n, Form form) {
  MESHTRAIN_CHECK(n > 0 && n % kBlock == 0,
                  "nf4: a quantised tensor needs a positive multiple of {} elements, got {}",
                  kBlock, n);
  Layout l;
  l.form = form;
  l.n = n;
  l.blocks = n / kBlock;
  if (form == Form::slice) {
    l.absmax_at = 0;
    l.packed_at = 4 * l.blocks;
  } else {
    l.groups = (l.blocks + kScaleBlock - 1) / kScaleBlock;
    l.scales_at = 0;
    l.offset_at = l.groups * 4;
    l.codes_at = l.offset_at + 4;
    l.packed_at = l.codes_at + l.blocks;
  }
  l.bytes = (l.packed_at + n / 2 + 3) / 4 * 4;
  return l;
}

float block_absmax(std::span<const uint8_t> packed, const Layout& l, int64_t b) {
  float absmax = 0.0f;
  if (l.form == Form::slice) {
    std::memcpy(&absmax, packed.data() + l.absmax_at + 4 * b, 4);
    return absmax;
  }
  float s = 0.0f, offset = 0.0f;
  std::memcpy(&s, packed.data() + l.scales_at + 4 * (b / kScaleBlock), 4);
  std::memcpy(&offset, packed.data() + l.offset_at, 4);
  return dynamic_map()[packed[static_cast<size_t>(l.codes_at + b)]] * s + offset;
}

void quantize(std::span<const float> x, std::span<uint8_t> out) {
  const Layout l = layout(static_cast<int64_t>(x.size()));
  MESHTRAIN_CHECK(static_cast<int64_t>(out.size()) == l.bytes,
                  "nf4: quantize needs {} output bytes, got {}", l.bytes, out.size());
  std::fill(out.begin(), out.end(), uint8_t{0});
  static const auto level_bounds = midpoints(levels());
  static const auto map_bounds = midpoints(dynamic_map());
  // Level 1: absmax and the packed codes.
  std::vector<float> absmax(static_cast<size_t>(l.blocks));
  uint8_t* packed = out.data() + l.packed_at;
  for (int64_t b = 0; b < l.blocks; ++b) {
    const std::span<const float> block = x.subspan(static_cast<size_t>(b * kBlock), kBlock);
    const float a = max_abs(block);
    absmax[static_cast<size_t>(b)] = a;
    for (int64_t i = 0; i < kBlock; i += 2) {
      const uint8_t hi = bucketize(scaled(block[static_cast<size_t>(i)], a), level_bounds);
      const uint8_t lo = bucketize(scaled(block[static_cast<size_t>(i + 1)], a), level_bounds);
      packed[(b * kBlock + i) / 2] = static_cast<uint8_t>(hi << 4 | lo);
    }
  }
  // Level 2: the absmax values, less their mean, in 8 bits per group of 256.
  double sum = 0.0;
  for (float a : absmax) sum += a;
  const auto offset = static_cast<float>(sum / static_cast<double>(l.blocks));
  std::memcpy(out.data() + l.offset_at, &offset, 4);
  for (float& a : absmax) a -= offset;
  for (int64_t g = 0; g < l.groups; ++g) {
    const int64_t begin = g * kScaleBlock, end = std::min(l.blocks, begin + kScaleBlock);
    const std::span<const float> group(absmax.data() + begin, static_cast<size_t>(end - begin));
    const float s = max_abs(group);
    std::memcpy(out.data() + l.scales_at + 4 * g, &s, 4);
    for (int64_t b = begin; b < end; ++b) {
      out[static_cast<size_t>(l.codes_at + b)] =
          bucketize(scaled(absmax[static_cast<size_t>(b)], s), map_bounds);
    }
  }
}

void slice(std::span<const uint8_t> whole, int64_t n_whole, std::span<const int64_t> blocks,
           std::span<uint8_t> out) {
  const Layout w = layout(n_whole);
  const Layout l = layout(static_cast<int64_t>(blocks.size()) * kBlock, Form::slice);
  MESHTRAIN_CHECK(static_cast<int64_t>(whole.size()) == w.bytes && static_cast<int64_t>(out.size()) == l.bytes,
                  "nf4: slice of {} blocks needs {} and {} bytes, got {} and {}", blocks.size(),
                  w.bytes, l.bytes, whole.size(), out.size());
  std::fill(out.begin(), out.end(), uint8_t{0});
  for (size_t k = 0; k < blocks.size(); ++k) {
    const int64_t b = blocks[k];
    MESHTRAIN_CHECK(b >= 0 && b < w.blocks, "nf4: block {} of a {}-block tensor", b, w.blocks);
    const float absmax = block_absmax(whole, w, b);
    std::memcpy(out.data() + l.absmax_at + 4 * static_cast<int64_t>(k), &absmax, 4);
    std::memcpy(out.data() + l.packed_at + static_cast<int64_t>(k) * kBlock / 2,
                whole.data() + w.packed_at + b * kBlock / 2, kBlock / 2);
  }
}

void dequantize(std::span<const uint8_t> packed, std::span<float> out, Form form) {
  const Layout l = layout(static_cast<int64_t>(out.size()), form);
  MESHTRAIN_CHECK(static_cast<int64_t>(packed.size()) == l.bytes,
                  "nf4: dequantize needs {} input bytes, got {}", l.bytes, packed.size());
  for (int64_t b = 0; b < l.blocks; ++b) {
    const float absmax = block_absmax(packed, l, b);
    for (int64_t i = 0; i < kBlock; ++i) {
      const uint8_t pair = packed[static_cast<size_t>(l.packed_at + (b * kBlock + i) / 2)];
      const uint8_t q = i % 2 == 0 ? pair >> 4 : pair & 0xF;
      out[static_cast<size_t>(b * kBlock + i)] = levels()[q] * absmax;
    }
  }
}

}  // namespace meshtrain::nf4
