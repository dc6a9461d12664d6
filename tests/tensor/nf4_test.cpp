// NF4 with double quantisation (tensor/nf4.h) and the backend's dequantize_nf4:
// hand-worked blocks (codes at +-absmax, zero, exact midpoints), the packed
// layout's sizes, the errors, the round-trip error bound, and byte-for-byte
// agreement with tests/tensor/nf4_reference.py, which rebuilds the definition
// (bitsandbytes' quantize_4bit(nf4, blocksize=64, compress_statistics=True))
// with torch under Debian's python3.
//
// Under ctest's tensor.nf4_bitsandbytes, MESHTRAIN_NF4_BNB_PYTHON names the
// hf-venv's python: the reference then also runs bitsandbytes itself
// (--bitsandbytes), and a python or bitsandbytes that is missing makes the
// process exit 77 (ctest's SKIP_RETURN_CODE) instead of passing.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "meshtrain/backend/registry.h"
#include "meshtrain/tensor/dtype.h"
#include "meshtrain/tensor/memory_tracker.h"
#include "meshtrain/tensor/nf4.h"
#include "meshtrain/util/error.h"

namespace meshtrain {
namespace {

namespace fs = std::filesystem;

std::vector<uint8_t> quantized(const std::vector<float>& x) {
  std::vector<uint8_t> out(static_cast<size_t>(nf4::layout(static_cast<int64_t>(x.size())).bytes));
  nf4::quantize(x, out);
  return out;
}

std::vector<float> dequantized(const std::vector<uint8_t>& packed, int64_t n) {
  std::vector<float> out(static_cast<size_t>(n));
  nf4::dequantize(packed, out);
  return out;
}

// Element i's 4-bit level code (the first of a pair in the high nibble).
int code_of(const std::vector<uint8_t>& packed, int64_t n, int64_t i) {
  const uint8_t pair = packed[static_cast<size_t>(nf4::layout(n).packed_at + i / 2)];
  return i % 2 == 0 ? pair >> 4 : pair & 0xF;
}

float f32_at(const std::vector<uint8_t>& packed, int64_t at) {
  float v;
  std::memcpy(&v, packed.data() + at, 4);
  return v;
}

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

float level_mid(int k) { return (nf4::levels()[k] + nf4::levels()[k + 1]) / 2.0f; }

std::vector<float> normal(int64_t n, uint32_t seed, float sigma = 1.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, sigma);
  std::vector<float> x(static_cast<size_t>(n));
  for (float& v : x) v = dist(gen);
  return x;
}

TEST(Nf4, TablesAreAscendingWithZeroAndOne) {
  const auto& levels = nf4::levels();
  EXPECT_EQ(levels[0], -1.0f);
  EXPECT_EQ(levels[7], 0.0f);
  EXPECT_EQ(levels[15], 1.0f);
  EXPECT_TRUE(std::is_sorted(levels.begin(), levels.end()));
  EXPECT_EQ(std::adjacent_find(levels.begin(), levels.end()), levels.end());
  const auto& map = nf4::dynamic_map();
  EXPECT_TRUE(std::is_sorted(map.begin(), map.end()));
  EXPECT_EQ(std::adjacent_find(map.begin(), map.end()), map.end());
  EXPECT_EQ(map[127], 0.0f);  // 127 negative values below zero, 128 positive above
  EXPECT_EQ(map[255], 1.0f);
  EXPECT_GT(map[0], -1.0f);  // the most negative is a mean, -(0.9859375 + 1) / 2
  EXPECT_FLOAT_EQ(map[0], -0.99296875f);
  EXPECT_FLOAT_EQ(map[128], 5.5e-7f);  // the smallest positive: 1e-6 * (0.1 + 1) / 2
}

TEST(Nf4, LayoutSizes) {
  const nf4::Layout one = nf4::layout(64);
  EXPECT_EQ(one.blocks, 1);
  EXPECT_EQ(one.groups, 1);
  EXPECT_EQ(one.scales_at, 0);
  EXPECT_EQ(one.offset_at, 4);
  EXPECT_EQ(one.codes_at, 8);
  EXPECT_EQ(one.packed_at, 9);
  EXPECT_EQ(one.bytes, 44);  // 9 + 32 = 41, padded to 4

  const nf4::Layout full = nf4::layout(64 * 256);
  EXPECT_EQ(full.blocks, 256);
  EXPECT_EQ(full.groups, 1);
  EXPECT_EQ(full.offset_at, 4);
  EXPECT_EQ(full.codes_at, 8);
  EXPECT_EQ(full.packed_at, 264);
  EXPECT_EQ(full.bytes, 264 + 8192);

  const nf4::Layout two = nf4::layout(64 * 257);
  EXPECT_EQ(two.blocks, 257);
  EXPECT_EQ(two.groups, 2);
  EXPECT_EQ(two.offset_at, 8);
  EXPECT_EQ(two.codes_at, 12);
  EXPECT_EQ(two.packed_at, 269);
  EXPECT_EQ(two.bytes, 8496);  // 269 + 8224 = 8493, padded to 4
  for (int64_t n : {int64_t{64}, int64_t{128}, int64_t{64 * 255}, int64_t{64 * 513}})
    EXPECT_EQ(nf4::layout(n).bytes % 4, 0) << n;
}

TEST(Nf4, RejectsSizesThatAreNotWholeBlocks) {
  for (int64_t n : {int64_t{0}, int64_t{-64}, int64_t{1}, int64_t{63}, int64_t{65}, int64_t{96}})
    EXPECT_THROW(nf4::layout(n), Error) << n;
  std::vector<float> x(100, 1.0f);
  std::vector<uint8_t> out(256);
  EXPECT_THROW(nf4::quantize(x, out), Error);
  x.resize(64);
  out.resize(static_cast<size_t>(nf4::layout(64).bytes) - 4);  // one word short
  EXPECT_THROW(nf4::quantize(x, out), Error);
  out.resize(static_cast<size_t>(nf4::layout(64).bytes) + 4);
  EXPECT_THROW(nf4::quantize(x, out), Error);
  out.resize(static_cast<size_t>(nf4::layout(64).bytes));
  std::vector<float> y(65);
  EXPECT_THROW(nf4::dequantize(out, y), Error);
  y.resize(128);  // the buffer holds 64 elements, not 128
  EXPECT_THROW(nf4::dequantize(out, y), Error);
}

// One block by hand: absmax 2 (a power of two, so x * (1 / 2) is exact).
TEST(Nf4, HandWorkedBlock) {
  std::vector<float> x(64, 0.0f);
  x[0] = 2.0f;    // +absmax -> 15
  x[1] = -2.0f;   // -absmax -> 0
  x[2] = 0.0f;    // 7
  x[3] = -0.0f;   // 7
  // Exactly on the midpoint between levels k and k + 1: bucketize(right=False) gives k.
  for (int k = 0; k < 15; ++k) x[static_cast<size_t>(4 + k)] = 2.0f * level_mid(k);
  // The next f32 above each midpoint: k + 1.
  for (int k = 0; k < 15; ++k) {
    x[static_cast<size_t>(19 + k)] =
        2.0f * std::nextafter(level_mid(k), std::numeric_limits<float>::infinity());
  }
  // Each level itself, times absmax.
  for (int k = 0; k < 16; ++k) x[static_cast<size_t>(34 + k)] = 2.0f * nf4::levels()[k];
  x[50] = 0.03f;  // 0.015: between 0 and mid(7) = 0.0397901..., -> 7
  x[51] = 0.09f;  // 0.045 -> 8

  const std::vector<uint8_t> p = quantized(x);
  ASSERT_EQ(p.size(), 44u);
  EXPECT_EQ(code_of(p, 64, 0), 15);
  EXPECT_EQ(code_of(p, 64, 1), 0);
  EXPECT_EQ(p[9], 0xF0);  // the first element in the high nibble
  EXPECT_EQ(code_of(p, 64, 2), 7);
  EXPECT_EQ(code_of(p, 64, 3), 7);
  EXPECT_EQ(p[10], 0x77);
  for (int k = 0; k < 15; ++k) {
    EXPECT_EQ(code_of(p, 64, 4 + k), k) << "on the midpoint " << k << "|" << k + 1;
    EXPECT_EQ(code_of(p, 64, 19 + k), k + 1) << "just above the midpoint " << k << "|" << k + 1;
  }
  for (int k = 0; k < 16; ++k) EXPECT_EQ(code_of(p, 64, 34 + k), k);
  EXPECT_EQ(code_of(p, 64, 50), 7);
  EXPECT_EQ(code_of(p, 64, 51), 8);
  for (int64_t i = 52; i < 64; ++i) EXPECT_EQ(code_of(p, 64, i), 7);
  // The midpoint between 0 and the first positive level, literally.
  EXPECT_EQ(level_mid(7), 0.03979014977812767f);
  // Second level of one block: offset = absmax = 2, s = max |2 - 2| = 0, code of 0 -> 127.
  EXPECT_EQ(f32_at(p, 4), 2.0f);
  EXPECT_EQ(f32_at(p, 0), 0.0f);
  EXPECT_EQ(p[8], 127);
  EXPECT_EQ(p[41], 0);  // padding
  EXPECT_EQ(p[42], 0);
  EXPECT_EQ(p[43], 0);
  // Dequantised: levels times 0 * 0 + 2, exactly.
  const std::vector<float> y = dequantized(p, 64);
  for (int64_t i = 0; i < 64; ++i)
    EXPECT_EQ(y[static_cast<size_t>(i)], 2.0f * nf4::levels()[code_of(p, 64, i)]) << i;
  EXPECT_EQ(y[0], 2.0f);
  EXPECT_EQ(y[1], -2.0f);
  for (int k = 0; k < 16; ++k) EXPECT_EQ(y[static_cast<size_t>(34 + k)], x[static_cast<size_t>(34 + k)]);
}

TEST(Nf4, ZeroBlocksAndSecondLevelByHand) {
  // Blocks with absmax 1, 3 and 0: offset 4 / 3; centred -1/3, 5/3, -4/3; s = 5/3.
  std::vector<float> x(192, 0.0f);
  x[5] = -1.0f;
  x[64 + 9] = 3.0f;
  x[64 + 10] = 1.5f;  // scaled 0.5
  const std::vector<uint8_t> p = quantized(x);
  const nf4::Layout l = nf4::layout(192);
  for (int64_t i = 128; i < 192; ++i) EXPECT_EQ(code_of(p, 192, i), 7) << i;  // zero block
  EXPECT_EQ(code_of(p, 192, 5), 0);
  EXPECT_EQ(code_of(p, 192, 4), 7);
  EXPECT_EQ(code_of(p, 192, 64 + 9), 15);
  // 0.5 lies between mid(12) = 0.50166 (above) and mid(11) = 0.38931: level 12.
  EXPECT_EQ(code_of(p, 192, 64 + 10), 12);
  const auto offset = static_cast<float>((1.0 + 3.0 + 0.0) / 3.0);
  EXPECT_EQ(bits(f32_at(p, l.offset_at)), bits(offset));
  const float s = 3.0f - offset;
  EXPECT_EQ(bits(f32_at(p, l.scales_at)), bits(s));
  // The block of absmax 3 is the group's max: code of 1 is 255 (1.0).
  EXPECT_EQ(p[static_cast<size_t>(l.codes_at + 1)], 255);
  // The other two by bucketize on the map's midpoints.
  const auto& map = nf4::dynamic_map();
  for (int b : {0, 2}) {
    const float v = ((b == 0 ? 1.0f : 0.0f) - offset) * (1.0f / s);
    const int c = p[static_cast<size_t>(l.codes_at + b)];
    EXPECT_LE(map[c > 0 ? c - 1 : 0], v) << b;
    EXPECT_GE(map[c < 255 ? c + 1 : 255], v) << b;
    EXPECT_LE(std::fabs(map[c] - v), std::fabs(map[c > 0 ? c - 1 : c] - v)) << b;
    EXPECT_LE(std::fabs(map[c] - v), std::fabs(map[c < 255 ? c + 1 : c] - v)) << b;
  }
  const std::vector<float> y = dequantized(p, 192);
  for (int64_t i = 128; i < 192; ++i) EXPECT_EQ(y[static_cast<size_t>(i)], 0.0f);
  EXPECT_EQ(y[64 + 9], 1.0f * s + offset);  // exactly DYN[255] * s + offset = 3 up to rounding
  EXPECT_NEAR(y[64 + 9], 3.0f, 1e-6);
}

// Every element within half the widest NF4 gap of its block's absmax, plus the
// second level's error on the absmax (half the widest dynamic-map gap times s).
TEST(Nf4, RoundTripErrorBound) {
  for (auto [n, sigma, seed] : {std::tuple{int64_t{64 * 300}, 1.0f, 1u},
                                std::tuple{int64_t{64 * 1031}, 0.02f, 2u}}) {
    std::vector<float> x = normal(n, seed, sigma);
    x[100] = 40.0f * sigma;  // an outlier: its block's absmax far above the others
    const std::vector<uint8_t> p = quantized(x);
    const std::vector<float> y = dequantized(p, n);
    const nf4::Layout l = nf4::layout(n);
    float level_gap = 0, map_gap = 0;
    for (int k = 0; k < 15; ++k)
      level_gap = std::max(level_gap, nf4::levels()[k + 1] - nf4::levels()[k]);
    for (int k = 0; k < 255; ++k)
      map_gap = std::max(map_gap, nf4::dynamic_map()[k + 1] - nf4::dynamic_map()[k]);
    double err = 0, norm = 0;
    for (int64_t b = 0; b < l.blocks; ++b) {
      float absmax = 0;
      for (int64_t i = b * 64; i < (b + 1) * 64; ++i)
        absmax = std::max(absmax, std::fabs(x[static_cast<size_t>(i)]));
      const float s = f32_at(p, l.scales_at + 4 * (b / 256));
      const double bound = absmax * level_gap / 2 * (1 + 1e-6) + s * map_gap / 2 * 1.0001 + 1e-30;
      for (int64_t i = b * 64; i < (b + 1) * 64; ++i) {
        const double d = y[static_cast<size_t>(i)] - x[static_cast<size_t>(i)];
        ASSERT_LE(std::fabs(d), bound) << "n=" << n << " i=" << i;
        err += d * d;
        norm += static_cast<double>(x[static_cast<size_t>(i)]) * x[static_cast<size_t>(i)];
      }
    }
    // NF4 on normal data: a normalised mean squared error near 0.01.
    EXPECT_LT(err / norm, 0.015) << "n=" << n;
    EXPECT_GT(err / norm, 0.003) << "n=" << n;
  }
}

// The dequantised values quantise to the same level-1 codes (each block's
// absmax element dequantises to +-its absmax, every other to a level times it).
TEST(Nf4, RequantisingKeepsTheLevelCodes) {
  std::vector<float> x = normal(64 * 513, 3);
  std::fill(x.begin() + 640, x.begin() + 704, 0.0f);  // a zero block
  x[7] = 1e4f;
  const int64_t n = static_cast<int64_t>(x.size());
  const std::vector<uint8_t> p = quantized(x);
  const std::vector<uint8_t> again = quantized(dequantized(p, n));
  const nf4::Layout l = nf4::layout(n);
  EXPECT_TRUE(std::equal(p.begin() + l.packed_at, p.begin() + l.packed_at + n / 2,
                         again.begin() + l.packed_at));
}

// ---- the backend op

struct OpOutputs {
  std::vector<float> f32;
  std::vector<bf16> bf;
  std::vector<f16> half;
};

OpOutputs run_backend(const std::vector<uint8_t>& packed, int64_t n) {
  MemoryTracker tracker;
  std::unique_ptr<Backend> cpu = make_backend("cpu", 2, tracker);
  // The packed bytes (a multiple of 4) in an i32 tensor.
  Tensor in = cpu->allocate({static_cast<int64_t>(packed.size() / 4)}, DType::i32,
                            MemCategory::workspace);
  cpu->copy_from_host(packed.data(), in);
  OpOutputs out;
  out.f32.resize(static_cast<size_t>(n));
  out.bf.resize(static_cast<size_t>(n));
  out.half.resize(static_cast<size_t>(n));
  for (DType to : {DType::f32, DType::bf16, DType::f16}) {
    Tensor y = cpu->allocate({n}, to, MemCategory::workspace);
    cpu->dequantize_nf4(in.raw(), n, to, y.raw());
    cpu->synchronize();
    void* host = to == DType::f32    ? static_cast<void*>(out.f32.data())
                 : to == DType::bf16 ? static_cast<void*>(out.bf.data())
                                     : static_cast<void*>(out.half.data());
    cpu->copy_to_host(y, host);
  }
  return out;
}

TEST(Nf4Backend, CpuDequantizeEqualsTheReferenceBitForBit) {
  for (int64_t n : {int64_t{64}, int64_t{64 * 257}, int64_t{64 * 4099}}) {
    std::vector<float> x = normal(n, static_cast<uint32_t>(n), 0.02f);
    x[3] = 5.0f;
    const std::vector<uint8_t> p = quantized(x);
    const std::vector<float> want = dequantized(p, n);
    const OpOutputs got = run_backend(p, n);
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_EQ(bits(got.f32[i]), bits(want[i])) << "f32 n=" << n << " i=" << i;
      ASSERT_EQ(got.bf[i].bits, float_to_bf16(want[i]).bits) << "bf16 n=" << n << " i=" << i;
      ASSERT_EQ(got.half[i].bits, float_to_f16(want[i]).bits) << "f16 n=" << n << " i=" << i;
    }
  }
}

