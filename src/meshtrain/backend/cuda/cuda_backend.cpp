#include "meshtrain/backend/cuda/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <set>
#include <vector>

#include "meshtrain/backend/cuda/kernels.h"
#include "meshtrain/backend/cuda/matmul.h"
#include "meshtrain/backend/cuda/runtime.h"
#include "meshtrain/backend/cuda/sdpa/sdpa.h"
#include "meshtrain/tensor/nf4.h"
#include "meshtrain/util/error.h"

namespace meshtrain::cuda {

namespace {

const char* bytes_of(const void* p, int64_t elements, DType d) {
  return static_cast<const char*>(p) + elements * static_cast<int64_t>(dtype_size(d));
}
char* bytes_of(void* p, int64_t elements, DType d) {
  return static_cast<char*>(p) + elements * static_cast<int64_t>(dtype_size(d));
}

}  // namespace

struct CudaBackend::Impl {
  int device = 0;
  cudaStream_t stream = nullptr;  // every kernel, copy and GEMM: the device's compute_stream()
  std::unique_ptr<CachingAllocator> allocator;
  PinnedAllocator pinned;
  Tensor gemm_workspace;
  std::unique_ptr<Gemms> gemms;
  std::unique_ptr<SdpaRunner> sdpa;  // cuDNN's fused attention, where it takes a shape
  std::set<std::string> sdpa_refusals;  // the reasons cuDNN gave, each told once
  cudaDeviceProp props{};
};

CudaBackend::CudaBackend(MemoryTracker& tracker) : Backend(tracker), impl_(std::make_unique<Impl>()) {
  const std::string why = device_unavailable();
  MESHTRAIN_CHECK_AS(ErrorKind::resource, why.empty(), "backend 'cuda' is not available: {}", why);
  Impl& m = *impl_;
  m.device = choose_device();
  check(cudaSetDevice(m.device), "cudaSetDevice");
  check(cudaGetDeviceProperties(&m.props, m.device), "cudaGetDeviceProperties");
  m.stream = compute_stream(m.device);
  m.allocator = std::make_unique<CachingAllocator>(m.device, m.stream);
  m.gemm_workspace = Tensor({static_cast<int64_t>(kGemmWorkspace / sizeof(float))}, DType::f32,
                            MemCategory::workspace, tracker, *m.allocator);
  m.gemms = std::make_unique<Gemms>(m.stream, m.gemm_workspace.raw());
  m.sdpa = std::make_unique<SdpaRunner>(m.stream);
}

CudaBackend::~CudaBackend() {
  Impl& m = *impl_;
  cudaStreamSynchronize(m.stream);
  m.sdpa.reset();
  m.gemms.reset();
  m.gemm_workspace = Tensor();
  m.allocator.reset();
}

Device CudaBackend::device() const { return {DeviceKind::cuda, impl_->device}; }

std::string CudaBackend::device_name() const { return impl_->props.name; }

const Allocator& CudaBackend::staging_allocator() const { return impl_->pinned; }

Tensor CudaBackend::allocate(Shape shape, DType dtype, MemCategory category) {
  return Tensor(std::move(shape), dtype, category, tracker(), *impl_->allocator);
}

void CudaBackend::copy_to_host(const Tensor& src, void* dst) {
  MESHTRAIN_CHECK(src.device() == device(), "cuda backend: copy_to_host of a {} tensor",
                  src.device().str());
  check(cudaMemcpyAsync(dst, src.raw(), src.bytes(), cudaMemcpyDeviceToHost, impl_->stream),
        "cudaMemcpyAsync to host");
  synchronize();
}

void CudaBackend::copy_from_host(const void* src, const Tensor& dst) {
  MESHTRAIN_CHECK(dst.device() == device(), "cuda backend: copy_from_host into a {} tensor",
                  dst.device().str());
  check(cudaMemcpyAsync(dst.raw(), src, dst.bytes(), cudaMemcpyHostToDevice, impl_->stream),
        "cudaMemcpyAsync from host");
  synchronize();  // src may go away when this returns
}

void CudaBackend::synchronize() { check(cudaStreamSynchronize(impl_->stream), "cudaStreamSynchronize"); }

// ---- GEMMs
void CudaBackend::matmul(const ops::MatmulDims& dims, DType ab, const void* a, const void* b,
                         DType c_dtype, void* c, float alpha, bool accumulate, const float* bias) {
  impl_->gemms->run(dims, ab, a, b, c_dtype, c, alpha, accumulate, bias);
}

void CudaBackend::matmul_add(const ops::MatmulDims& dims, DType ab, const void* a, const void* b,
                             const float* addend, float* c, const float* bias) {
  MESHTRAIN_CHECK(dims.ldc == 0, "cuda: matmul_add takes a dense C");
  impl_->gemms->run(dims, ab, a, b, DType::f32, c, 1.0f, true, bias, addend);
}

void CudaBackend::grouped_matmul(const ops::GroupedMatmulDims& dims, DType ab, const void* a,
                                 const void* b, DType c_dtype, void* c, float alpha,
                                 bool accumulate) {
  int64_t row0 = 0;
  for (size_t g = 0; g < dims.sizes.size(); ++g) {
    const int64_t rows = dims.sizes[g];
    if (rows > 0) {
      const auto gi = static_cast<int64_t>(g);
      if (dims.along_k) {
        // C_g = alpha A[rows_g]^T B[rows_g]: A [rows, m], B [rows, n].
        const ops::MatmulDims d{1, dims.m, dims.n, rows, true, false, false};
        matmul(d, ab, bytes_of(a, row0 * dims.m, ab), bytes_of(b, row0 * dims.n, ab), c_dtype,
               bytes_of(c, gi * dims.m * dims.n, c_dtype), alpha, accumulate, nullptr);
      } else {
        const ops::MatmulDims d{1, rows, dims.n, dims.k, false, dims.trans_b, false, 0, 0, dims.ldc};
        const int64_t ldc = dims.ldc > 0 ? dims.ldc : dims.n;
        matmul(d, ab, bytes_of(a, row0 * dims.k, ab), bytes_of(b, gi * dims.k * dims.n, ab),
               c_dtype, bytes_of(c, row0 * ldc, c_dtype), alpha, accumulate, nullptr);
      }
    }
    row0 += rows;
  }
}

namespace {

// Runs `batch` (which issues `per_batch` operations on `stream`) until at
// least `seconds` have passed on the device and at least 3 operations ran:
// operations per second, timed by events around the whole run.
template <typename Batch>
double rate_on_device(cudaStream_t stream, double seconds, int64_t per_batch, Batch batch) {
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "cudaEventCreate");
  check(cudaEventCreate(&stop), "cudaEventCreate");
  int64_t operations = 0;
  float elapsed_ms = 0;
  check(cudaEventRecord(start, stream), "cudaEventRecord");
  while (elapsed_ms < seconds * 1e3 || operations < 3) {
    batch();
    operations += per_batch;
    check(cudaEventRecord(stop, stream), "cudaEventRecord");
    check(cudaEventSynchronize(stop), "cudaEventSynchronize");
    check(cudaEventElapsedTime(&elapsed_ms, start, stop), "cudaEventElapsedTime");
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return static_cast<double>(operations) / (static_cast<double>(elapsed_ms) * 1e-3);
}

}  // namespace

double CudaBackend::measure_matmul_peak_flops(DType ab, double seconds) {
  const int64_t n = ab == DType::f32 ? 4096 : 8192;
  Tensor a = allocate({n, n}, ab, MemCategory::workspace);
  Tensor b = allocate({n, n}, ab, MemCategory::workspace);
  Tensor c = allocate({n, n}, DType::f32, MemCategory::workspace);
  const ops::MatmulDims d{1, n, n, n};
  auto gemm = [&] { matmul(d, ab, a.raw(), b.raw(), DType::f32, c.raw(), 1.0f, false, nullptr); };
  gemm();  // plan and warm up
  const double per_second = rate_on_device(impl_->stream, seconds, 4, [&] {
    for (int i = 0; i < 4; ++i) gemm();
  });
  return 2.0 * static_cast<double>(n) * n * n * per_second;
}

double CudaBackend::measure_copy_bandwidth(size_t bytes, double seconds) {
  const auto n = static_cast<int64_t>(std::max<size_t>(bytes / 4, 1));
  Tensor src = allocate({n}, DType::f32, MemCategory::workspace);
  Tensor dst = allocate({n}, DType::f32, MemCategory::workspace);
  const double per_second = rate_on_device(impl_->stream, seconds, 1, [&] {
    check(cudaMemcpyAsync(dst.raw(), src.raw(), src.bytes(), cudaMemcpyDeviceToDevice,
                          impl_->stream),
          "cudaMemcpyAsync");
  });
  return 2.0 * static_cast<double>(src.bytes()) * per_second;
}

// ---- norms and elementwise
void CudaBackend::rmsnorm_forward(const float* x, const float* w, DType out_dtype, void* y,
                                  float* rstd, int64_t rows, int64_t dim, float eps) {
  launch_rmsnorm_forward(impl_->stream, x, w, elem(out_dtype), y, rstd, rows, dim, eps);
}

void CudaBackend::rmsnorm_backward(const float* x, const float* w, const float* rstd,
                                   const float* dy, float* dx, float* dw, int64_t rows,
                                   int64_t dim) {
  launch_rmsnorm_backward(impl_->stream, x, w, rstd, dy, dx, dw, rows, dim);
}

void CudaBackend::layernorm_forward(const float* x, const float* w, const float* b,
                                    DType out_dtype, void* y, float* mean, float* rstd,
                                    int64_t rows, int64_t dim, float eps) {
  launch_layernorm_forward(impl_->stream, x, w, b, elem(out_dtype), y, mean, rstd, rows, dim, eps);
}

void CudaBackend::layernorm_backward(const float* x, const float* w, const float* mean,
                                     const float* rstd, const float* dy, float* dx, float* dw,
                                     float* db, int64_t rows, int64_t dim) {
  launch_layernorm_backward(impl_->stream, x, w, mean, rstd, dy, dx, dw, db, rows, dim);
}

void CudaBackend::group_rmsnorm_forward(const ops::GroupNormDims& dims, float* x, const float* w,
                                        float* saved, float* rstd) {
  launch_group_rmsnorm_forward(impl_->stream, {dims.rows, dims.stride, dims.count, dims.width, dims.eps},
                               x, w, saved, rstd);
}

void CudaBackend::group_rmsnorm_backward(const ops::GroupNormDims& dims, const float* saved,
                                         const float* w, const float* rstd, DType grad_dtype,
                                         void* dy, float* dw) {
  launch_group_rmsnorm_backward(impl_->stream,
                                {dims.rows, dims.stride, dims.count, dims.width, dims.eps}, saved,
                                w, rstd, elem(grad_dtype), dy, dw);
}

void CudaBackend::swiglu_forward(const float* gate_up, DType out_dtype, void* out, int64_t rows,
                                 int64_t hidden) {
  launch_swiglu_forward(impl_->stream, gate_up, elem(out_dtype), out, rows, hidden);
}

void CudaBackend::swiglu_backward(const float* gate_up, const float* d_out, DType grad_dtype,
                                  void* d_gate_up, int64_t rows, int64_t hidden) {
  launch_swiglu_backward(impl_->stream, gate_up, d_out, elem(grad_dtype), d_gate_up, rows, hidden);
}

void CudaBackend::gelu_forward(const float* x, DType out_dtype, void* y, int64_t n) {
  launch_gelu_forward(impl_->stream, x, elem(out_dtype), y, n);
}

void CudaBackend::gelu_backward(const float* x, const float* dy, DType grad_dtype, void* dx,
                                int64_t n) {
  launch_gelu_backward(impl_->stream, x, dy, elem(grad_dtype), dx, n);
}

void CudaBackend::add_inplace(float* x, const float* y, int64_t n) {
  launch_add_inplace(impl_->stream, x, y, n);
}

void CudaBackend::mul_inplace(float* x, const float* y, int64_t n) {
  launch_mul_inplace(impl_->stream, x, y, n);
}

void CudaBackend::add_product(float* x, const float* a, const float* b, int64_t n) {
  launch_add_product(impl_->stream, x, a, b, n);
}

void CudaBackend::residual_add(const float* residual, const float* y, const float* bias, float* out,
                               int64_t rows, int64_t n) {
  launch_residual_add(impl_->stream, residual, y, bias, out, rows, n);
}

void CudaBackend::residual_add_norm(const float* residual, const float* y, const float* bias,
                                    float* sum, const ops::NormArgs& norm, DType out_dtype,
                                    void* out, int64_t rows, int64_t n) {
  const ResidualNorm args{.layer_norm = norm.layer_norm,
                          .residual = residual,
                          .y = y,
                          .bias = bias,
                          .sum = sum,
                          .w = norm.w,
                          .b = norm.b,
                          .mean = norm.mean,
                          .rstd = norm.rstd,
                          .eps = norm.eps};
  MESHTRAIN_CHECK(!norm.layer_norm || norm.mean != nullptr,
                  "cuda: residual_add_norm: a LayerNorm saves its mean");
  launch_residual_add_norm(impl_->stream, args, elem(out_dtype), out, rows, n);
}

void CudaBackend::convert(DType from, const void* src, DType to, void* dst, int64_t n) {
  impl_->allocator->copy(from, src, to, dst, static_cast<size_t>(n));
}

void CudaBackend::bias_backward(const float* dy, float* dbias, int64_t rows, int64_t n) {
  launch_bias_backward(impl_->stream, dy, dbias, rows, n);
}

// ---- RoPE and attention
ops::RopeTable CudaBackend::make_rope_table(int64_t head_dim, int64_t max_seq,
                                            std::span<const float> inv_freq) {
  const int64_t half = head_dim / 2;
  std::vector<float> cos(static_cast<size_t>(max_seq * half)), sin(cos.size());
  ops::rope_table_values(head_dim, max_seq, inv_freq, cos.data(), sin.data());
  ops::RopeTable table;
  table.head_dim = head_dim;
  table.max_seq = max_seq;
  table.cos = allocate({max_seq, half}, DType::f32, MemCategory::workspace);
  table.sin = allocate({max_seq, half}, DType::f32, MemCategory::workspace);
  copy_from_host(cos.data(), table.cos);
  copy_from_host(sin.data(), table.sin);
  return table;
}

// The reference attention kernels hold a query's row of scores in shared memory.
void CudaBackend::require_shared(size_t bytes, const char* op, int64_t keys) const {
  int optin = 0;
  check(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, impl_->device),
        "cudaDeviceGetAttribute");
  bytes += kStaticSharedBytes;
  MESHTRAIN_CHECK_AS(ErrorKind::resource, bytes <= static_cast<size_t>(optin),
                     "cuda {}: {} keys need {} bytes of shared memory per block, the device "
                     "allows {}",
                     op, keys, bytes, optin);
}

