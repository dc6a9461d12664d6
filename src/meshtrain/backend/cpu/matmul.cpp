#include "meshtrain/backend/cpu/matmul.h"

#include <omp.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstring>
#include <iterator>
#include <vector>

#include "meshtrain/backend/cpu/onednn.h"
#include "meshtrain/backend/cpu/simd.h"
#include "meshtrain/util/error.h"

namespace meshtrain::cpu {

namespace {

using dnnl::memory;

memory::data_type onednn_type(DType dtype) {
  switch (dtype) {
    case DType::f32: return memory::data_type::f32;
    case DType::bf16: return memory::data_type::bf16;
    default: fail("matmul: dtype {} has no oneDNN primitive here (f32 or bf16)", dtype_name(dtype));
  }
}

// The primitive descriptor of one key and its memory descriptors: the one
// place a matmul is described, for the primitive (create_matmul) and for the
// workspace query (matmul_workspace). Transposes are strides on plain memory;
// a broadcast B has batch dimension 1. oneDNN sizes the scratchpad for the
// OpenMP thread count at this call.
struct MatmulDescription {
  memory::desc src, wei, dst, bias;
  bool bias_post_op = false;  // alpha != 1: the bias is a binary-add post-op
  dnnl::matmul::primitive_desc pd;
};

MatmulDescription describe_matmul(const dnnl::engine& engine, const MatmulKey& key) {
  const bool trans_a = key.flags & 1, trans_b = key.flags & 2, broadcast_b = key.flags & 4;
  const bool accumulate = key.flags & 8, has_bias = key.flags & 16;
  const int64_t B = key.batch, M = key.m, N = key.n, K = key.k;
  auto ab = static_cast<memory::data_type>(key.ab);
  auto c = static_cast<memory::data_type>(key.c);
  MatmulDescription d;
  if (B == 1) {
    d.src = memory::desc({M, K}, ab, trans_a ? memory::dims{1, key.lda} : memory::dims{key.lda, 1});
    d.wei = memory::desc({K, N}, ab, trans_b ? memory::dims{1, key.ldb} : memory::dims{key.ldb, 1});
    d.dst = memory::desc({M, N}, c, memory::dims{key.ldc, 1});
    d.bias = memory::desc({1, N}, memory::data_type::f32, memory::dims{N, 1});
  } else {
    d.src = memory::desc({B, M, K}, ab, trans_a ? memory::dims{M * K, 1, M} : memory::dims{M * K, K, 1});
    d.wei = memory::desc({broadcast_b ? 1 : B, K, N}, ab,
                         trans_b ? memory::dims{K * N, 1, K} : memory::dims{K * N, N, 1});
    d.dst = memory::desc({B, M, N}, c, memory::dims{M * N, N, 1});
    d.bias = memory::desc({1, 1, N}, memory::data_type::f32, memory::dims{N, N, 1});
  }
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  float alpha;
  std::memcpy(&alpha, &key.alpha_bits, sizeof alpha);
  if (alpha != 1.0f) attr.set_output_scales(0, {alpha});
  // oneDNN scales (A·B + bias) by the output scale; for alpha·A·B + bias the
  // bias becomes a binary-add post-op applied after the scaling.
  d.bias_post_op = has_bias && alpha != 1.0f;
  dnnl::post_ops ops;
  if (accumulate) ops.append_sum(1.0f);
  if (d.bias_post_op) ops.append_binary(dnnl::algorithm::binary_add, d.bias);
  attr.set_post_ops(ops);
  auto desc = has_bias && !d.bias_post_op ? dnnl::matmul::desc(d.src, d.wei, d.bias, d.dst)
                                          : dnnl::matmul::desc(d.src, d.wei, d.dst);
  d.pd = dnnl::matmul::primitive_desc(desc, attr, engine);
  return d;
}

// Builds the primitive for one key.
MatmulEntry create_matmul(CpuContext::Impl& impl, const MatmulKey& key) {
  const bool accumulate = key.flags & 8, has_bias = key.flags & 16;
  const MatmulDescription d = describe_matmul(impl.engine, key);
  MatmulEntry entry;
  entry.prim = dnnl::matmul(d.pd);
  if (key.m != DNNL_RUNTIME_DIM_VAL) {  // runtime rows: the caller describes each call's
    entry.src = memory(d.src, impl.engine, DNNL_MEMORY_NONE);
    entry.dst = memory(d.dst, impl.engine, DNNL_MEMORY_NONE);
  }
  entry.wei = memory(d.wei, impl.engine, DNNL_MEMORY_NONE);
  if (has_bias) entry.bias = memory(d.bias, impl.engine, DNNL_MEMORY_NONE);
  entry.bias_arg = d.bias_post_op ? (DNNL_ARG_ATTR_MULTIPLE_POST_OP(accumulate ? 1 : 0) | DNNL_ARG_SRC_1)
                                  : DNNL_ARG_BIAS;
  entry.scratchpad_bytes = d.pd.scratchpad_desc().get_size();
  return entry;
}

// Everything that selects the primitive of one call (with the argument checks).
MatmulKey matmul_key(const MatmulDims& dims, DType ab, DType c_dtype, float alpha, bool accumulate,
                     bool bias) {
  MESHTRAIN_CHECK(dims.batch >= 1 && dims.m >= 0 && dims.n >= 0 && dims.k >= 0,
                  "matmul: bad dims batch={} m={} n={} k={}", dims.batch, dims.m, dims.n, dims.k);
  MESHTRAIN_CHECK(!accumulate || c_dtype == DType::f32, "matmul: accumulate requires an f32 output");
  const int64_t dense_a = dims.trans_a ? dims.m : dims.k, dense_b = dims.trans_b ? dims.k : dims.n;
  MESHTRAIN_CHECK((dims.lda == 0 && dims.ldb == 0 && dims.ldc == 0) ||
                      (dims.batch == 1 && dims.lda >= 0 && dims.ldb >= 0 && dims.ldc >= 0 &&
                       (dims.lda == 0 || dims.lda >= dense_a) && (dims.ldb == 0 || dims.ldb >= dense_b) &&
                       (dims.ldc == 0 || dims.ldc >= dims.n)),
                  "matmul: bad leading dimensions lda={} ldb={} ldc={} for m={} n={} k={} batch={}",
                  dims.lda, dims.ldb, dims.ldc, dims.m, dims.n, dims.k, dims.batch);
  MatmulKey key{};
  key.batch = dims.batch;
  key.m = dims.m;
  key.n = dims.n;
  key.k = dims.k;
  key.lda = dims.lda > 0 ? dims.lda : dense_a;
  key.ldb = dims.ldb > 0 ? dims.ldb : dense_b;
  key.ldc = dims.ldc > 0 ? dims.ldc : dims.n;
  std::memcpy(&key.alpha_bits, &alpha, sizeof alpha);
  key.ab = static_cast<uint8_t>(onednn_type(ab));
  key.c = static_cast<uint8_t>(onednn_type(c_dtype));
  key.flags = static_cast<uint8_t>(dims.trans_a | dims.trans_b << 1 |
                                   (dims.broadcast_b && dims.batch > 1) << 2 | accumulate << 3 |
                                   bias << 4);
  return key;
}

// oneDNN's scratchpad for one call's primitive when it runs with `threads`
// OpenMP threads (the engine's and the planner's thread counts may differ).
size_t onednn_scratchpad_bytes(const MatmulKey& key, int threads) {
  const int before = omp_get_max_threads();
  if (threads != before) omp_set_num_threads(threads);
  const dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  const size_t bytes = describe_matmul(engine, key).pd.scratchpad_desc().get_size();
  if (threads != before) omp_set_num_threads(before);
  return bytes;
}

size_t round64(size_t bytes) { return (bytes + 63) / 64 * 64; }

// Elements from the first to the last one a [rows, cols] operand with row
// stride ld (dense when ld == cols) touches.
int64_t span(int64_t rows, int64_t cols, int64_t ld) { return rows == 0 ? 0 : (rows - 1) * ld + cols; }

void widen(const void* src, float* dst, int64_t n, bool threaded) {
  if (threaded) {
    convert(DType::f16, src, DType::f32, dst, static_cast<size_t>(n));
  } else {
    simd::convert_row(dst, static_cast<const f16*>(src), n);
  }
}

void narrow_rows(const float* src, f16* dst, int64_t rows, int64_t cols, int64_t ld, bool threaded) {
  if (ld == cols) {
    if (threaded) {
      convert(DType::f32, src, DType::f16, dst, static_cast<size_t>(rows * cols));
    } else {
      simd::convert_row(dst, src, rows * cols);
    }
    return;
  }
#pragma omp parallel for schedule(static) if (threaded)
  for (int64_t r = 0; r < rows; ++r) simd::convert_row(dst + r * ld, src + r * cols, cols);
}

}  // namespace

size_t F16Staging::bytes() const {
  if (!active) return 0;
  return round64(static_cast<size_t>(a_span) * 4) + round64(static_cast<size_t>(b_span) * 4) +
         round64(static_cast<size_t>(c_elems) * 4);
}

F16Staging f16_staging(const MatmulDims& dims, DType ab, DType c_dtype) {
  F16Staging s;
  s.active = ab == DType::f16 || c_dtype == DType::f16;
  if (!s.active) return s;
  MESHTRAIN_CHECK(ab == DType::f16 || ab == DType::f32, "matmul: inputs {} with an f16 output",
                  dtype_name(ab));
  s.f32_dims = dims;
  if (ab == DType::f16) {
    const int64_t batch_a = dims.batch, batch_b = dims.broadcast_b ? 1 : dims.batch;
    const int64_t lda = dims.lda > 0 ? dims.lda : (dims.trans_a ? dims.m : dims.k);
    const int64_t ldb = dims.ldb > 0 ? dims.ldb : (dims.trans_b ? dims.k : dims.n);
    s.a_span = dims.batch > 1 ? batch_a * dims.m * dims.k
                              : (dims.trans_a ? span(dims.k, dims.m, lda) : span(dims.m, dims.k, lda));
    s.b_span = dims.batch > 1 ? batch_b * dims.k * dims.n
                              : (dims.trans_b ? span(dims.n, dims.k, ldb) : span(dims.k, dims.n, ldb));
  }
  if (c_dtype == DType::f16) {
    s.c_elems = dims.batch * dims.m * dims.n;
    s.f32_dims.ldc = 0;  // dense: rows go to C's leading dimension when rounded
  }
  return s;
}

template <typename Gemm>
void F16Staging::run(const MatmulDims& dims, DType ab, const void* a, const void* b, DType c_dtype,
                     void* c, void* space, bool threaded, Gemm gemm) const {
  char* p = static_cast<char*>(space);
  const void* a_in = a;
  const void* b_in = b;
  if (ab == DType::f16) {
    auto* a32 = reinterpret_cast<float*>(p);
    p += round64(static_cast<size_t>(a_span) * 4);
    auto* b32 = reinterpret_cast<float*>(p);
    p += round64(static_cast<size_t>(b_span) * 4);
    widen(a, a32, a_span, threaded);
    widen(b, b32, b_span, threaded);
    a_in = a32;
    b_in = b32;
  }
  if (c_dtype != DType::f16) {
    gemm(a_in, b_in, c);
    return;
  }
  auto* c32 = reinterpret_cast<float*>(p);
  gemm(a_in, b_in, c32);
  const int64_t ldc = dims.ldc > 0 ? dims.ldc : dims.n;
  narrow_rows(c32, static_cast<f16*>(c), dims.batch * dims.m, dims.n, ldc, threaded);
}

namespace {

MatmulEntry& find_matmul(CpuContext& ctx, const MatmulKey& key) {
  CpuContext::Impl& impl = ctx.impl();
  auto it = impl.matmuls.find(key);
  if (it == impl.matmuls.end()) it = impl.matmuls.emplace(key, create_matmul(impl, key)).first;
  return it->second;
}

}  // namespace

MatmulEntry& find_matmul(CpuContext& ctx, const MatmulDims& dims, DType ab, DType c_dtype,
                         float alpha, bool accumulate, bool bias) {
  return find_matmul(ctx, matmul_key(dims, ab, c_dtype, alpha, accumulate, bias));
}

void matmul(CpuContext& ctx, const MatmulDims& dims, DType ab, const void* a, const void* b,
            DType c_dtype, void* c, float alpha, bool accumulate, const float* bias) {
  if (dims.m == 0 || dims.n == 0) return;
  const F16Staging staging = f16_staging(dims, ab, c_dtype);
  if (staging.active) {
    MESHTRAIN_CHECK(!accumulate || c_dtype == DType::f32, "matmul: accumulate requires an f32 output");
    void* space = ctx.impl().scratch(Scratch::f16_staging, staging.bytes());
    staging.run(dims, ab, a, b, c_dtype, c, space, true, [&](const void* a32, const void* b32, void* out) {
      matmul(ctx, staging.f32_dims, DType::f32, a32, b32, DType::f32, out, alpha, accumulate, bias);
    });
    return;
  }
  MatmulEntry& e = find_matmul(ctx, dims, ab, c_dtype, alpha, accumulate, bias != nullptr);
  CpuContext::Impl& impl = ctx.impl();
  e.src.set_data_handle(const_cast<void*>(a));
  e.wei.set_data_handle(const_cast<void*>(b));
  e.dst.set_data_handle(c);
  std::unordered_map<int, memory> args{
      {DNNL_ARG_SRC, e.src}, {DNNL_ARG_WEIGHTS, e.wei}, {DNNL_ARG_DST, e.dst}};
  if (bias != nullptr) {
    e.bias.set_data_handle(const_cast<float*>(bias));
    args.emplace(e.bias_arg, e.bias);
  }
  if (e.scratchpad_bytes > 0) {
    void* pad = impl.scratch(Scratch::onednn, e.scratchpad_bytes);
    if (!impl.scratchpad || impl.scratchpad.get_data_handle() != pad ||
        impl.scratchpad.get_desc().get_size() < e.scratchpad_bytes) {
      impl.scratchpad = memory({{static_cast<int64_t>(e.scratchpad_bytes)}, memory::data_type::u8,
                                memory::dims{1}},
                               impl.engine, pad);
    }
    args.emplace(DNNL_ARG_SCRATCHPAD, impl.scratchpad);
  }
  e.prim.execute(impl.stream, args);
  impl.stream.wait();
}

ThreadMatmul::ThreadMatmul(CpuContext& ctx, const MatmulDims& dims, DType ab, DType c_dtype, float alpha,
                           bool accumulate)
    : dims_(dims), ab_(ab), c_(c_dtype), staging_(f16_staging(dims, ab, c_dtype)) {
  MESHTRAIN_CHECK(!accumulate || c_dtype == DType::f32, "matmul: accumulate requires an f32 output");
  MatmulEntry& e = staging_.active
                       ? find_matmul(ctx, staging_.f32_dims, DType::f32, DType::f32, alpha, accumulate, false)
                       : find_matmul(ctx, dims, ab, c_dtype, alpha, accumulate, false);
  CpuContext::Impl& impl = ctx.impl();
  const int n = omp_get_max_threads();
  while (static_cast<int>(impl.thread_streams.size()) < n) impl.thread_streams.emplace_back(impl.engine);
  streams_ = &impl.thread_streams;
  prim_ = e.prim;
  pad_bytes_ = e.scratchpad_bytes;
  threads_.resize(static_cast<size_t>(n));
  for (auto& t : threads_) {
    t.src = memory(e.src.get_desc(), impl.engine, DNNL_MEMORY_NONE);
    t.wei = memory(e.wei.get_desc(), impl.engine, DNNL_MEMORY_NONE);
    t.dst = memory(e.dst.get_desc(), impl.engine, DNNL_MEMORY_NONE);
    t.args = {{DNNL_ARG_SRC, t.src}, {DNNL_ARG_WEIGHTS, t.wei}, {DNNL_ARG_DST, t.dst}};
    if (pad_bytes_ > 0) {
      t.pad = memory({{static_cast<int64_t>(pad_bytes_)}, memory::data_type::u8, memory::dims{1}},
                     impl.engine, DNNL_MEMORY_NONE);
      t.args.emplace(DNNL_ARG_SCRATCHPAD, t.pad);
    }
  }
}

void ThreadMatmul::run(int thread, const void* a, const void* b, void* c, void* pad) {
  if (staging_.active) {
    // The staging first, oneDNN's scratchpad after it.
    char* own = static_cast<char*>(pad) + staging_.bytes();
    staging_.run(dims_, ab_, a, b, c_, c, pad, false, [&](const void* a32, const void* b32, void* out) {
      run_primitive(thread, a32, b32, out, own);
    });
    return;
  }
  run_primitive(thread, a, b, c, pad);
}

void ThreadMatmul::run_primitive(int thread, const void* a, const void* b, void* c, void* pad) {
  PerThread& t = threads_[static_cast<size_t>(thread)];
  t.src.set_data_handle(const_cast<void*>(a));
  t.wei.set_data_handle(const_cast<void*>(b));
  t.dst.set_data_handle(c);
  if (pad_bytes_ > 0) t.pad.set_data_handle(pad);
  dnnl::stream& stream = (*streams_)[static_cast<size_t>(thread)];
  prim_.execute(stream, t.args);
  stream.wait();
}

MatmulWorkspace matmul_workspace(const MatmulDims& dims, DType ab, DType c_dtype, int threads,
                                 float alpha, bool accumulate, bool bias) {
  MatmulWorkspace w;
  if (dims.m == 0 || dims.n == 0) return w;  // matmul() returns before any workspace
  const F16Staging staging = f16_staging(dims, ab, c_dtype);
  if (staging.active) {
    w.f16_staging = staging.bytes();
    w.scratchpad = onednn_scratchpad_bytes(
        matmul_key(staging.f32_dims, DType::f32, DType::f32, alpha, accumulate, bias), threads);
  } else {
    w.scratchpad = onednn_scratchpad_bytes(matmul_key(dims, ab, c_dtype, alpha, accumulate, bias), threads);
  }
  return w;
}

size_t thread_matmul_scratchpad_bytes(const MatmulDims& dims, DType ab, DType c_dtype, int threads,
                                      float alpha, bool accumulate) {
  const F16Staging staging = f16_staging(dims, ab, c_dtype);
  const MatmulKey key = staging.active
                            ? matmul_key(staging.f32_dims, DType::f32, DType::f32, alpha, accumulate, false)
                            : matmul_key(dims, ab, c_dtype, alpha, accumulate, false);
  return thread_pad_bytes(staging, onednn_scratchpad_bytes(key, threads));
}

size_t thread_pad_bytes(const F16Staging& staging, size_t onednn_bytes) {
  return staging.bytes() + round64(onednn_bytes);
}

namespace {

// One group's GEMM of a grouped matmul: `rows` of its dimension split by the groups.
MatmulDims group_dims(const GroupedMatmulDims& dims, int64_t rows) {
  if (dims.along_k) return {.m = dims.m, .n = dims.n, .k = rows, .trans_a = true};
  return {.m = rows, .n = dims.n, .k = dims.k, .trans_b = dims.trans_b, .ldc = dims.ldc};
}

void check_grouped(const GroupedMatmulDims& dims, DType c_dtype) {
  int64_t rows = 0;
  for (const int32_t r : dims.sizes) {
    MESHTRAIN_CHECK(r >= 0, "grouped_matmul: a group of {} rows", r);
    rows += r;
  }
  MESHTRAIN_CHECK(rows <= dims.max_rows, "grouped_matmul: {} rows over max_rows {}", rows,
                  dims.max_rows);
  MESHTRAIN_CHECK(!dims.along_k || (!dims.trans_b && dims.ldc == 0 && c_dtype == DType::f32),
                  "grouped_matmul: along k takes neither trans_b nor ldc, and an f32 C");
}

// A group's rows as at most two GEMMs: the multiple of kGroupBlock rows, then
// the rest. The primitives (one per row count, created on first use) are then
// at most max_rows / kGroupBlock + kGroupBlock - 1 per shape, not one per
// count a routing gives. Along k the tail adds to what the bulk wrote.
constexpr int64_t kGroupBlock = 32;
struct GroupPiece {
  int64_t offset, rows;
  bool accumulate;
};
struct GroupPieces {
  std::array<GroupPiece, 2> piece{};
  size_t count = 0;
  const GroupPiece* begin() const { return piece.data(); }
  const GroupPiece* end() const { return piece.data() + count; }
};
GroupPieces group_pieces(int64_t rows, bool along_k, bool accumulate) {
  const int64_t bulk = rows / kGroupBlock * kGroupBlock;
  GroupPieces p;
  if (bulk > 0) p.piece[p.count++] = {0, bulk, accumulate};
  if (rows > bulk) p.piece[p.count++] = {bulk, rows - bulk, accumulate || (along_k && bulk > 0)};
  return p;
}

// The largest per-thread scratchpad a group of at most max_rows rows takes:
// its largest bulk and its largest tail, pad_of(rows, accumulate) each.
template <typename PadOf>
size_t largest_group_pad(const GroupedMatmulDims& dims, bool accumulate, PadOf pad_of) {
  size_t pad = 0;
  const int64_t bulk = dims.max_rows / kGroupBlock * kGroupBlock;
  if (bulk > 0) pad = std::max(pad, pad_of(bulk, accumulate));
  if (dims.max_rows > 0) {
    for (const bool acc : {accumulate, dims.along_k || accumulate}) {
      pad = std::max(pad, pad_of(std::min(kGroupBlock - 1, dims.max_rows), acc));
    }
  }
  return pad;
}

// f32 groups along m: one primitive whose row count is given at each call
// (DNNL_RUNTIME_DIM_VAL, for which oneDNN takes its jit sgemm), so a group is
// one GEMM of its exact rows: no tail, no primitive per row count. Measured
// single-threaded at n 1024, k 512 (Xeon, AVX-512): 151 GFLOP/s at 200 rows
// and 113 at 31, where brgemm gives 150 at 192 and 40-100 for a tail of 8-31
// rows. bf16 keeps brgemm (AMX), and the weight gradients (runtime k ran at
// 112-119 against brgemm's 131-141).
bool runtime_rows(const GroupedMatmulDims& dims, DType ab, DType c_dtype) {
  return !dims.along_k && ab == DType::f32 && c_dtype == DType::f32;
}

MatmulKey runtime_rows_key(const GroupedMatmulDims& dims, float alpha, bool accumulate) {
  MatmulKey key = matmul_key(group_dims(dims, 0), DType::f32, DType::f32, alpha, accumulate, false);
  key.m = DNNL_RUNTIME_DIM_VAL;
  return key;
}

class RuntimeRowsMatmul {
 public:
  RuntimeRowsMatmul(CpuContext& ctx, const GroupedMatmulDims& dims, float alpha, bool accumulate)
      : key_(runtime_rows_key(dims, alpha, accumulate)),
        entry_(find_matmul(ctx, key_)),
        engine_(ctx.impl().engine) {
    CpuContext::Impl& impl = ctx.impl();
    while (static_cast<int>(impl.thread_streams.size()) < omp_get_max_threads()) {
      impl.thread_streams.emplace_back(impl.engine);
    }
    streams_ = &impl.thread_streams;
  }
  size_t scratchpad_bytes() const { return round64(entry_.scratchpad_bytes); }
  void run(int thread, int64_t rows, const void* a, const void* b, void* c, void* pad) const {
    const int64_t k = key_.k, n = key_.n;
    memory src({{rows, k}, memory::data_type::f32, memory::dims{key_.lda, 1}}, engine_,
               const_cast<void*>(a));
    memory dst({{rows, n}, memory::data_type::f32, memory::dims{key_.ldc, 1}}, engine_, c);
    memory wei(entry_.wei.get_desc(), engine_, const_cast<void*>(b));
    std::unordered_map<int, memory> args{
        {DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, wei}, {DNNL_ARG_DST, dst}};
    if (entry_.scratchpad_bytes > 0) {
      args.emplace(DNNL_ARG_SCRATCHPAD,
                   memory({{static_cast<int64_t>(entry_.scratchpad_bytes)}, memory::data_type::u8,
                           memory::dims{1}},
                          engine_, pad));
    }
    dnnl::stream& stream = (*streams_)[static_cast<size_t>(thread)];
    entry_.prim.execute(stream, args);
    stream.wait();
  }