// A slice (nf4::Form::slice) holds the whole tensor's values at its blocks bit
// for bit, through nf4::dequantize and the CPU kernel, though no slice holds
// the whole tensor's offset or second-level scales: here the right half of
// every row of a [12, 512] weight (a row-parallel cut over two ranks), whose
// blocks come from two second-level groups.
TEST(Nf4Backend, SliceHoldsTheWholeTensorsValues) {
  const int64_t rows = 12, cols = 512, n = rows * cols;
  std::vector<float> x = normal(n, 7, 0.02f);
  x[100] = 3.0f;
  const std::vector<uint8_t> whole = quantized(x);
  const std::vector<float> all = dequantized(whole, n);
  std::vector<int64_t> blocks;
  std::vector<float> want;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < cols / 2 / nf4::kBlock; ++b) {
      blocks.push_back((r * cols + cols / 2) / nf4::kBlock + b);
    }
    want.insert(want.end(), all.begin() + r * cols + cols / 2, all.begin() + (r + 1) * cols);
  }
  const int64_t m = static_cast<int64_t>(want.size());
  std::vector<uint8_t> sliced(static_cast<size_t>(nf4::layout(m, nf4::Form::slice).bytes));
  nf4::slice(whole, n, blocks, sliced);
  std::vector<float> got(static_cast<size_t>(m));
  nf4::dequantize(sliced, got, nf4::Form::slice);
  MemoryTracker tracker;
  std::unique_ptr<Backend> cpu = make_backend("cpu", 2, tracker);
  Tensor in = cpu->allocate({static_cast<int64_t>(sliced.size() / 4)}, DType::i32,
                            MemCategory::workspace);
  cpu->copy_from_host(sliced.data(), in);
  Tensor y = cpu->allocate({m}, DType::f32, MemCategory::workspace);
  cpu->dequantize_nf4(in.raw(), m, DType::f32, y.raw(), nf4::Form::slice);
  cpu->synchronize();
  std::vector<float> kernel(static_cast<size_t>(m));
  cpu->copy_to_host(y, kernel.data());
  for (int64_t i = 0; i < m; ++i) {
    ASSERT_EQ(bits(got[static_cast<size_t>(i)]), bits(want[static_cast<size_t>(i)])) << i;
    ASSERT_EQ(bits(kernel[static_cast<size_t>(i)]), bits(want[static_cast<size_t>(i)])) << i;
  }
  // 4 bytes of absmax and 32 of codes per block.
  EXPECT_EQ(nf4::layout(m, nf4::Form::slice).bytes, m / nf4::kBlock * 36);
}