namespace {

AttentionShape attention_shape(const ops::AttentionDims& d, const ops::RopeTable* rope) {
  MESHTRAIN_CHECK(d.batch > 0 && d.seq > 0 && d.n_heads > 0 && d.n_kv_heads > 0 &&
                      d.head_dim > 0 && d.head_dim % 2 == 0 && d.n_heads % d.n_kv_heads == 0,
                  "attention: bad dims batch={} seq={} heads={} kv_heads={} head_dim={}", d.batch,
                  d.seq, d.n_heads, d.n_kv_heads, d.head_dim);
  if (rope != nullptr) {
    MESHTRAIN_CHECK(rope->head_dim == d.head_dim && d.seq <= rope->max_seq,
                    "attention: rope table (head_dim {}, {} positions) does not fit head_dim {} "
                    "seq {}",
                    rope->head_dim, rope->max_seq, d.head_dim, d.seq);
  }
  return {d.batch,  d.seq,       d.n_heads, d.n_kv_heads,
          d.head_dim, d.window, d.positions, 1.0f / std::sqrt(static_cast<float>(d.head_dim))};
}

}  // namespace

void CudaBackend::attention_forward(const ops::AttentionDims& dims, const ops::RopeTable* rope,
                                    DType compute, const float* qkv, void* out,
                                    ops::AttentionSaved& saved) {
  const AttentionShape a = attention_shape(dims, rope);
  const bool fused = takes_fused(dims, compute);
  if (!fused) require_shared(attention_shared_bytes(a), "attention", dims.seq);
  const int64_t B = dims.batch, T = dims.seq, H = dims.n_heads, KV = dims.n_kv_heads;
  const int64_t D = dims.head_dim;
  ensure(saved.q, {B, H, T, D}, compute, MemCategory::activations);
  ensure_saved(saved, {B, KV, T, D}, fused ? Shape{} : Shape{B, H, T, T}, compute);
  const Elem e = elem(compute);
  launch_attention_split(impl_->stream, a, qkv, rope ? rope->cos.data<float>() : nullptr,
                         rope ? rope->sin.data<float>() : nullptr, e, saved.q.raw(), saved.k.raw(),
                         saved.v.raw());
  if (!fused) {
    saved.out = Tensor();
    saved.lse = Tensor();
    launch_attention_forward(impl_->stream, a, e, saved.q.raw(), saved.k.raw(), saved.v.raw(),
                             saved.probs.defined() ? saved.probs.raw() : nullptr, out);
    return;
  }
  // cuDNN's backward reads the output: kept here, copied to `out` for the model.
  ensure(saved.out, {B, T, H, D}, compute, MemCategory::activations);
  ensure(saved.lse, {B, H, T}, DType::f32, MemCategory::activations);
  const SdpaShape s = sdpa_shape(dims, compute);
  const Tensor workspace = sdpa_workspace(impl_->sdpa->forward_workspace(s));
  impl_->sdpa->forward(s, {saved.q.raw(), saved.k.raw(), saved.v.raw(), saved.out.raw(),
                           saved.lse.data<float>()},
                       workspace.defined() ? workspace.raw() : nullptr);
  check(cudaMemcpyAsync(out, saved.out.raw(), saved.out.bytes(), cudaMemcpyDeviceToDevice,
                        impl_->stream),
        "cudaMemcpyAsync (attention output)");
}

