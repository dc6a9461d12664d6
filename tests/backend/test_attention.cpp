// RoPE and causal GQA attention: forward against float64 loops, backward
// against finite differences, decoding through the KV cache against the
// full forward.
#include <cstring>
#include <type_traits>

#include "meshtrain/backend/cpu/attention.h"
#include "meshtrain/util/error.h"
#include "reference.h"

namespace meshtrain::testing {
namespace {

using cpu::AttentionDims;
constexpr double kTheta = 10000.0;

// Rotates pairs of one head (float64), position p.
void rotate_ref(double* x, int64_t D, int64_t p) {
  for (int64_t i = 0; i < D / 2; ++i) {
    const double a = static_cast<double>(p) * std::pow(kTheta, -2.0 * static_cast<double>(i) / D);
    const double x0 = x[2 * i], x1 = x[2 * i + 1];
    x[2 * i] = x0 * std::cos(a) - x1 * std::sin(a);
    x[2 * i + 1] = x0 * std::sin(a) + x1 * std::cos(a);
  }
}

// d.positions (packed records): query t sees keys [t - pos, t], rotated by pos.
std::vector<double> attention_ref(std::vector<double> qkv, const AttentionDims& d, bool rope) {
  const int64_t B = d.batch, T = d.seq, H = d.n_heads, KV = d.n_kv_heads, D = d.head_dim;
  const int64_t W = d.qkv_width(), rep = H / KV;
  auto pos = [&](int64_t b, int64_t t) -> int64_t { return d.positions ? d.positions[b * T + t] : t; };
  if (rope)
    for (int64_t bt = 0; bt < B * T; ++bt)
      for (int64_t h = 0; h < H + KV; ++h) rotate_ref(&qkv[bt * W + h * D], D, pos(bt / T, bt % T));
  std::vector<double> out(B * T * H * D, 0.0), p(T);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t) {
        const double* q = &qkv[(b * T + t) * W + h * D];
        double mx = -1e300, sum = 0;
        const int64_t first = t - pos(b, t);
        for (int64_t s = first; s <= t; ++s) {
          const double* k = &qkv[(b * T + s) * W + (H + h / rep) * D];
          double dot = 0;
          for (int64_t i = 0; i < D; ++i) dot += q[i] * k[i];
          p[s] = dot / std::sqrt(static_cast<double>(D));
          mx = std::max(mx, p[s]);
        }
        for (int64_t s = first; s <= t; ++s) sum += (p[s] = std::exp(p[s] - mx));
        for (int64_t s = first; s <= t; ++s) {
          const double* v = &qkv[(b * T + s) * W + (H + KV + h / rep) * D];
          for (int64_t i = 0; i < D; ++i) out[((b * T + t) * H + h) * D + i] += p[s] / sum * v[i];
        }
      }
  return out;
}

struct AttnCase {
  AttentionDims dims;
  bool rope;
};

class Attention : public ::testing::TestWithParam<AttnCase> {};

// What both precisions' tests share: a context, the rope table (or none) and the sizes.
struct AttnSetup {
  explicit AttnSetup(const AttnCase& c)
      : d(c.dims),
        use_rope(c.rope),
        table(cpu::make_rope_table(d.head_dim, 16, static_cast<float>(kTheta), tracker)) {}
  const cpu::RopeTable* rope() const { return use_rope ? &table : nullptr; }
  std::vector<double> reference(const std::vector<double>& qkv) const {
    return attention_ref(qkv, d, use_rope);
  }
  // d(sum(dout * out))/d(qkv) by finite differences of the float64 reference.
  std::vector<double> gradient(const std::vector<float>& qkv, const std::vector<float>& dout) const {
    return finite_difference([&](const auto& v) { return weighted_sum(reference(v), dout); },
                             to_double(qkv));
  }