TEST(Nf4Backend, RejectsSizesThatAreNotWholeBlocks) {
  MemoryTracker tracker;
  std::unique_ptr<Backend> cpu = make_backend("cpu", 1, tracker);
  std::vector<uint8_t> p(64, 0);
  std::vector<float> y(96);
  EXPECT_THROW(cpu->dequantize_nf4(p.data(), 96, DType::f32, y.data()), Error);
}

// ---- against the Python reference (and bitsandbytes)

struct Case {
  std::string name;
  std::vector<float> x;
};

std::vector<Case> reference_cases() {
  std::vector<Case> cases;
  cases.push_back({"normal_64", normal(64, 11)});
  cases.push_back({"normal_one_group", normal(64 * 256, 12)});
  cases.push_back({"normal_257_blocks", normal(64 * 257, 13)});  // a second group of one block
  cases.push_back({"normal_partial_group", normal(64 * 1563, 14)});  // 7 groups, the last of 27
  {
    std::vector<float> x = normal(64 * 600, 15);
    std::mt19937 gen(16);
    std::uniform_int_distribution<size_t> at(0, x.size() - 1);
    for (int k = 0; k < 40; ++k) x[at(gen)] *= 300.0f;
    x[64 * 77 + 5] = 1e6f;
    x[64 * 300 + 1] = -3e5f;
    cases.push_back({"outliers", std::move(x)});
  }
  {
    std::vector<float> x = normal(64 * 300, 17);
    std::fill(x.begin() + 64 * 41, x.begin() + 64 * 42, 0.0f);
    std::fill(x.begin() + 64 * 299, x.end(), 0.0f);
    cases.push_back({"zero_blocks", std::move(x)});
  }
  cases.push_back({"all_zero", std::vector<float>(128, 0.0f)});
  {
    // Every block: +-2^e at one place, then each level midpoint times 2^e exactly and the
    // f32 values either side of it, so bucketize's ties decide.
    std::vector<float> x(64 * 40, 0.0f);
    for (int64_t b = 0; b < 40; ++b) {
      const float scale = std::ldexp(1.0f, static_cast<int>(b % 9) - 4);
      float* block = x.data() + b * 64;
      block[b % 64] = b % 2 == 0 ? scale : -scale;
      int64_t i = 0;
      for (int k = 0; k < 15; ++k) {  // 45 values besides the absmax
        const float m = level_mid(k);
        for (float v : {m, std::nextafter(m, -2.0f), std::nextafter(m, 2.0f)}) {
          if (i == b % 64) ++i;
          block[i++] = v * scale;
        }
      }
    }
    cases.push_back({"midpoints", std::move(x)});
  }
  {
    // Constant absmax: every block's largest is 1.5, so s = 0 in every group.
    std::vector<float> x = normal(64 * 300, 18, 0.3f);
    for (int64_t b = 0; b < 300; ++b) {
      for (int64_t i = b * 64; i < (b + 1) * 64; ++i)
        x[static_cast<size_t>(i)] = std::clamp(x[static_cast<size_t>(i)], -1.0f, 1.0f);
      x[static_cast<size_t>(b * 64 + b % 64)] = 1.5f;
    }
    cases.push_back({"constant_absmax", std::move(x)});
  }
  cases.push_back({"weights_0.02", normal(512 * 512, 19, 0.02f)});  // 16 groups
  return cases;
}