void CudaBackend::attention_backward(const ops::AttentionDims& dims, const ops::RopeTable* rope,
                                     DType compute, const ops::AttentionSaved& saved,
                                     const float* d_out, void* d_qkv) {
  const AttentionShape a = attention_shape(dims, rope);
  // The path forward took: cuDNN's keeps the output.
  const AttentionGrads g = saved.out.defined()
                               ? fused_backward(sdpa_shape(dims, compute), saved, d_out)
                               : reference_backward(a, compute, saved, d_out);
  launch_attention_merge(impl_->stream, a, g.dq.data<float>(), g.dk.data<float>(),
                         g.dv.data<float>(), rope ? rope->cos.data<float>() : nullptr,
                         rope ? rope->sin.data<float>() : nullptr, elem(compute), d_qkv);
}

CudaBackend::AttentionGrads CudaBackend::reference_backward(const AttentionShape& a,
                                                            DType compute,
                                                            const ops::AttentionSaved& saved,
                                                            const float* d_out) {
  const int64_t B = a.batch, Q = a.query_rows(), T = a.seq, H = a.heads, KV = a.kv_heads;
  const int64_t D = a.head_dim;
  const bool kept = !saved.recompute_probs;
  MESHTRAIN_CHECK(saved.q.defined() && saved.q.dtype() == compute && saved.q.numel() == B * H * Q * D &&
                      saved.k.defined() && saved.k.numel() == B * KV * T * D &&
                      (!kept || (saved.probs.defined() && saved.probs.dtype() == compute &&
                                 saved.probs.numel() == B * H * Q * T)),
                  "attention backward: saved tensors do not match dims/compute dtype");
  Tensor ds = allocate({B, H, Q, T}, DType::f32, MemCategory::workspace);
  Tensor p = kept ? Tensor() : allocate({B, H, Q, T}, DType::f32, MemCategory::workspace);
  AttentionGrads g{allocate({B, H, Q, D}, DType::f32, MemCategory::workspace),
                   allocate({B, KV, T, D}, DType::f32, MemCategory::workspace),
                   allocate({B, KV, T, D}, DType::f32, MemCategory::workspace)};
  launch_attention_backward(impl_->stream, a, elem(compute), saved.q.raw(), saved.k.raw(),
                            saved.v.raw(), kept ? saved.probs.raw() : nullptr,
                            kept ? nullptr : p.data<float>(), d_out, ds.data<float>(),
                            g.dq.data<float>(), g.dk.data<float>(), g.dv.data<float>());
  return g;
}

