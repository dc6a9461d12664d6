// The CUDA backend's attention kernels (backend/cuda/attention.cu) run on the
// CPU through tests/cuda_emu/emu.h, against the CPU backend's ops on the same
// inputs: causal GQA with packed records, sliding windows, kept or recomputed
// probabilities; context parallelism's all-gather form and the ring, every
// rank of the group simulated; KV-cache decoding. Each test launches the
// kernels in the order CudaBackend does (cuda_backend.cpp), in f32 and bf16.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#define cuda cuda_emu
#include "meshtrain/backend/cuda/kernels.h"
#undef cuda

#include "meshtrain/backend/backend.h"
#include "meshtrain/backend/registry.h"
#include "meshtrain/tensor/dtype.h"
#include "meshtrain/util/context_split.h"

namespace meshtrain {
namespace {

namespace emu_cuda = meshtrain::cuda_emu;
using Vec = std::vector<float>;

// A buffer of n values of `dtype`, read back as floats.
struct Buffer {
  Buffer(DType d, int64_t n) : dtype(d), bytes(static_cast<size_t>(n) * dtype_size(d)) {}
  Buffer(DType d, const Vec& values) : Buffer(d, static_cast<int64_t>(values.size())) {
    for (size_t i = 0; i < values.size(); ++i) set(i, values[i]);
  }
  void* data() { return bytes.data(); }
  float* f32() { return reinterpret_cast<float*>(bytes.data()); }
  size_t size() const { return bytes.size() / dtype_size(dtype); }
  void set(size_t i, float x) {
    if (dtype == DType::f32) {
      std::memcpy(bytes.data() + 4 * i, &x, 4);
    } else {
      const bf16 b = float_to_bf16(x);
      std::memcpy(bytes.data() + 2 * i, &b, 2);
    }
  }
  Vec floats() const {
    Vec out(size());
    for (size_t i = 0; i < out.size(); ++i) {
      if (dtype == DType::f32) {
        std::memcpy(&out[i], bytes.data() + 4 * i, 4);
      } else {
        bf16 b;
        std::memcpy(&b, bytes.data() + 2 * i, 2);
        out[i] = bf16_to_float(b);
      }
    }
    return out;
  }
  DType dtype;
  std::vector<unsigned char> bytes;
};

emu_cuda::Elem elem(DType d) { return d == DType::f32 ? emu_cuda::Elem::f32 : emu_cuda::Elem::bf16; }

// The CPU backend, and its tensors to and from host vectors.
struct Cpu {
  Cpu() : backend(make_backend("cpu", 1, tracker)) {}
  Tensor put(DType d, const Vec& v) {
    Tensor t = backend->allocate({static_cast<int64_t>(v.size())}, d, MemCategory::workspace);
    const Buffer b(d, v);
    backend->copy_from_host(b.bytes.data(), t);
    return t;
  }
  Tensor ids(const std::vector<int32_t>& v) {
    Tensor t = backend->allocate({static_cast<int64_t>(v.size())}, DType::i32, MemCategory::workspace);
    backend->copy_from_host(v.data(), t);
    return t;
  }
  Tensor zeros(DType d, int64_t n) { return put(d, Vec(static_cast<size_t>(n), 0.0f)); }
  Vec get(const Tensor& t) {
    Buffer b(t.dtype(), t.numel());
    backend->copy_to_host(t, b.data());
    return b.floats();
  }
  MemoryTracker tracker;
  std::unique_ptr<Backend> backend;
};

Vec uniform(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  Vec v(static_cast<size_t>(n));
  for (float& x : v) x = u(rng);
  return v;
}

// Each token's position within its record: records of 1 to 4 tokens (packed)
// or one per row (the token's index).
std::vector<int32_t> positions_of(int64_t batch, int64_t seq, bool packed, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> pos(static_cast<size_t>(batch * seq));
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t t = 0; t < seq; ++t) {
      const size_t i = static_cast<size_t>(b * seq + t);
      pos[i] = !packed ? static_cast<int32_t>(t) : t == 0 || rng() % 4 == 0 ? 0 : pos[i - 1] + 1;
    }
  }
  return pos;
}