template <typename T>
void write_file(const fs::path& path, const std::vector<T>& v) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(v.size() * sizeof(T)));
  ASSERT_TRUE(f.good()) << path;
}

int run(const std::string& command) {
  const int status = std::system(command.c_str());
  return status != -1 && WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::string quote(const std::string& s) { return "'" + s + "'"; }

TEST(Nf4Reference, MatchesPythonDefinition) {
  const char* bnb_python = std::getenv("MESHTRAIN_NF4_BNB_PYTHON");
  const bool with_bnb = bnb_python != nullptr && *bnb_python != '\0';
  const std::string python = with_bnb ? bnb_python : "/usr/bin/python3";
  if (run(quote(python) + " -c 'import torch, numpy' >/dev/null 2>&1") != 0) {
    if (with_bnb) {  // ctest's tensor.nf4_bitsandbytes: a skip (SKIP_RETURN_CODE 77)
      std::printf("SKIPPED: %s cannot import torch and numpy\n", python.c_str());
      std::fflush(stdout);
      std::exit(77);
    }
    GTEST_SKIP() << python << " cannot import torch and numpy";
  }
  const fs::path dir = fs::temp_directory_path() /
                       ("meshtrain_nf4_" + std::to_string(::getpid()) + (with_bnb ? "_bnb" : ""));
  fs::remove_all(dir);
  fs::create_directories(dir);
  write_file(dir / "levels.f32", std::vector<float>(nf4::levels().begin(), nf4::levels().end()));
  write_file(dir / "dynamic_map.f32",
             std::vector<float>(nf4::dynamic_map().begin(), nf4::dynamic_map().end()));
  std::string index = "{\"levels\": \"levels.f32\", \"dynamic_map\": \"dynamic_map.f32\", \"cases\": [";
  const std::vector<Case> cases = reference_cases();
  for (size_t c = 0; c < cases.size(); ++c) {
    const Case& k = cases[c];
    const auto n = static_cast<int64_t>(k.x.size());
    const std::vector<uint8_t> p = quantized(k.x);
    const OpOutputs op = run_backend(p, n);
    write_file(dir / (k.name + ".x.f32"), k.x);
    write_file(dir / (k.name + ".packed.u8"), p);
    write_file(dir / (k.name + ".deq.f32"), dequantized(p, n));
    write_file(dir / (k.name + ".op.f32"), op.f32);
    write_file(dir / (k.name + ".op.bf16"), op.bf);
    write_file(dir / (k.name + ".op.f16"), op.half);
    index += (c > 0 ? ", " : "") + std::string("{\"name\": \"") + k.name +
             "\", \"n\": " + std::to_string(n) + ", \"x\": \"" + k.name +
             ".x.f32\", \"packed\": \"" + k.name + ".packed.u8\", \"deq\": \"" + k.name +
             ".deq.f32\", \"op_f32\": \"" + k.name + ".op.f32\", \"op_bf16\": \"" + k.name +
             ".op.bf16\", \"op_f16\": \"" + k.name + ".op.f16\"}";
  }
  index += "]}\n";
  {
    std::ofstream f(dir / "index.json");
    f << index;
    ASSERT_TRUE(f.good());
  }
  std::string command = quote(python) + " " +
                        quote(std::string(MESHTRAIN_SOURCE_DIR) + "/tests/tensor/nf4_reference.py") +
                        " " + quote(dir.string());
  if (with_bnb) command += " --bitsandbytes";
  std::fflush(stdout);
  const int rc = run(command);
  if (with_bnb && rc == 77) {  // bitsandbytes not importable: a ctest skip
    fs::remove_all(dir);
    std::fflush(stdout);
    std::exit(77);
  }
  ASSERT_EQ(rc, 0) << command << " (the cases are left in " << dir << ")";
  fs::remove_all(dir);
}

}  // namespace
}  // namespace meshtrain