CudaBackend::AttentionGrads CudaBackend::fused_backward(const SdpaShape& s,
                                                        const ops::AttentionSaved& saved,
                                                        const float* d_out) {
  const int64_t B = s.batch, T = s.seq, H = s.heads, KV = s.kv_heads, D = s.head_dim;
  MESHTRAIN_CHECK(saved.out.defined() && saved.out.dtype() == s.dtype &&
                      saved.out.numel() == B * T * H * D && saved.lse.numel() == B * H * T &&
                      saved.q.numel() == B * H * T * D && saved.k.numel() == B * KV * T * D,
                  "attention backward: saved tensors do not match dims/compute dtype");
  // cuDNN takes dO and gives dQ, dK, dV in the inputs' dtype; the merge reads f32.
  const Elem e = elem(s.dtype);
  Tensor d_o = allocate({B, T, H, D}, s.dtype, MemCategory::workspace);
  launch_convert(impl_->stream, Elem::f32, d_out, e, d_o.raw(), d_o.numel());
  Tensor dq = allocate({B, H, T, D}, s.dtype, MemCategory::workspace);
  Tensor dk = allocate({B, KV, T, D}, s.dtype, MemCategory::workspace);
  Tensor dv = allocate({B, KV, T, D}, s.dtype, MemCategory::workspace);
  const Tensor workspace = sdpa_workspace(impl_->sdpa->backward_workspace(s));
  impl_->sdpa->backward(s,
                        {saved.q.raw(), saved.k.raw(), saved.v.raw(), saved.out.raw(), d_o.raw(),
                         saved.lse.data<float>(), dq.raw(), dk.raw(), dv.raw()},
                        workspace.defined() ? workspace.raw() : nullptr);
  AttentionGrads g{allocate({B, H, T, D}, DType::f32, MemCategory::workspace),
                   allocate({B, KV, T, D}, DType::f32, MemCategory::workspace),
                   allocate({B, KV, T, D}, DType::f32, MemCategory::workspace)};
  launch_convert(impl_->stream, e, dq.raw(), Elem::f32, g.dq.raw(), dq.numel());
  launch_convert(impl_->stream, e, dk.raw(), Elem::f32, g.dk.raw(), dk.numel());
  launch_convert(impl_->stream, e, dv.raw(), Elem::f32, g.dv.raw(), dv.numel());
  return g;
}

bool CudaBackend::takes_fused(const ops::AttentionDims& dims, DType compute) {
  if (!sdpa_declines(dims, compute).empty()) return false;
  const std::string why = impl_->sdpa->prepare(sdpa_shape(dims, compute));
  if (why.empty()) return true;
  // A shape cuDNN itself refused (the expected declines are not news).
  if (impl_->sdpa_refusals.insert(why).second) {
    std::fputs(fmt::format("cuda: cuDNN's fused attention refused batch {} seq {} heads {}/{} "
                           "head_dim {}: {}; the reference kernels run it\n",
                           dims.batch, dims.seq, dims.n_heads, dims.n_kv_heads, dims.head_dim,
                           why)
                   .c_str(),
               stderr);
  }
  return false;
}

Tensor CudaBackend::sdpa_workspace(size_t bytes) {
  if (bytes == 0) return Tensor();
  return allocate({static_cast<int64_t>((bytes + sizeof(float) - 1) / sizeof(float))}, DType::f32,
                  MemCategory::workspace);
}

void CudaBackend::attention_decode(const ops::AttentionDims& dims, const ops::RopeTable* rope,
                                   const float* qkv, int64_t pos0, ops::KVCacheLayer& cache,
                                   float* out) {
  // Token t is at position pos0 + t (dims.positions are not read, as on the CPU).
  ops::AttentionDims whole = dims;
  whole.seq = pos0 + dims.seq;
  whole.positions = nullptr;
  attention_shape(whole, rope);  // checks the dims and that the table covers every position
  const int64_t B = dims.batch, KV = dims.n_kv_heads, D = dims.head_dim;
  MESHTRAIN_CHECK(cache.k.defined() && cache.k.rank() == 4 && cache.k.dim(0) == B &&
                      cache.k.dim(1) == KV && cache.k.dim(3) == D &&
                      cache.v.shape() == cache.k.shape() && cache.k.dtype() == DType::f32,
                  "attention_decode: cache shape {} does not match batch {} kv_heads {} head_dim {}",
                  shape_str(cache.k.shape()), B, KV, D);
  const int64_t S = cache.k.dim(2);
  MESHTRAIN_CHECK(pos0 >= 0 && pos0 + dims.seq <= S,
                  "attention_decode: positions [{}, {}) exceed cache ({})", pos0, pos0 + dims.seq, S);
  AttentionShape a = attention_shape(dims, nullptr);
  a.positions = nullptr;
  require_shared(decode_shared_bytes(a, pos0), "attention_decode", pos0 + dims.seq);
  launch_attention_decode(impl_->stream, a, qkv, rope ? rope->cos.data<float>() : nullptr,
                          rope ? rope->sin.data<float>() : nullptr, pos0, S,
                          cache.k.data<float>(), cache.v.data<float>(), out);
}