// sum (a - b)^2 / sum b^2 within tol.
void expect_close(const Vec& got, const Vec& want, double tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double err = 0, norm = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_FALSE(std::isnan(got[i])) << what << " [" << i << "] is NaN";
    err += (static_cast<double>(got[i]) - want[i]) * (static_cast<double>(got[i]) - want[i]);
    norm += static_cast<double>(want[i]) * want[i];
  }
  EXPECT_LE(err, tol * std::max(norm, 1e-30)) << what << ": normalised squared error "
                                              << err / std::max(norm, 1e-30);
}

double tolerance(DType d) { return d == DType::f32 ? 1e-10 : 1e-4; }

struct Shape {
  int64_t batch, seq, heads, kv, dim;
  bool rope, packed, recompute;
  int64_t window = 0;
};

std::string name_of(const Shape& s, DType d) {
  return fmt::format("b{} t{} h{} kv{} d{}{}{}{} window{} {}", s.batch, s.seq, s.heads, s.kv,
                     s.dim, s.rope ? "" : " no-rope", s.packed ? " packed" : "",
                     s.recompute ? " recompute" : "", s.window, dtype_name(d));
}

struct Rope {
  Rope(int64_t dim, int64_t max_seq) : inv_freq(ops::rope_inv_freq(dim, 10000.0f)) {
    cos.resize(static_cast<size_t>(max_seq * dim / 2));
    sin.resize(cos.size());
    ops::rope_table_values(dim, max_seq, inv_freq, cos.data(), sin.data());
  }
  std::vector<float> inv_freq;
  Vec cos, sin;
};

TEST(CudaEmu, AttentionForwardAndBackwardEqualTheCpuBackend) {
  const Shape shapes[] = {
      {1, 4, 1, 1, 2, true, false, false},       {2, 9, 4, 2, 8, true, false, false},
      {2, 12, 4, 1, 16, true, true, false},      {1, 16, 6, 3, 8, false, false, true},
      {2, 10, 4, 2, 8, true, true, true, 3},     {1, 300, 2, 1, 8, true, false, false},
  };
  for (const Shape& s : shapes) {
    for (DType dt : {DType::f32, DType::bf16}) {
      SCOPED_TRACE(name_of(s, dt));
      const ops::AttentionDims dims{s.batch, s.seq, s.heads, s.kv, s.dim, nullptr, s.window};
      const int64_t W = dims.qkv_width(), B = s.batch, T = s.seq, H = s.heads, D = s.dim;
      const Vec qkv = uniform(B * T * W, 1), dout = uniform(B * T * H * D, 2);
      const std::vector<int32_t> pos = positions_of(B, T, s.packed, 3);
      const Rope rope(D, T);

      Cpu cpu;
      ops::AttentionDims cdims = dims;
      const Tensor cpos = cpu.ids(pos);
      if (s.packed) cdims.positions = cpos.data<int32_t>();
      const ops::RopeTable table = cpu.backend->make_rope_table(D, T, rope.inv_freq);
      const Tensor cqkv = cpu.put(DType::f32, qkv), cout = cpu.zeros(dt, B * T * H * D);
      ops::AttentionSaved saved;
      saved.recompute_probs = s.recompute;
      cpu.backend->attention_forward(cdims, s.rope ? &table : nullptr, dt, cqkv.data<float>(),
                                     cout.raw(), saved);
      const Tensor cdout = cpu.put(DType::f32, dout), cdqkv = cpu.zeros(dt, B * T * W);
      cpu.backend->attention_backward(cdims, s.rope ? &table : nullptr, dt, saved,
                                      cdout.data<float>(), cdqkv.raw());

      // CudaBackend::attention_forward / attention_backward's launches.
      const emu_cuda::AttentionShape a{B, T, H, s.kv, D, s.window, s.packed ? pos.data() : nullptr,
                                       1.0f / std::sqrt(static_cast<float>(D))};
      const float* cos = s.rope ? rope.cos.data() : nullptr;
      const float* sin = s.rope ? rope.sin.data() : nullptr;
      Buffer q(dt, B * H * T * D), k(dt, B * s.kv * T * D), v(dt, B * s.kv * T * D);
      Buffer probs(dt, s.recompute ? 0 : B * H * T * T), out(dt, B * T * H * D);
      emu_cuda::launch_attention_split(nullptr, a, qkv.data(), cos, sin, elem(dt), q.data(),
                                       k.data(), v.data());
      emu_cuda::launch_attention_forward(nullptr, a, elem(dt), q.data(), k.data(), v.data(),
                                         s.recompute ? nullptr : probs.data(), out.data());
      Buffer p_work(DType::f32, B * H * T * T), ds(DType::f32, B * H * T * T);
      Buffer dq(DType::f32, B * H * T * D), dk(DType::f32, B * s.kv * T * D),
          dv(DType::f32, B * s.kv * T * D), dqkv(dt, B * T * W);
      emu_cuda::launch_attention_backward(nullptr, a, elem(dt), q.data(), k.data(), v.data(),
                                          s.recompute ? nullptr : probs.data(),
                                          s.recompute ? p_work.f32() : nullptr, dout.data(),
                                          ds.f32(), dq.f32(), dk.f32(), dv.f32());
      emu_cuda::launch_attention_merge(nullptr, a, dq.f32(), dk.f32(), dv.f32(), cos, sin,
                                       elem(dt), dqkv.data());
      expect_close(out.floats(), cpu.get(cout), tolerance(dt), "out");
      expect_close(dqkv.floats(), cpu.get(cdqkv), tolerance(dt), "d_qkv");
    }
  }
}