 private:
  MatmulKey key_;
  const MatmulEntry& entry_;
  const dnnl::engine& engine_;
  std::vector<dnnl::stream>* streams_ = nullptr;
};

}  // namespace

void grouped_matmul(CpuContext& ctx, const GroupedMatmulDims& dims, DType ab, const void* a,
                    const void* b, DType c_dtype, void* c, float alpha, bool accumulate) {
  check_grouped(dims, c_dtype);
  if (dims.n == 0 || (dims.along_k && dims.m == 0)) return;
  const auto ea = static_cast<int64_t>(dtype_size(ab)), ec = static_cast<int64_t>(dtype_size(c_dtype));
  struct Group {
    int64_t index, first, rows;
    size_t gemm;  // its pieces' GEMMs: gemms[gemm], and gemms[gemm + 1] when it has a tail
  };
  std::vector<Group> groups;
  int64_t first = 0;
  for (size_t g = 0; g < dims.sizes.size(); ++g) {
    if (dims.sizes[g] > 0) groups.push_back({static_cast<int64_t>(g), first, dims.sizes[g], 0});
    first += dims.sizes[g];
  }
  if (groups.empty()) return;
  // Largest first, so the last groups taken fill the threads' gaps.
  std::stable_sort(groups.begin(), groups.end(),
                   [](const Group& x, const Group& y) { return x.rows > y.rows; });
  const int threads = omp_get_max_threads();
  const auto* a8 = static_cast<const char*>(a);
  const auto* b8 = static_cast<const char*>(b);
  auto* c8 = static_cast<char*>(c);
  const int64_t ldc = dims.ldc > 0 ? dims.ldc : dims.n;
  if (runtime_rows(dims, ab, c_dtype)) {
    const RuntimeRowsMatmul gemm(ctx, dims, alpha, accumulate);
    const size_t pad = gemm.scratchpad_bytes();
    char* pads = static_cast<char*>(
        ctx.impl().scratch(Scratch::grouped, pad * static_cast<size_t>(threads)));
#pragma omp parallel for schedule(dynamic, 1)
    for (size_t i = 0; i < groups.size(); ++i) {
      const Group& g = groups[i];
      const int t = omp_get_thread_num();
      gemm.run(t, g.rows, a8 + g.first * dims.k * ea, b8 + g.index * dims.k * dims.n * ea,
               c8 + g.first * ldc * ec, pads + static_cast<size_t>(t) * pad);
    }
    return;
  }
  std::vector<ThreadMatmul> gemms;
  gemms.reserve(2 * groups.size());
  size_t pad = 0;
  for (Group& g : groups) {
    g.gemm = gemms.size();
    for (const GroupPiece& piece : group_pieces(g.rows, dims.along_k, accumulate)) {
      gemms.emplace_back(ctx, group_dims(dims, piece.rows), ab, c_dtype, alpha, piece.accumulate);
      pad = std::max(pad, gemms.back().scratchpad_bytes());
    }
  }
  // The slot is sized for the buffer's rows, whatever this routing gave (the memory plan's size).
  pad = std::max(pad, largest_group_pad(dims, accumulate, [&](int64_t rows, bool acc) {
                   return ThreadMatmul(ctx, group_dims(dims, rows), ab, c_dtype, alpha, acc)
                       .scratchpad_bytes();
                 }));
  char* pads = static_cast<char*>(
      ctx.impl().scratch(Scratch::grouped, pad * static_cast<size_t>(threads)));
#pragma omp parallel for schedule(dynamic, 1)
  for (size_t i = 0; i < groups.size(); ++i) {
    const Group& g = groups[i];
    const int t = omp_get_thread_num();
    size_t gemm = g.gemm;
    for (const GroupPiece& piece : group_pieces(g.rows, dims.along_k, accumulate)) {
      const int64_t row = g.first + piece.offset;
      const void* pa = a8 + row * (dims.along_k ? dims.m : dims.k) * ea;
      const void* pb = dims.along_k ? b8 + row * dims.n * ea : b8 + g.index * dims.k * dims.n * ea;
      void* pc = dims.along_k ? c8 + g.index * dims.m * dims.n * ec : c8 + row * ldc * ec;
      gemms[gemm++].run(t, pa, pb, pc, pads + static_cast<size_t>(t) * pad);
    }
  }
}

size_t grouped_matmul_workspace(const GroupedMatmulDims& dims, DType ab, DType c_dtype, int threads,
                                float alpha, bool accumulate) {
  if (dims.max_rows == 0 || dims.n == 0 || (dims.along_k && dims.m == 0)) return 0;
  if (runtime_rows(dims, ab, c_dtype)) {
    return static_cast<size_t>(threads) *
           round64(onednn_scratchpad_bytes(runtime_rows_key(dims, alpha, accumulate), threads));
  }
  return static_cast<size_t>(threads) *
         largest_group_pad(dims, accumulate, [&](int64_t rows, bool acc) {
           return thread_matmul_scratchpad_bytes(group_dims(dims, rows), ab, c_dtype, threads,
                                                 alpha, acc);
         });
}

namespace {

// The peak probe's GEMMs: shapes of a dim-512..1536 transformer layer at 2048
// tokens, B stored [n, k]; and the elements of its operands and result.
struct ProbeShape {
  int64_t m, n, k;
};
constexpr ProbeShape kProbeShapes[] = {{2048, 1536, 512}, {2048, 512, 1536}, {2048, 1024, 1024}};

MatmulDims probe_dims(const ProbeShape& s) {
  MatmulDims dims;
  dims.m = s.m;
  dims.n = s.n;
  dims.k = s.k;
  dims.trans_b = true;
  return dims;
}

void probe_elems(int64_t& max_ab, int64_t& max_c) {
  max_ab = max_c = 0;
  for (const ProbeShape& s : kProbeShapes) {
    max_ab = std::max({max_ab, s.m * s.k, s.k * s.n});
    max_c = std::max(max_c, s.m * s.n);
  }
}

}  // namespace

PeakProbeWorkspace peak_probe_workspace(DType ab, int threads) {
  int64_t max_ab = 0, max_c = 0;
  probe_elems(max_ab, max_c);
  PeakProbeWorkspace w;
  w.operands = static_cast<size_t>(2 * max_ab) * dtype_size(ab) + static_cast<size_t>(max_c) * 4;
  for (const ProbeShape& s : kProbeShapes) {
    const MatmulWorkspace g = matmul_workspace(probe_dims(s), ab, DType::f32, threads);
    w.slots.scratchpad = std::max(w.slots.scratchpad, g.scratchpad);
    w.slots.f16_staging = std::max(w.slots.f16_staging, g.f16_staging);
  }
  return w;
}

double measure_matmul_peak_flops(CpuContext& ctx, DType ab, double seconds) {
  int64_t max_ab = 0, max_c = 0;
  probe_elems(max_ab, max_c);
  MemoryTracker& tracker = ctx.tracker();
  Tensor a({max_ab}, ab, MemCategory::workspace, tracker);
  Tensor b({max_ab}, ab, MemCategory::workspace, tracker);
  Tensor c({max_c}, DType::f32, MemCategory::workspace, tracker);
  // Non-zero inputs (denormal-free) so timing reflects real data.
  std::vector<float> fill(static_cast<size_t>(max_ab));
  for (size_t i = 0; i < fill.size(); ++i) fill[i] = 0.01f * static_cast<float>(i % 97) - 0.4f;
  convert(DType::f32, fill.data(), ab, a.raw(), fill.size());
  convert(DType::f32, fill.data(), ab, b.raw(), fill.size());

  using Clock = std::chrono::steady_clock;
  // Rounds over every shape, half of `seconds` each, until two in a row agree
  // within 3%, at most kRounds; the best of all. One noisy second once read 150
  // instead of ~280 GFLOP/s (a 143% MFU): a round slowed by a neighbour now
  // disagrees with the next one, and a quiet host still takes `seconds`.
  constexpr int kRounds = 4;
  const double per_shape =
      std::max(seconds, 0.05) / 2.0 / static_cast<double>(std::size(kProbeShapes));
  for (const ProbeShape& s : kProbeShapes) {  // warm-up (JIT, pages)
    matmul(ctx, probe_dims(s), ab, a.raw(), b.raw(), DType::f32, c.raw());
  }
  double best = 0.0, previous = 0.0;
  for (int round = 0; round < kRounds; ++round) {
    double round_best = 0.0;
    for (const ProbeShape& s : kProbeShapes) {
      const MatmulDims dims = probe_dims(s);
      const double flops = 2.0 * static_cast<double>(s.m * s.n * s.k);
      // Sustained rate over windows of >= 3 GEMMs and >= 30 ms; the best window
      // (a shared machine only ever slows a window down).
      auto start = Clock::now();
      double elapsed = 0.0;
      do {
        auto w0 = Clock::now();
        int64_t runs = 0;
        double window = 0.0;
        do {
          matmul(ctx, dims, ab, a.raw(), b.raw(), DType::f32, c.raw());
          ++runs;
          window = std::chrono::duration<double>(Clock::now() - w0).count();
        } while (runs < 3 || window < 0.03);
        round_best = std::max(round_best, flops * static_cast<double>(runs) / window);
        elapsed = std::chrono::duration<double>(Clock::now() - start).count();
      } while (elapsed < per_shape);
    }
    best = std::max(best, round_best);
    if (round > 0 && std::abs(round_best - previous) <= 0.03 * std::max(round_best, previous))
      break;
    previous = round_best;
  }
  return best;
}

}  // namespace meshtrain::cpu