namespace {

// Context parallelism (ops::ContextDims): `local` = the rank's tokens as a
// sequence of their own (the split into heads, the merge back into rows);
// otherwise the rank's queries against the whole sequence's keys.
// The positions stay on the device: a table as long as the sequence covers them.
AttentionShape context_shape(const ops::ContextDims& d, const ops::RopeTable* rope, bool local) {
  ops::check_context_dims(d, rope);
  MESHTRAIN_CHECK(d.head_dim % 2 == 0, "context attention: head_dim {} is odd", d.head_dim);
  MESHTRAIN_CHECK(rope == nullptr || d.seq() <= rope->max_seq,
                  "context attention: rope table of {} positions for a sequence of {}",
                  rope ? rope->max_seq : 0, d.seq());
  AttentionShape a{d.batch,   local ? d.local_seq : d.seq(), d.n_heads, d.n_kv_heads,
                   d.head_dim, 0, d.positions, 1.0f / std::sqrt(static_cast<float>(d.head_dim))};
  if (!local) {
    a.queries = d.local_seq;
    a.cp_rank = d.split.rank;
    a.cp_size = d.split.size;
  }
  return a;
}

const float* cos_of(const ops::RopeTable* rope) { return rope ? rope->cos.data<float>() : nullptr; }
const float* sin_of(const ops::RopeTable* rope) { return rope ? rope->sin.data<float>() : nullptr; }

}  // namespace

// Keeps `t` when it has this shape and dtype on this device; allocates it otherwise.
void CudaBackend::ensure(Tensor& t, const Shape& shape, DType dtype, MemCategory category) {
  if (t.defined() && t.shape() == shape && t.dtype() == dtype && t.device() == device()) return;
  t = Tensor();
  t = allocate(shape, dtype, category);
}

void CudaBackend::ensure_saved(ops::AttentionSaved& saved, const Shape& kv, const Shape& probs,
                               DType compute) {
  ensure(saved.k, kv, compute, MemCategory::activations);
  ensure(saved.v, kv, compute, MemCategory::activations);
  if (saved.recompute_probs || probs.empty()) {
    saved.probs = Tensor();
  } else {
    ensure(saved.probs, probs, compute, MemCategory::activations);
  }
}

void CudaBackend::context_attention_project(const ops::ContextDims& dims,
                                            const ops::RopeTable* rope, DType compute,
                                            const float* qkv, ops::AttentionSaved& saved,
                                            void* kv_send) {
  const AttentionShape a = context_shape(dims, rope, true);
  const int64_t B = dims.batch, L = dims.local_seq, H = dims.n_heads, KV = dims.n_kv_heads;
  const int64_t D = dims.head_dim;
  ensure(saved.q, {B, H, L, D}, compute, MemCategory::activations);
  launch_attention_split(impl_->stream, a, qkv, cos_of(rope), sin_of(rope), elem(compute),
                         saved.q.raw(), kv_send,
                         bytes_of(kv_send, B * KV * L * D, compute));
}

void CudaBackend::context_attention_forward(const ops::ContextDims& dims, DType compute,
                                            const void* kv_all, ops::AttentionSaved& saved,
                                            void* out) {
  const AttentionShape a = context_shape(dims, nullptr, false);
  const int64_t B = dims.batch, L = dims.local_seq, H = dims.n_heads, KV = dims.n_kv_heads;
  const int64_t D = dims.head_dim, T = dims.seq();
  MESHTRAIN_CHECK(saved.q.defined() && saved.q.dtype() == compute && saved.q.numel() == B * H * L * D,
                  "context attention: run project first (saved q does not match)");
  require_shared(attention_shared_bytes(a), "context attention", T);
  ensure_saved(saved, {B, KV, T, D}, {B, H, L, T}, compute);
  launch_context_rows(impl_->stream, B * KV, L, D, dims.split.size, dtype_size(compute),
                      const_cast<void*>(kv_all), saved.k.raw(), saved.v.raw(), true);
  launch_attention_forward(impl_->stream, a, elem(compute), saved.q.raw(), saved.k.raw(),
                           saved.v.raw(), saved.probs.defined() ? saved.probs.raw() : nullptr,
                           out);
}

void CudaBackend::context_attention_backward(const ops::ContextDims& dims,
                                             const ops::RopeTable* rope, DType compute,
                                             const ops::AttentionSaved& saved, const float* d_out,
                                             void* d_qkv, float* dkv_all) {
  const AttentionShape a = context_shape(dims, rope, false);
  const int64_t B = dims.batch, L = dims.local_seq, H = dims.n_heads, KV = dims.n_kv_heads;
  const int64_t D = dims.head_dim;
  const AttentionGrads g = reference_backward(a, compute, saved, d_out);
  // dQ into the q columns (rotated back); the k and v columns are finish's.
  launch_attention_merge(impl_->stream, context_shape(dims, rope, true), g.dq.data<float>(),
                         nullptr, nullptr, cos_of(rope), sin_of(rope), elem(compute), d_qkv, 0, H);
  launch_context_rows(impl_->stream, B * KV, L, D, dims.split.size, sizeof(float), dkv_all,
                      g.dk.data<float>(), g.dv.data<float>(), false);
}

void CudaBackend::context_attention_finish(const ops::ContextDims& dims,
                                           const ops::RopeTable* rope, DType compute,
                                           const float* dkv, const float* dq, void* d_qkv) {
  const AttentionShape a = context_shape(dims, rope, true);
  launch_attention_merge(impl_->stream, a, dq, dkv, dkv + dims.kv_block() / 2, cos_of(rope),
                         sin_of(rope), elem(compute), d_qkv, dq != nullptr ? 0 : dims.n_heads);
}