// A context-parallel group of `cp` ranks on one sequence: rank r's rows of a
// [batch, seq, width] tensor.
Vec cut(const Vec& whole, int64_t batch, int64_t seq, int64_t width, ContextSplit split) {
  const int64_t L = split.local(seq);
  Vec out(static_cast<size_t>(batch * L * width));
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t i = 0; i < L; ++i)
      std::copy_n(whole.begin() + (b * seq + split.global(seq, i)) * width, width,
                  out.begin() + (b * L + i) * width);
  return out;
}
std::vector<int32_t> cut_ids(const std::vector<int32_t>& whole, int64_t batch, int64_t seq,
                             ContextSplit split) {
  Vec f(whole.begin(), whole.end());
  const Vec part = cut(f, batch, seq, 1, split);
  return std::vector<int32_t>(part.begin(), part.end());
}

struct ContextCase {
  Shape s;
  int64_t cp;
};

const ContextCase kContextCases[] = {
    {{1, 4, 1, 1, 2, true, false, false}, 2},   {{2, 16, 4, 2, 8, true, false, false}, 2},
    {{2, 24, 4, 1, 16, true, true, true}, 3},   {{1, 32, 6, 3, 8, false, false, false}, 4},
    {{2, 40, 4, 2, 16, true, true, false}, 2},
};