  AttentionDims d;
  bool use_rope;
  MemoryTracker tracker;
  cpu::CpuContext ctx{0, tracker};
  cpu::RopeTable table;
  int64_t n_qkv = d.batch * d.seq * d.qkv_width(), n_out = d.batch * d.seq * d.n_heads * d.head_dim;
};

std::vector<float> as_f32(const std::vector<float>& v) { return v; }
std::vector<float> as_f32(const std::vector<bf16>& v) { return from_bf16(v); }
std::vector<float> as_f32(const std::vector<f16>& v) { return from_f16(v); }

template <typename E>
constexpr DType dtype_of() {
  if constexpr (std::is_same_v<E, bf16>) return DType::bf16;
  if constexpr (std::is_same_v<E, f16>) return DType::f16;
  return DType::f32;
}

// Forward against the float64 reference, backward against its finite
// differences, in compute dtype E (tolerances: out, then d_qkv).
template <typename E>
void check_attention(const AttnCase& c, uint32_t seed, double rel_out, double abs_out, double rel_grad,
                     double abs_grad) {
  AttnSetup t(c);
  const DType dt = dtype_of<E>();
  auto qkv = random_floats(t.n_qkv, seed, -1.5, 1.5);
  std::vector<E> out(t.n_out);
  cpu::AttentionSaved saved;
  cpu::attention_forward(t.ctx, t.d, t.rope(), dt, qkv.data(), out.data(), saved);
  expect_close(as_f32(out), t.reference(to_double(qkv)), rel_out, abs_out, "out");
  EXPECT_GT(t.tracker.live(MemCategory::activations), 0u);

  auto dout = random_floats(t.n_out, seed + 1);
  std::vector<E> dqkv(t.n_qkv);  // poisoned: the kernel must overwrite every element
  const std::vector<float> poison(dqkv.size(), 99.0f);
  convert(DType::f32, poison.data(), dt, dqkv.data(), dqkv.size());
  cpu::attention_backward(t.ctx, t.d, t.rope(), dt, saved, dout.data(), dqkv.data());
  expect_close(as_f32(dqkv), t.gradient(qkv, dout), rel_grad, abs_grad, "d_qkv");
}

TEST_P(Attention, ForwardAndGradientCheckF32) {
  check_attention<float>(GetParam(), 80, 1e-5, 1e-6, 1e-4, 1e-5);
}

TEST_P(Attention, Bf16MatchesReferenceLoosely) {
  check_attention<bf16>(GetParam(), 90, 2e-2, 1e-2, 3e-2, 2e-2);
}

// f16 keeps 3 more mantissa bits than bf16 (its GEMMs run on the operands
// widened to f32): 8x tighter tolerances than bf16's.
TEST_P(Attention, F16MatchesReference) {
  check_attention<f16>(GetParam(), 90, 3e-3, 1.5e-3, 4e-3, 3e-3);
}

// recompute_probs (selective activation checkpointing): no probabilities kept,
// the same out and d_qkv bit for bit, in both compute dtypes.
template <typename E>
void check_recomputed_probs(const AttnCase& c) {
  AttnSetup t(c);
  const DType dt = dtype_of<E>();
  const auto qkv = random_floats(t.n_qkv, 70, -1.5, 1.5);
  const auto dout = random_floats(t.n_out, 71);
  std::vector<E> out[2], dqkv[2];
  for (int recompute = 0; recompute < 2; ++recompute) {
    cpu::AttentionSaved saved;
    saved.recompute_probs = recompute == 1;
    out[recompute].resize(t.n_out);
    dqkv[recompute].resize(t.n_qkv);
    cpu::attention_forward(t.ctx, t.d, t.rope(), dt, qkv.data(), out[recompute].data(), saved);
    EXPECT_EQ(saved.probs.defined(), recompute == 0);
    cpu::attention_backward(t.ctx, t.d, t.rope(), dt, saved, dout.data(), dqkv[recompute].data());
  }
  EXPECT_EQ(0, std::memcmp(out[0].data(), out[1].data(), out[0].size() * sizeof(E)));
  EXPECT_EQ(0, std::memcmp(dqkv[0].data(), dqkv[1].data(), dqkv[0].size() * sizeof(E)));
}

TEST_P(Attention, RecomputedProbabilitiesGiveIdenticalGradients) {
  check_recomputed_probs<float>(GetParam());
  check_recomputed_probs<bf16>(GetParam());
  check_recomputed_probs<f16>(GetParam());
}

// Packed records: the segment mask (causal AND same record) and per-record
// RoPE positions against the float64 reference, gradients against its finite
// differences; a record packed after another gives the outputs it gives alone.
TEST(PackedAttention, SegmentMaskAndPositionsMatchReference) {
  // Two rows of 11: records of 4, 5 and 2 tokens; 7 and 4.
  const std::vector<int32_t> positions = {0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1,
                                          0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3};
  for (bool rope : {false, true}) {
    SCOPED_TRACE(rope);
    AttentionDims d{2, 11, 4, 2, 8};
    d.positions = positions.data();
    const AttnCase c{d, rope};
    check_attention<float>(c, 300, 1e-5, 1e-6, 1e-4, 1e-5);
    check_attention<bf16>(c, 310, 2e-2, 1e-2, 3e-2, 2e-2);
    check_recomputed_probs<float>(c);
    check_recomputed_probs<bf16>(c);
  }
  // The third record of row 0 (tokens 9, 10) alone as a row of 2.
  AttnSetup packed(AttnCase{AttentionDims{1, 11, 4, 2, 8, positions.data()}, true});
  const auto qkv = random_floats(packed.n_qkv, 320, -1.5, 1.5);
  std::vector<float> out(packed.n_out);
  cpu::AttentionSaved saved;
  cpu::attention_forward(packed.ctx, packed.d, packed.rope(), DType::f32, qkv.data(), out.data(), saved);
  const int64_t W = packed.d.qkv_width(), HD = 4 * 8;
  AttnSetup alone(AttnCase{AttentionDims{1, 2, 4, 2, 8}, true});
  std::vector<float> alone_qkv(qkv.begin() + 9 * W, qkv.begin() + 11 * W), alone_out(alone.n_out);
  cpu::AttentionSaved saved_alone;
  cpu::attention_forward(alone.ctx, alone.d, alone.rope(), DType::f32, alone_qkv.data(),
                         alone_out.data(), saved_alone);
  for (int64_t i = 0; i < 2 * HD; ++i) EXPECT_NEAR(out[9 * HD + i], alone_out[i], 1e-6) << i;
  // Positions that do not restart at 0 or skip are refused.
  std::vector<int32_t> bad = positions;
  bad[5] = 3;
  AttentionDims wrong{2, 11, 4, 2, 8, bad.data()};
  EXPECT_THROW(cpu::attention_forward(packed.ctx, wrong, nullptr, DType::f32, qkv.data(), out.data(), saved),
               Error);
}

TEST_P(Attention, DecodingThroughTheCacheEqualsTheFullForward) {
  AttnSetup t(GetParam());
  const AttentionDims& d = t.d;
  MemoryTracker& tracker = t.tracker;
  cpu::CpuContext& ctx = t.ctx;
  const cpu::RopeTable* rope = t.rope();
  const int64_t B = d.batch, T = d.seq, W = d.qkv_width(), HD = d.n_heads * d.head_dim;
  auto qkv = random_floats(B * T * W, 100, -1.5, 1.5);
  std::vector<float> full(B * T * HD);
  cpu::AttentionSaved saved;
  cpu::attention_forward(ctx, d, rope, DType::f32, qkv.data(), full.data(), saved);

  cpu::KVCacheLayer cache;
  cache.k = Tensor({B, d.n_kv_heads, 12, d.head_dim}, DType::f32, MemCategory::activations, tracker);
  cache.v = Tensor({B, d.n_kv_heads, 12, d.head_dim}, DType::f32, MemCategory::activations, tracker);
  std::vector<float> got(B * T * HD);
  // A prompt of 2 tokens, then one token at a time.
  for (int64_t pos = 0; pos < T;) {
    const int64_t n = pos == 0 ? 2 : 1;
    AttentionDims step = d;
    step.seq = n;
    std::vector<float> in(B * n * W), out(B * n * HD);
    for (int64_t b = 0; b < B; ++b)
      std::copy_n(&qkv[(b * T + pos) * W], n * W, &in[b * n * W]);
    cpu::attention_decode(ctx, step, rope, in.data(), pos, cache, out.data());
    for (int64_t b = 0; b < B; ++b) std::copy_n(&out[b * n * HD], n * HD, &got[(b * T + pos) * HD]);
    pos += n;
  }
  std::vector<double> want(full.begin(), full.end());
  expect_close(got, want, 1e-5, 1e-6, "decoded");
}

INSTANTIATE_TEST_SUITE_P(Shapes, Attention,
                         ::testing::Values(AttnCase{{2, 5, 4, 2, 8}, true},   // GQA + RoPE
                                           AttnCase{{1, 6, 3, 3, 6}, false},  // MHA, no RoPE
                                           AttnCase{{2, 4, 4, 1, 4}, true},   // MQA
                                           AttnCase{{1, 5, 2, 1, 20}, true}));  // vector RoPE + tail

class Rope : public ::testing::TestWithParam<int64_t> {};

TEST_P(Rope, MatchesReferenceAndInverseIsTheTranspose) {
  const int64_t B = 2, T = 5, H = 3, D = GetParam(), pos0 = 2;
  MemoryTracker tracker;
  auto table = cpu::make_rope_table(D, 16, static_cast<float>(kTheta), tracker);
  auto x = random_floats(B * T * H * D, 110);
  auto ref = [&](std::vector<double> v, int64_t p0) {
    for (int64_t r = 0; r < B * T; ++r)
      for (int64_t h = 0; h < H; ++h) rotate_ref(&v[(r * H + h) * D], D, p0 + r % T);
    return v;
  };
  auto y = x;
  cpu::rope_apply(table, y.data(), B * T, T, H, D, pos0, false);
  expect_close(y, ref(to_double(x), pos0), 1e-5, 1e-6, "rotated");
  // Backward of a rotation: the inverse applied to dy equals the finite-difference gradient.
  auto dy = random_floats(x.size(), 111);
  auto dx = dy;
  cpu::rope_apply(table, dx.data(), B * T, T, H, D, pos0, true);
  auto g = finite_difference([&](const auto& v) { return weighted_sum(ref(v, pos0), dy); }, to_double(x));
  expect_close(dx, g, 1e-5, 1e-6, "dx");
  EXPECT_THROW(cpu::rope_apply(table, y.data(), B * T, T, H, D, 12, false), Error);
}

INSTANTIATE_TEST_SUITE_P(HeadDims, Rope, ::testing::Values(8, 20, 32));

}  // namespace
}  // namespace meshtrain::testing