// Ulysses' layouts: ops.h's copy lists, each copy one cudaMemcpy2DAsync on the stream.
void CudaBackend::run_copies(const ops::CopyPlan& plan) {
  const auto* from = static_cast<const char*>(plan.src);
  auto* to = static_cast<char*>(plan.dst);
  for (const ops::Copy2D& c : plan.copies) {
    check(cudaMemcpy2DAsync(to + c.dst_offset, static_cast<size_t>(c.dst_pitch),
                            from + c.src_offset, static_cast<size_t>(c.src_pitch),
                            static_cast<size_t>(c.bytes), static_cast<size_t>(c.rows),
                            cudaMemcpyDeviceToDevice, impl_->stream),
          "cudaMemcpy2DAsync");
  }
}

void CudaBackend::head_groups(const ops::HeadGroups& g, DType dtype, const void* rows,
                              void* groups, bool to_groups) {
  run_copies(ops::head_group_copies(g, dtype, rows, groups, to_groups));
}

void CudaBackend::context_sequence(const ops::ContextDims& dims, int64_t width, DType dtype,
                                   const void* by_rank, void* sequence, bool to_sequence) {
  run_copies(ops::context_sequence_copies(dims, width, dtype, by_rank, sequence, to_sequence));
}

void CudaBackend::ring_attention_forward_block(const ops::ContextDims& dims, DType compute,
                                               int64_t block_rank, const void* kv_block,
                                               const ops::AttentionSaved& saved,
                                               ops::RingState& state, bool first) {
  const AttentionShape a = context_shape(dims, nullptr, false);
  const int64_t B = dims.batch, L = dims.local_seq, H = dims.n_heads, D = dims.head_dim;
  MESHTRAIN_CHECK(saved.q.defined() && saved.q.dtype() == compute && saved.q.numel() == B * H * L * D,
                  "ring attention: run project first (saved q does not match)");
  MESHTRAIN_CHECK(block_rank >= 0 && block_rank < dims.split.size, "ring attention: block {} of {}",
                  block_rank, dims.split.size);
  require_shared(static_cast<size_t>(L + D) * sizeof(float), "ring attention", L);
  if (first) {
    ensure(state.max, {B, H, L}, DType::f32, MemCategory::workspace);
    ensure(state.sum, {B, H, L}, DType::f32, MemCategory::workspace);
    ensure(state.acc, {B, H, L, D}, DType::f32, MemCategory::workspace);
  }
  launch_ring_forward_block(impl_->stream, a, block_rank, elem(compute), saved.q.raw(), kv_block,
                            bytes_of(kv_block, dims.kv_block() / 2, compute),
                            state.max.data<float>(), state.sum.data<float>(),
                            state.acc.data<float>(), first);
}

void CudaBackend::ring_attention_forward_finish(const ops::ContextDims& dims, DType compute,
                                                ops::RingState& state, ops::AttentionSaved& saved,
                                                void* out) {
  const AttentionShape a = context_shape(dims, nullptr, false);
  ensure(saved.lse, {dims.batch, dims.n_heads, dims.local_seq}, DType::f32,
         MemCategory::activations);
  launch_ring_forward_finish(impl_->stream, a, elem(compute), state.max.data<float>(),
                             state.sum.data<float>(), state.acc.data<float>(), out,
                             saved.lse.data<float>());
}

void CudaBackend::ring_attention_backward_block(const ops::ContextDims& dims, DType compute,
                                                int64_t block_rank, const void* kv_block,
                                                const ops::AttentionSaved& saved,
                                                const float* d_out, const void* out, float* dq,
                                                float* dkv_block) {
  const AttentionShape a = context_shape(dims, nullptr, false);
  const int64_t B = dims.batch, L = dims.local_seq, H = dims.n_heads, D = dims.head_dim;
  MESHTRAIN_CHECK(saved.lse.defined() && saved.lse.numel() == B * H * L && saved.q.dtype() == compute,
                  "ring attention backward: saved tensors do not match dims/compute dtype");
  MESHTRAIN_CHECK(block_rank >= 0 && block_rank < dims.split.size, "ring attention: block {} of {}",
                  block_rank, dims.split.size);
  require_shared(static_cast<size_t>(L + 2 * D) * sizeof(float), "ring attention", L);
  const int64_t tile = ring_backward_tile(a);
  Tensor p = allocate({B, H, tile, L}, DType::f32, MemCategory::workspace);
  Tensor ds = allocate({B, H, tile, L}, DType::f32, MemCategory::workspace);
  const int64_t half = dims.kv_block() / 2;
  launch_ring_backward_block(impl_->stream, a, block_rank, elem(compute), saved.q.raw(), kv_block,
                             bytes_of(kv_block, half, compute), saved.lse.data<float>(), d_out,
                             out, p.data<float>(), ds.data<float>(), dq, dkv_block,
                             dkv_block + half);
}

// ---- embeddings
void CudaBackend::embedding_forward(const ops::EmbeddingDims& dims, const void* table,
                                    DType table_dtype, const float* positions, const int32_t* ids,
                                    float* out) {
  const EmbeddingShape e{dims.batch,       dims.seq,       dims.dim,    dims.pos0,
                         dims.vocab_begin, dims.vocab_end, dims.pos_ids};
  launch_embedding_forward(impl_->stream, e, table, elem(table_dtype), positions, ids, out);
}

namespace {

// Tokens grouped by the row each adds to (a stable counting sort on the
// host): order, starts [groups + 1], rows [groups].
struct RowGroups {
  std::vector<int32_t> order, starts, rows;
};

RowGroups group_rows(const std::vector<int64_t>& row_of) {
  RowGroups g;
  std::vector<std::pair<int64_t, int32_t>> keyed;
  for (size_t i = 0; i < row_of.size(); ++i) {
    if (row_of[i] >= 0) keyed.emplace_back(row_of[i], static_cast<int32_t>(i));
  }
  std::stable_sort(keyed.begin(), keyed.end(),
                   [](const auto& x, const auto& y) { return x.first < y.first; });
  for (size_t k = 0; k < keyed.size(); ++k) {
    if (k == 0 || keyed[k].first != keyed[k - 1].first) {
      g.starts.push_back(static_cast<int32_t>(k));
      g.rows.push_back(static_cast<int32_t>(keyed[k].first));
    }
    g.order.push_back(keyed[k].second);
  }
  g.starts.push_back(static_cast<int32_t>(keyed.size()));
  return g;
}

}  // namespace