TEST(CudaEmu, ContextAttentionAllGatherEqualsTheCpuBackend) {
  for (const ContextCase& c : kContextCases) {
    const Shape& s = c.s;
    for (DType dt : {DType::f32, DType::bf16}) {
      SCOPED_TRACE(fmt::format("{} cp{}", name_of(s, dt), c.cp));
      const ops::AttentionDims whole{s.batch, s.seq, s.heads, s.kv, s.dim, nullptr};
      const int64_t W = whole.qkv_width(), B = s.batch, T = s.seq, H = s.heads, D = s.dim;
      const int64_t L = T / c.cp, KV = s.kv;
      const Vec qkv = uniform(B * T * W, 4), dout = uniform(B * T * H * D, 5);
      const std::vector<int32_t> pos = positions_of(B, T, s.packed, 6);
      const Rope rope(D, T);
      const float* cos = s.rope ? rope.cos.data() : nullptr;
      const float* sin = s.rope ? rope.sin.data() : nullptr;
      Cpu cpu;
      const ops::RopeTable table = cpu.backend->make_rope_table(D, T, rope.inv_freq);
      const ops::RopeTable* ctable = s.rope ? &table : nullptr;

      std::vector<ops::ContextDims> dims;
      std::vector<Tensor> cpos;
      std::vector<std::vector<int32_t>> rank_pos;
      std::vector<ops::AttentionSaved> saved(static_cast<size_t>(c.cp));
      std::vector<Buffer> q;  // the emulated side's saved q per rank
      Vec kv_all_cpu;
      Buffer kv_all(dt, c.cp * 2 * B * KV * L * D);
      for (int64_t r = 0; r < c.cp; ++r) {
        const ContextSplit split{r, c.cp};
        rank_pos.push_back(cut_ids(pos, B, T, split));
        cpos.push_back(cpu.ids(rank_pos.back()));
        dims.push_back(ops::ContextDims{B, L, H, KV, D, split, cpos.back().data<int32_t>()});
        const Vec mine = cut(qkv, B, T, W, split);
        saved[static_cast<size_t>(r)].recompute_probs = s.recompute;
        const Tensor cq = cpu.put(DType::f32, mine), send = cpu.zeros(dt, dims.back().kv_block());
        cpu.backend->context_attention_project(dims.back(), ctable, dt, cq.data<float>(),
                                               saved[static_cast<size_t>(r)], send.raw());
        const Vec sent = cpu.get(send);
        kv_all_cpu.insert(kv_all_cpu.end(), sent.begin(), sent.end());
        // CudaBackend::context_attention_project: the split on the rank's own tokens.
        const emu_cuda::AttentionShape local{B, L, H, KV, D, 0, rank_pos.back().data(), 1.0f};
        q.emplace_back(dt, B * H * L * D);
        char* block = reinterpret_cast<char*>(kv_all.data()) +
                      r * dims.back().kv_block() * static_cast<int64_t>(dtype_size(dt));
        emu_cuda::launch_attention_split(nullptr, local, mine.data(), cos, sin, elem(dt),
                                         q.back().data(), block,
                                         block + B * KV * L * D * static_cast<int64_t>(dtype_size(dt)));
      }
      expect_close(kv_all.floats(), kv_all_cpu, tolerance(dt), "kv_send");
      const Tensor call = cpu.put(dt, kv_all_cpu);
      Vec dkv_sum_cpu(kv_all_cpu.size(), 0.0f), dkv_sum(kv_all_cpu.size(), 0.0f);
      std::vector<Tensor> cdqkv;
      std::vector<Buffer> dqkv;
      for (int64_t r = 0; r < c.cp; ++r) {
        const auto ur = static_cast<size_t>(r);
        const Tensor cout = cpu.zeros(dt, B * L * H * D);
        cpu.backend->context_attention_forward(dims[ur], dt, call.raw(), saved[ur], cout.raw());
        const Tensor cdout = cpu.put(DType::f32, cut(dout, B, T, H * D, ContextSplit{r, c.cp}));
        cdqkv.push_back(cpu.zeros(dt, B * L * W));
        const Tensor cdkv = cpu.zeros(DType::f32, c.cp * dims[ur].kv_block());
        cpu.backend->context_attention_backward(dims[ur], ctable, dt, saved[ur],
                                                cdout.data<float>(), cdqkv.back().raw(),
                                                cdkv.data<float>());
        const Vec part = cpu.get(cdkv);
        for (size_t i = 0; i < part.size(); ++i) dkv_sum_cpu[i] += part[i];

        // CudaBackend::context_attention_forward / _backward's launches.
        emu_cuda::AttentionShape a{B, T, H, KV, D, 0, rank_pos[ur].data(),
                                   1.0f / std::sqrt(static_cast<float>(D))};
        a.queries = L;
        a.cp_rank = r;
        a.cp_size = c.cp;
        const emu_cuda::AttentionShape local{B, L, H, KV, D, 0, rank_pos[ur].data(), a.scale};
        Buffer k(dt, B * KV * T * D), v(dt, B * KV * T * D), probs(dt, B * H * L * T);
        Buffer out(dt, B * L * H * D);
        emu_cuda::launch_context_rows(nullptr, B * KV, L, D, c.cp, dtype_size(dt), kv_all.data(),
                                      k.data(), v.data(), true);
        emu_cuda::launch_attention_forward(nullptr, a, elem(dt), q[ur].data(), k.data(), v.data(),
                                           s.recompute ? nullptr : probs.data(), out.data());
        expect_close(out.floats(), cpu.get(cout), tolerance(dt), "out of rank " + std::to_string(r));
        Buffer p_work(DType::f32, B * H * L * T), ds(DType::f32, B * H * L * T);
        Buffer dq(DType::f32, B * H * L * D), dk(DType::f32, B * KV * T * D),
            dv(DType::f32, B * KV * T * D), dkv(DType::f32, c.cp * dims[ur].kv_block());
        const Vec rank_dout = cut(dout, B, T, H * D, ContextSplit{r, c.cp});
        emu_cuda::launch_attention_backward(nullptr, a, elem(dt), q[ur].data(), k.data(), v.data(),
                                            s.recompute ? nullptr : probs.data(),
                                            s.recompute ? p_work.f32() : nullptr,
                                            rank_dout.data(), ds.f32(), dq.f32(), dk.f32(),
                                            dv.f32());
        dqkv.emplace_back(dt, B * L * W);
        emu_cuda::launch_attention_merge(nullptr, local, dq.f32(), nullptr, nullptr, cos, sin,
                                         elem(dt), dqkv.back().data(), 0, H);
        emu_cuda::launch_context_rows(nullptr, B * KV, L, D, c.cp, sizeof(float), dkv.data(),
                                      dk.f32(), dv.f32(), false);
        const Vec mine = dkv.floats();
        for (size_t i = 0; i < mine.size(); ++i) dkv_sum[i] += mine[i];
        expect_close(mine, part, tolerance(DType::f32) + (dt == DType::f32 ? 0 : 1e-4),
                     "dkv_all of rank " + std::to_string(r));
      }
      // Finish with each rank's block of the summed gradients (the reduce-scatter).
      for (int64_t r = 0; r < c.cp; ++r) {
        const auto ur = static_cast<size_t>(r);
        const int64_t n = dims[ur].kv_block();
        const Vec cmine(dkv_sum_cpu.begin() + r * n, dkv_sum_cpu.begin() + (r + 1) * n);
        const Tensor cdkv = cpu.put(DType::f32, cmine);
        cpu.backend->context_attention_finish(dims[ur], ctable, dt, cdkv.data<float>(), nullptr,
                                              cdqkv[ur].raw());
        Vec mine(dkv_sum.begin() + r * n, dkv_sum.begin() + (r + 1) * n);
        const emu_cuda::AttentionShape local{B, L, H, KV, D, 0, rank_pos[ur].data(), 1.0f};
        emu_cuda::launch_attention_merge(nullptr, local, nullptr, mine.data(),
                                         mine.data() + n / 2, cos, sin, elem(dt),
                                         dqkv[ur].data(), H, -1);
        expect_close(dqkv[ur].floats(), cpu.get(cdqkv[ur]), tolerance(dt),
                     "d_qkv of rank " + std::to_string(r));
      }
    }
  }
}