void CudaBackend::embedding_backward(const ops::EmbeddingDims& dims, const int32_t* ids,
                                     const float* dout, float* dtable, float* dpositions) {
  const int64_t n = dims.batch * dims.seq;
  if (n == 0) return;
  std::vector<int32_t> host_ids(static_cast<size_t>(n)), host_pos;
  check(cudaMemcpyAsync(host_ids.data(), ids, host_ids.size() * sizeof(int32_t),
                        cudaMemcpyDeviceToHost, impl_->stream),
        "cudaMemcpyAsync ids");
  if (dpositions != nullptr && dims.pos_ids != nullptr) {
    host_pos.resize(static_cast<size_t>(n));
    check(cudaMemcpyAsync(host_pos.data(), dims.pos_ids, host_pos.size() * sizeof(int32_t),
                          cudaMemcpyDeviceToHost, impl_->stream),
          "cudaMemcpyAsync positions");
  }
  synchronize();
  auto add = [&](const std::vector<int64_t>& row_of, float* table) {
    const RowGroups g = group_rows(row_of);
    if (g.rows.empty()) return;
    auto upload = [&](const std::vector<int32_t>& v) {
      Tensor t = allocate({static_cast<int64_t>(v.size())}, DType::i32, MemCategory::workspace);
      copy_from_host(v.data(), t);
      return t;
    };
    const Tensor order = upload(g.order), starts = upload(g.starts), rows = upload(g.rows);
    launch_add_rows(impl_->stream, order.data<int32_t>(), starts.data<int32_t>(),
                    rows.data<int32_t>(), static_cast<int64_t>(g.rows.size()), dout, dims.dim,
                    table);
    synchronize();  // the index tensors go away here
  };
  std::vector<int64_t> row_of(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t id = host_ids[static_cast<size_t>(i)];
    row_of[static_cast<size_t>(i)] = dims.holds(id) ? id - dims.vocab_begin : -1;
  }
  add(row_of, dtable);
  if (dpositions != nullptr) {
    for (int64_t i = 0; i < n; ++i) {
      row_of[static_cast<size_t>(i)] =
          host_pos.empty() ? dims.pos0 + i % dims.seq : host_pos[static_cast<size_t>(i)];
    }
    add(row_of, dpositions);
  }
}

// ---- the fused classifier
double CudaBackend::fused_classifier(const ops::ClassifierArgs& args) {
  const int64_t rows = args.rows, dim = args.dim, V = args.vocab;
  const int64_t valid = args.vocab_valid < 0 ? V : args.vocab_valid;
  MESHTRAIN_CHECK(rows >= 0 && dim > 0 && V > 0 && valid <= V && args.vocab_offset >= 0,
                  "fused_classifier: bad dims rows={} dim={} vocab={} (valid {})", rows, dim, V,
                  valid);
  // Vocabulary parallel: each row's max, exp-sum and target logit combined
  // over the slices through the callbacks (on device memory) between kernels.
  const bool parallel = args.reduce_max || args.reduce_sum;
  if (rows == 0) return 0.0;
  const int64_t chunk = std::min(rows, args.chunk_rows > 0 ? args.chunk_rows : kClassifierRows);
  const bool backward = args.dh != nullptr || args.dw != nullptr;
  const DType compute = args.compute;
  Tensor logits = allocate({chunk, V}, DType::f32, MemCategory::workspace);
  Tensor d_logits = backward ? allocate({chunk, V}, compute, MemCategory::workspace) : Tensor();
  Tensor losses = allocate({2 * chunk}, DType::f32, MemCategory::workspace);  // chunk doubles
  Tensor stats = parallel ? allocate({3 * chunk}, DType::f32, MemCategory::workspace) : Tensor();
  std::vector<double> host(static_cast<size_t>(chunk));
  std::vector<float> row_losses;
  double total = 0.0;
  for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
    const int64_t n = std::min(chunk, rows - r0);
    const void* h = bytes_of(args.h, r0 * dim, compute);
    matmul({1, n, V, dim, false, true, false}, compute, h, args.w, DType::f32, logits.raw(), 1.0f,
           false, nullptr);
    ClassifierRows c;
    c.rows = n;
    c.ld = V;
    c.valid = valid;
    c.offset = args.vocab_offset;
    c.targets = args.targets + r0;
    c.grad_scale = args.grad_scale;
    c.row_weights = args.row_weights != nullptr ? args.row_weights + r0 : nullptr;
    if (parallel) {  // stats: max [n] | exp-sums [n] | target logits [n]
      float* s = stats.data<float>();
      launch_classifier_stats(impl_->stream, c, logits.data<float>(), s, false);
      if (args.reduce_max) args.reduce_max(s, n);
      launch_classifier_stats(impl_->stream, c, logits.data<float>(), s, true);
      if (args.reduce_sum) args.reduce_sum(s + n, 2 * n);
      c.stats = s;
    }
    auto* loss = static_cast<double*>(losses.raw());
    launch_classifier_rows(impl_->stream, c, logits.data<float>(), loss, elem(compute),
                           backward ? d_logits.raw() : nullptr);
    if (args.dh != nullptr) {
      matmul({1, n, dim, V, false, false, false}, compute, d_logits.raw(), args.w, DType::f32,
             args.dh + r0 * dim, 1.0f, false, nullptr);
    }
    if (args.dw != nullptr) {
      matmul({1, V, dim, n, true, false, false}, compute, d_logits.raw(), h, DType::f32, args.dw,
             1.0f, true, nullptr);
    }
    check(cudaMemcpyAsync(host.data(), loss, static_cast<size_t>(n) * sizeof(double),
                          cudaMemcpyDeviceToHost, impl_->stream),
          "cudaMemcpyAsync losses");
    synchronize();
    for (int64_t r = 0; r < n; ++r) total += host[static_cast<size_t>(r)];
    if (args.row_losses != nullptr) {
      row_losses.assign(host.begin(), host.begin() + n);
      check(cudaMemcpyAsync(args.row_losses + r0, row_losses.data(),
                            static_cast<size_t>(n) * sizeof(float), cudaMemcpyHostToDevice,
                            impl_->stream),
            "cudaMemcpyAsync row losses");
      synchronize();
    }
  }
  return total;
}

// ---- quantised weights and mixtures of experts
void CudaBackend::dequantize_nf4(const void* packed, int64_t n, DType to, void* y,
                                 nf4::Form form) {
  static const Nf4Tables tables = [] {
    Nf4Tables t{};
    std::copy(nf4::levels().begin(), nf4::levels().end(), t.levels);
    std::copy(nf4::dynamic_map().begin(), nf4::dynamic_map().end(), t.dynamic);
    return t;
  }();
  const nf4::Layout l = nf4::layout(n, form);
  const Nf4Layout layout{l.n, l.scales_at, l.offset_at, l.codes_at, l.absmax_at, l.packed_at};
  launch_dequantize_nf4(impl_->stream, tables, layout, packed, elem(to), y);
}

namespace {

routing::Params router_params(const ops::RouterDims& d) {
  ops::check_router(d);
  MESHTRAIN_CHECK(d.experts <= kMaxExperts,
                  "train.device = \"cuda\": the router takes at most {} experts, not {}",
                  kMaxExperts, d.experts);
  return {d.experts, d.top_k, d.n_groups, d.topk_groups, d.score == ops::RouterScore::softmax,
          d.renormalize, d.scaling, d.bias};
}

}  // namespace

void CudaBackend::router_forward(const ops::RouterDims& dims, const float* logits, float* probs,
                                 int32_t* indices, float* weights, float* lse) {
  launch_router_forward(impl_->stream, router_params(dims), dims.tokens, logits, probs, indices,
                        weights, lse);
}

void CudaBackend::router_backward(const ops::RouterDims& dims, const float* probs,
                                  const int32_t* indices, const float* d_weights,
                                  const ops::RouterAuxGrad& aux, float* d_logits) {
  launch_router_backward(impl_->stream, router_params(dims), dims.tokens, probs, indices,
                         d_weights, aux.score_grad, aux.z, aux.lse, d_logits);
}

namespace {

template <typename T>
std::vector<T> to_host(cudaStream_t stream, const T* device, int64_t n) {
  std::vector<T> host(static_cast<size_t>(n));
  if (n > 0) {
    check(cudaMemcpyAsync(host.data(), device, host.size() * sizeof(T), cudaMemcpyDeviceToHost,
                          stream),
          "cudaMemcpyAsync to host");
    check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  }
  return host;
}

template <typename T>
void to_device(cudaStream_t stream, const std::vector<T>& host, T* device) {
  if (host.empty()) return;
  check(cudaMemcpyAsync(device, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice,
                        stream),
        "cudaMemcpyAsync from host");
  check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");  // host goes away on return
}

}  // namespace

// The sort and the capacity are integer bookkeeping over tokens x top_k
// values: done on the host by the code every backend shares (ops.h), the
// indices copied in and the result out.
void CudaBackend::moe_sort(const ops::DispatchDims& dims, const int32_t* indices, int32_t* slots,
                           int32_t* rows, int32_t* counts) {
  const std::vector<int32_t> idx = to_host(impl_->stream, indices, dims.slots());
  std::vector<int32_t> s(idx.size()), r(idx.size()), c(static_cast<size_t>(dims.experts));
  ops::sort_slots(dims, idx.data(), s.data(), r.data(), c.data());
  to_device(impl_->stream, s, slots);
  to_device(impl_->stream, r, rows);
  to_device(impl_->stream, c, counts);
}

void CudaBackend::moe_capacity(const ops::DispatchDims& dims, int64_t capacity,
                               const float* weights, const int32_t* counts, int32_t* slots,
                               int32_t* rows, int32_t* kept) {
  const std::vector<float> w = to_host(impl_->stream, weights, dims.slots());
  const std::vector<int32_t> c = to_host(impl_->stream, counts, dims.experts);
  std::vector<int32_t> s = to_host(impl_->stream, slots, dims.slots());
  std::vector<int32_t> r(s.size()), k(c.size());
  ops::apply_capacity(dims, capacity, w.data(), c.data(), s.data(), r.data(), k.data());
  to_device(impl_->stream, s, slots);
  to_device(impl_->stream, r, rows);
  to_device(impl_->stream, k, kept);
}

void CudaBackend::moe_permute(const ops::DispatchDims& dims, const int32_t* slots, const float* x,
                              DType out_dtype, void* out) {
  launch_moe_permute(impl_->stream, dims.slots(), dims.top_k, dims.dim, slots, x, elem(out_dtype),
                     out);
}

void CudaBackend::moe_permute_backward(const ops::DispatchDims& dims, const int32_t* rows,
                                       const float* d_out, float* dx) {
  launch_moe_gather_sum(impl_->stream, dims.tokens, dims.top_k, dims.dim, rows, nullptr, d_out, dx);
}

void CudaBackend::moe_combine(const ops::DispatchDims& dims, const int32_t* rows,
                              const float* weights, const float* y, float* out) {
  launch_moe_gather_sum(impl_->stream, dims.tokens, dims.top_k, dims.dim, rows, weights, y, out);
}

void CudaBackend::moe_combine_backward(const ops::DispatchDims& dims, const int32_t* rows,
                                       const float* weights, const float* y, const float* d_out,
                                       DType grad_dtype, void* d_y, float* d_weights) {
  launch_moe_combine_backward(impl_->stream, dims.tokens, dims.top_k, dims.dim, rows, weights, y,
                              d_out, elem(grad_dtype), d_y, d_weights);
}

// ---- optimizer
void CudaBackend::adamw_update(const ops::AdamWHyper& hyper, float* param, float* grad,
                               float* m, float* v, ops::ComputeCopy compute, int64_t n) {
  const math::AdamWStep step = math::adamw_step(hyper.lr, hyper.beta1, hyper.beta2, hyper.eps,
                                                hyper.weight_decay, hyper.step, hyper.grad_scale);
  launch_adamw(impl_->stream, step, param, grad, hyper.clear_grad, m, v,
               compute.data != nullptr ? elem(compute.dtype) : Elem::f32, compute.data, n);
}

double CudaBackend::sum_squares(const float* x, int64_t n) {
  const int64_t partials = sum_squares_partials(n);
  Tensor work = allocate({2 * (partials + 1)}, DType::f32, MemCategory::workspace);  // doubles
  auto* d = static_cast<double*>(work.raw());
  launch_sum_squares(impl_->stream, x, n, d, d + partials);
  double total = 0.0;
  check(cudaMemcpyAsync(&total, d + partials, sizeof total, cudaMemcpyDeviceToHost, impl_->stream),
        "cudaMemcpyAsync sum of squares");
  synchronize();
  return total;
}

}  // namespace meshtrain::cuda