// The ring: each rank's queries against every rank's block in ring order,
// then backward block by block, the blocks' k/v gradients summed over the
// ranks; each rank's output, log-sum-exp and d_qkv against the CPU backend's.
TEST(CudaEmu, RingAttentionEqualsTheCpuBackend) {
  for (const ContextCase& c : kContextCases) {
    const Shape& s = c.s;
    for (DType dt : {DType::f32, DType::bf16}) {
      SCOPED_TRACE(fmt::format("{} cp{}", name_of(s, dt), c.cp));
      const ops::AttentionDims whole{s.batch, s.seq, s.heads, s.kv, s.dim, nullptr};
      const int64_t W = whole.qkv_width(), B = s.batch, T = s.seq, H = s.heads, D = s.dim;
      const int64_t L = T / c.cp, KV = s.kv, block = 2 * B * KV * L * D;
      const Vec qkv = uniform(B * T * W, 7), dout = uniform(B * T * H * D, 8);
      const std::vector<int32_t> pos = positions_of(B, T, s.packed, 9);
      const Rope rope(D, T);
      const float* cos = s.rope ? rope.cos.data() : nullptr;
      const float* sin = s.rope ? rope.sin.data() : nullptr;
      Cpu cpu;
      const ops::RopeTable table = cpu.backend->make_rope_table(D, T, rope.inv_freq);
      const ops::RopeTable* ctable = s.rope ? &table : nullptr;
      std::vector<ops::ContextDims> dims;
      std::vector<Tensor> cpos, ckv, cout;
      std::vector<std::vector<int32_t>> rank_pos;
      std::vector<ops::AttentionSaved> saved(static_cast<size_t>(c.cp));
      std::vector<Buffer> q, kv, out;
      std::vector<Vec> lse;
      for (int64_t r = 0; r < c.cp; ++r) {
        const ContextSplit split{r, c.cp};
        rank_pos.push_back(cut_ids(pos, B, T, split));
        cpos.push_back(cpu.ids(rank_pos.back()));
        dims.push_back(ops::ContextDims{B, L, H, KV, D, split, cpos.back().data<int32_t>()});
        const Vec mine = cut(qkv, B, T, W, split);
        const Tensor cq = cpu.put(DType::f32, mine);
        ckv.push_back(cpu.zeros(dt, block));
        cpu.backend->context_attention_project(dims.back(), ctable, dt, cq.data<float>(),
                                               saved[static_cast<size_t>(r)], ckv.back().raw());
        const emu_cuda::AttentionShape local{B, L, H, KV, D, 0, rank_pos.back().data(), 1.0f};
        q.emplace_back(dt, B * H * L * D);
        kv.emplace_back(dt, block);
        emu_cuda::launch_attention_split(
            nullptr, local, mine.data(), cos, sin, elem(dt), q.back().data(), kv.back().data(),
            static_cast<char*>(kv.back().data()) + block / 2 * static_cast<int64_t>(dtype_size(dt)));
      }
      auto context = [&](int64_t r) {
        emu_cuda::AttentionShape a{B, T, H, KV, D, 0, rank_pos[static_cast<size_t>(r)].data(),
                                   1.0f / std::sqrt(static_cast<float>(D))};
        a.queries = L;
        a.cp_rank = r;
        a.cp_size = c.cp;
        return a;
      };
      auto half = [&](Buffer& b) {
        return static_cast<char*>(b.data()) + block / 2 * static_cast<int64_t>(dtype_size(dt));
      };
      for (int64_t r = 0; r < c.cp; ++r) {
        const auto ur = static_cast<size_t>(r);
        ops::RingState state;
        Buffer mx(DType::f32, B * H * L), sum(DType::f32, B * H * L), acc(DType::f32, B * H * L * D);
        for (int64_t step = 0; step < c.cp; ++step) {
          const int64_t owner = (r - step + c.cp) % c.cp;
          const auto uo = static_cast<size_t>(owner);
          cpu.backend->ring_attention_forward_block(dims[ur], dt, owner, ckv[uo].raw(), saved[ur],
                                                    state, step == 0);
          emu_cuda::launch_ring_forward_block(nullptr, context(r), owner, elem(dt), q[ur].data(),
                                              kv[uo].data(), half(kv[uo]), mx.f32(), sum.f32(),
                                              acc.f32(), step == 0);
        }
        cout.push_back(cpu.zeros(dt, B * L * H * D));
        cpu.backend->ring_attention_forward_finish(dims[ur], dt, state, saved[ur], cout.back().raw());
        out.emplace_back(dt, B * L * H * D);
        lse.emplace_back(static_cast<size_t>(B * H * L));
        emu_cuda::launch_ring_forward_finish(nullptr, context(r), elem(dt), mx.f32(), sum.f32(),
                                             acc.f32(), out.back().data(), lse.back().data());
        expect_close(out.back().floats(), cpu.get(cout.back()), tolerance(dt),
                     fmt::format("out of rank {}", r));
        expect_close(lse.back(), cpu.get(saved[ur].lse), 1e-10, fmt::format("lse of rank {}", r));
      }
      std::vector<Vec> dkv_cpu(static_cast<size_t>(c.cp), Vec(static_cast<size_t>(block), 0.0f));
      std::vector<Vec> dkv_emu = dkv_cpu;
      std::vector<Tensor> cdq;
      std::vector<Buffer> dq;
      for (int64_t r = 0; r < c.cp; ++r) {
        const auto ur = static_cast<size_t>(r);
        const Vec rank_dout = cut(dout, B, T, H * D, ContextSplit{r, c.cp});
        const Tensor cdout = cpu.put(DType::f32, rank_dout);
        cdq.push_back(cpu.zeros(DType::f32, B * H * L * D));
        dq.emplace_back(DType::f32, B * H * L * D);
        for (int64_t owner = 0; owner < c.cp; ++owner) {
          const auto uo = static_cast<size_t>(owner);
          const Tensor cdkv = cpu.zeros(DType::f32, block);
          cpu.backend->ring_attention_backward_block(dims[ur], dt, owner, ckv[uo].raw(), saved[ur],
                                                     cdout.data<float>(), cout[ur].raw(),
                                                     cdq.back().data<float>(), cdkv.data<float>());
          Buffer p(DType::f32, B * H * L * L), ds(DType::f32, B * H * L * L),
              dkv(DType::f32, block);
          emu_cuda::launch_ring_backward_block(nullptr, context(r), owner, elem(dt), q[ur].data(),
                                               kv[uo].data(), half(kv[uo]), lse[ur].data(),
                                               rank_dout.data(), out[ur].data(), p.f32(), ds.f32(),
                                               dq.back().f32(), dkv.f32(), dkv.f32() + block / 2);
          const Vec cpart = cpu.get(cdkv), part = dkv.floats();
          for (size_t i = 0; i < part.size(); ++i) {
            dkv_cpu[uo][i] += cpart[i];
            dkv_emu[uo][i] += part[i];
          }
        }
        expect_close(dq.back().floats(), cpu.get(cdq.back()), tolerance(dt) * 10,
                     fmt::format("dq of rank {}", r));
      }
      for (int64_t r = 0; r < c.cp; ++r) {
        const auto ur = static_cast<size_t>(r);
        expect_close(dkv_emu[ur], dkv_cpu[ur], tolerance(dt) * 10, fmt::format("dkv of rank {}", r));
        const Tensor cdkv = cpu.put(DType::f32, dkv_cpu[ur]);
        const Tensor cdqkv = cpu.zeros(dt, B * L * W);
        cpu.backend->context_attention_finish(dims[ur], ctable, dt, cdkv.data<float>(),
                                              cdq[ur].data<float>(), cdqkv.raw());
        Buffer dqkv(dt, B * L * W);
        const emu_cuda::AttentionShape local{B, L, H, KV, D, 0, rank_pos[ur].data(), 1.0f};
        emu_cuda::launch_attention_merge(nullptr, local, dq[ur].f32(), dkv_emu[ur].data(),
                                         dkv_emu[ur].data() + block / 2, cos, sin, elem(dt),
                                         dqkv.data());
        expect_close(dqkv.floats(), cpu.get(cdqkv), tolerance(dt) * 10,
                     fmt::format("d_qkv of rank {}", r));
      }
    }
  }
}

// Decoding: a prompt, then new tokens, against the cache.
TEST(CudaEmu, AttentionDecodeEqualsTheCpuBackend) {
  struct Decode {
    int64_t batch, prompt, fresh, heads, kv, dim;
    bool rope;
    int64_t window = 0;
  };
  for (const Decode& s : {Decode{1, 1, 1, 2, 1, 4, true}, Decode{2, 5, 3, 4, 2, 8, true},
                          Decode{2, 9, 1, 6, 3, 16, false}, Decode{2, 9, 4, 4, 2, 8, true, 3}}) {
    SCOPED_TRACE(fmt::format("prompt {} new {} window {}", s.prompt, s.fresh, s.window));
    const int64_t total = s.prompt + s.fresh, B = s.batch, KV = s.kv, D = s.dim;
    const ops::AttentionDims whole{B, total, s.heads, KV, D, nullptr, s.window};
    const int64_t W = whole.qkv_width();
    const Vec qkv = uniform(B * total * W, 10);
    const Rope rope(D, total);
    Cpu cpu;
    const ops::RopeTable table = cpu.backend->make_rope_table(D, total, rope.inv_freq);
    ops::KVCacheLayer cache;
    cache.k = cpu.zeros(DType::f32, B * KV * total * D);
    cache.v = cpu.zeros(DType::f32, B * KV * total * D);
    cache.k = cache.k.reshape({B, KV, total, D});
    cache.v = cache.v.reshape({B, KV, total, D});
    Vec k_cache(static_cast<size_t>(B * KV * total * D)), v_cache(k_cache.size());
    for (auto [t0, n] : {std::pair{int64_t{0}, s.prompt}, std::pair{s.prompt, s.fresh}}) {
      Vec part;
      for (int64_t b = 0; b < B; ++b)
        part.insert(part.end(), qkv.begin() + (b * total + t0) * W,
                    qkv.begin() + (b * total + t0 + n) * W);
      const ops::AttentionDims dims{B, n, s.heads, KV, D, nullptr, s.window};
      const Tensor cq = cpu.put(DType::f32, part), cout = cpu.zeros(DType::f32, B * n * s.heads * D);
      cpu.backend->attention_decode(dims, s.rope ? &table : nullptr, cq.data<float>(), t0, cache,
                                    cout.data<float>());
      const emu_cuda::AttentionShape a{B, n, s.heads, KV, D, s.window, nullptr,
                                       1.0f / std::sqrt(static_cast<float>(D))};
      Vec out(static_cast<size_t>(B * n * s.heads * D));
      emu_cuda::launch_attention_decode(nullptr, a, part.data(), s.rope ? rope.cos.data() : nullptr,
                                        s.rope ? rope.sin.data() : nullptr, t0, total,
                                        k_cache.data(), v_cache.data(), out.data());
      expect_close(out, cpu.get(cout), 1e-10, fmt::format("out from position {}", t0));
    }
    expect_close(k_cache, cpu.get(cache.k), 1e-12, "k cache");
  }
}

}  // namespace
}  // namespace meshtrain
