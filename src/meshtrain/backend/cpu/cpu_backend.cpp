#include "meshtrain/backend/cpu/cpu_backend.h"

#include <cstring>
#include <fstream>
#include <string>

#include "meshtrain/backend/cpu/activation.h"
#include "meshtrain/backend/cpu/adamw.h"
#include "meshtrain/backend/cpu/attention.h"
#include "meshtrain/backend/cpu/bandwidth.h"
#include "meshtrain/backend/cpu/cross_entropy.h"
#include "meshtrain/backend/cpu/dispatch.h"
#include "meshtrain/backend/cpu/embedding.h"
#include "meshtrain/backend/cpu/matmul.h"
#include "meshtrain/backend/cpu/norm.h"
#include "meshtrain/backend/cpu/quant.h"
#include "meshtrain/backend/cpu/router.h"
#include "meshtrain/util/error.h"

namespace meshtrain::cpu {

CpuBackend::CpuBackend(int threads, MemoryTracker& tracker)
    : Backend(tracker), ctx_(threads, tracker) {}

std::string CpuBackend::device_name() const {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("model name", 0) == 0 && line.find(':') != std::string::npos) {
      return line.substr(line.find(':') + 2);
    }
  }
  return "unknown CPU";
}

Tensor CpuBackend::allocate(Shape shape, DType dtype, MemCategory category) {
  return Tensor(std::move(shape), dtype, category, tracker());
}

void CpuBackend::copy_to_host(const Tensor& src, void* dst) {
  MESHTRAIN_CHECK(src.device().is_host(), "cpu backend: copy_to_host of a {} tensor",
                  src.device().str());
  std::memcpy(dst, src.raw(), src.bytes());
}

void CpuBackend::copy_from_host(const void* src, const Tensor& dst) {
  MESHTRAIN_CHECK(dst.device().is_host(), "cpu backend: copy_from_host into a {} tensor",
                  dst.device().str());
  std::memcpy(dst.raw(), src, dst.bytes());
}

void CpuBackend::matmul(const ops::MatmulDims& dims, DType ab, const void* a, const void* b,
                        DType c_dtype, void* c, float alpha, bool accumulate, const float* bias) {
  cpu::matmul(ctx_, dims, ab, a, b, c_dtype, c, alpha, accumulate, bias);
}

void CpuBackend::grouped_matmul(const ops::GroupedMatmulDims& dims, DType ab, const void* a,
                                const void* b, DType c_dtype, void* c, float alpha,
                                bool accumulate) {
  cpu::grouped_matmul(ctx_, dims, ab, a, b, c_dtype, c, alpha, accumulate);
}

double CpuBackend::measure_matmul_peak_flops(DType ab, double seconds) {
  return cpu::measure_matmul_peak_flops(ctx_, ab, seconds);
}

double CpuBackend::measure_copy_bandwidth(size_t bytes, double seconds) {
  return cpu::measure_copy_bandwidth(ctx_, bytes, seconds);
}

void CpuBackend::rmsnorm_forward(const float* x, const float* w, DType out_dtype, void* y,
                                 float* rstd, int64_t rows, int64_t dim, float eps) {
  cpu::rmsnorm_forward(x, w, out_dtype, y, rstd, rows, dim, eps);
}

void CpuBackend::rmsnorm_backward(const float* x, const float* w, const float* rstd,
                                  const float* dy, float* dx, float* dw, int64_t rows,
                                  int64_t dim) {
  cpu::rmsnorm_backward(x, w, rstd, dy, dx, dw, rows, dim);
}

void CpuBackend::layernorm_forward(const float* x, const float* w, const float* b, DType out_dtype,
                                   void* y, float* mean, float* rstd, int64_t rows, int64_t dim,
                                   float eps) {
  cpu::layernorm_forward(x, w, b, out_dtype, y, mean, rstd, rows, dim, eps);
}

void CpuBackend::layernorm_backward(const float* x, const float* w, const float* mean,
                                    const float* rstd, const float* dy, float* dx, float* dw,
                                    float* db, int64_t rows, int64_t dim) {
  cpu::layernorm_backward(x, w, mean, rstd, dy, dx, dw, db, rows, dim);
}

void CpuBackend::group_rmsnorm_forward(const ops::GroupNormDims& dims, float* x, const float* w,
                                       float* saved, float* rstd) {
  cpu::group_rmsnorm_forward(dims, x, w, saved, rstd);
}

void CpuBackend::group_rmsnorm_backward(const ops::GroupNormDims& dims, const float* saved,
                                        const float* w, const float* rstd, DType grad_dtype,
                                        void* dy, float* dw) {
  cpu::group_rmsnorm_backward(dims, saved, w, rstd, grad_dtype, dy, dw);
}

void CpuBackend::swiglu_forward(const float* gate_up, DType out_dtype, void* out, int64_t rows,
                                int64_t hidden) {
  cpu::swiglu_forward(gate_up, out_dtype, out, rows, hidden);
}

void CpuBackend::swiglu_backward(const float* gate_up, const float* d_out, DType grad_dtype,
                                 void* d_gate_up, int64_t rows, int64_t hidden) {
  cpu::swiglu_backward(gate_up, d_out, grad_dtype, d_gate_up, rows, hidden);
}

void CpuBackend::gelu_forward(const float* x, DType out_dtype, void* y, int64_t n) {
  cpu::gelu_forward(x, out_dtype, y, n);
}

void CpuBackend::gelu_backward(const float* x, const float* dy, DType grad_dtype, void* dx,
                               int64_t n) {
  cpu::gelu_backward(x, dy, grad_dtype, dx, n);
}

void CpuBackend::add_inplace(float* x, const float* y, int64_t n) { cpu::add_inplace(x, y, n); }

void CpuBackend::mul_inplace(float* x, const float* y, int64_t n) { cpu::mul_inplace(x, y, n); }

void CpuBackend::add_product(float* x, const float* a, const float* b, int64_t n) {
  cpu::add_product(x, a, b, n);
}

void CpuBackend::residual_add(const float* residual, const float* y, const float* bias, float* out,
                              int64_t rows, int64_t n) {
  cpu::residual_add(residual, y, bias, out, rows, n);
}

void CpuBackend::residual_add_norm(const float* residual, const float* y, const float* bias,
                                   float* sum, const ops::NormArgs& norm, DType out_dtype,
                                   void* out, int64_t rows, int64_t n) {
  cpu::residual_add_norm(residual, y, bias, sum, norm, out_dtype, out, rows, n);
}

void CpuBackend::convert(DType from, const void* src, DType to, void* dst, int64_t n) {
  meshtrain::convert(from, src, to, dst, static_cast<size_t>(n));
}

void CpuBackend::bias_backward(const float* dy, float* dbias, int64_t rows, int64_t n) {
  cpu::bias_backward(dy, dbias, rows, n);
}

ops::RopeTable CpuBackend::make_rope_table(int64_t head_dim, int64_t max_seq,
                                           std::span<const float> inv_freq) {
  return cpu::make_rope_table(head_dim, max_seq, inv_freq, tracker());
}

void CpuBackend::attention_forward(const ops::AttentionDims& dims, const ops::RopeTable* rope,
                                   DType compute, const float* qkv, void* out,
                                   ops::AttentionSaved& saved) {
  cpu::attention_forward(ctx_, dims, rope, compute, qkv, out, saved);
}

void CpuBackend::attention_backward(const ops::AttentionDims& dims, const ops::RopeTable* rope,
                                    DType compute, const ops::AttentionSaved& saved,
                                    const float* d_out, void* d_qkv) {
  cpu::attention_backward(ctx_, dims, rope, compute, saved, d_out, d_qkv);
}

void CpuBackend::attention_decode(const ops::AttentionDims& dims, const ops::RopeTable* rope,
                                  const float* qkv, int64_t pos0, ops::KVCacheLayer& cache,
                                  float* out) {
  cpu::attention_decode(ctx_, dims, rope, qkv, pos0, cache, out);
}

void CpuBackend::context_attention_project(const ops::ContextDims& dims,
                                           const ops::RopeTable* rope, DType compute,
                                           const float* qkv, ops::AttentionSaved& saved,
                                           void* kv_send) {
  cpu::context_attention_project(ctx_, dims, rope, compute, qkv, saved, kv_send);
}

void CpuBackend::context_attention_forward(const ops::ContextDims& dims, DType compute,
                                           const void* kv_all, ops::AttentionSaved& saved,
                                           void* out) {
  cpu::context_attention_forward(ctx_, dims, compute, kv_all, saved, out);
}

void CpuBackend::context_attention_backward(const ops::ContextDims& dims,
                                            const ops::RopeTable* rope, DType compute,
                                            const ops::AttentionSaved& saved, const float* d_out,
                                            void* d_qkv, float* dkv_all) {
  cpu::context_attention_backward(ctx_, dims, rope, compute, saved, d_out, d_qkv, dkv_all);
}

void CpuBackend::context_attention_finish(const ops::ContextDims& dims,
                                          const ops::RopeTable* rope, DType compute,
                                          const float* dkv, const float* dq, void* d_qkv) {
  cpu::context_attention_finish(ctx_, dims, rope, compute, dkv, dq, d_qkv);
}

namespace {

void run_copies(const ops::CopyPlan& plan) {
  const auto* from = static_cast<const char*>(plan.src);
  auto* to = static_cast<char*>(plan.dst);
  for (const ops::Copy2D& c : plan.copies) {
#pragma omp parallel for schedule(static) if (c.rows > 64)
    for (int64_t r = 0; r < c.rows; ++r) {
      std::memcpy(to + c.dst_offset + r * c.dst_pitch, from + c.src_offset + r * c.src_pitch,
                  static_cast<size_t>(c.bytes));
    }
  }
}

}  // namespace

void CpuBackend::head_groups(const ops::HeadGroups& g, DType dtype, const void* rows, void* groups,
                             bool to_groups) {
  run_copies(ops::head_group_copies(g, dtype, rows, groups, to_groups));
}

void CpuBackend::context_sequence(const ops::ContextDims& dims, int64_t width, DType dtype,
                                  const void* by_rank, void* sequence, bool to_sequence) {
  run_copies(ops::context_sequence_copies(dims, width, dtype, by_rank, sequence, to_sequence));
}

void CpuBackend::ring_attention_forward_block(const ops::ContextDims& dims, DType compute,
                                              int64_t block_rank, const void* kv_block,
                                              const ops::AttentionSaved& saved,
                                              ops::RingState& state, bool first) {
  cpu::ring_attention_forward_block(ctx_, dims, compute, block_rank, kv_block, saved, state, first);
}

void CpuBackend::ring_attention_forward_finish(const ops::ContextDims& dims, DType compute,
                                               ops::RingState& state, ops::AttentionSaved& saved,
                                               void* out) {
  cpu::ring_attention_forward_finish(ctx_, dims, compute, state, saved, out);
}

void CpuBackend::ring_attention_backward_block(const ops::ContextDims& dims, DType compute,
                                               int64_t block_rank, const void* kv_block,
                                               const ops::AttentionSaved& saved,
                                               const float* d_out, const void* out, float* dq,
                                               float* dkv_block) {
  cpu::ring_attention_backward_block(ctx_, dims, compute, block_rank, kv_block, saved, d_out, out,
                                     dq, dkv_block);
}

void CpuBackend::embedding_forward(const ops::EmbeddingDims& dims, const void* table,
                                   DType table_dtype, const float* positions, const int32_t* ids,
                                   float* out) {
  cpu::embedding_forward(dims, table, table_dtype, positions, ids, out);
}

void CpuBackend::embedding_backward(const ops::EmbeddingDims& dims, const int32_t* ids,
                                    const float* dout, float* dtable, float* dpositions) {
  cpu::embedding_backward(dims, ids, dout, dtable, dpositions);
}

double CpuBackend::fused_classifier(const ops::ClassifierArgs& args) {
  return cpu::fused_classifier(ctx_, args);
}

void CpuBackend::dequantize_nf4(const void* packed, int64_t n, DType to, void* y,
                                nf4::Form form) {
  cpu::dequantize_nf4(static_cast<const uint8_t*>(packed), n, to, y, form);
}

void CpuBackend::router_forward(const ops::RouterDims& dims, const float* logits, float* probs,
                                int32_t* indices, float* weights, float* lse) {
  cpu::router_forward(dims, logits, probs, indices, weights, lse);
}

void CpuBackend::router_backward(const ops::RouterDims& dims, const float* probs,
                                 const int32_t* indices, const float* d_weights,
                                 const ops::RouterAuxGrad& aux, float* d_logits) {
  cpu::router_backward(dims, probs, indices, d_weights, aux, d_logits);
}

void CpuBackend::moe_capacity(const ops::DispatchDims& dims, int64_t capacity,
                              const float* weights, const int32_t* counts, int32_t* slots,
                              int32_t* rows, int32_t* kept) {
  cpu::moe_capacity(dims, capacity, weights, counts, slots, rows, kept);
}

void CpuBackend::moe_sort(const ops::DispatchDims& dims, const int32_t* indices, int32_t* slots,
                          int32_t* rows, int32_t* counts) {
  cpu::moe_sort(dims, indices, slots, rows, counts);
}

void CpuBackend::moe_permute(const ops::DispatchDims& dims, const int32_t* slots, const float* x,
                             DType out_dtype, void* out) {
  cpu::moe_permute(dims, slots, x, out_dtype, out);
}

void CpuBackend::moe_permute_backward(const ops::DispatchDims& dims, const int32_t* rows,
                                      const float* d_out, float* dx) {
  cpu::moe_permute_backward(dims, rows, d_out, dx);
}

void CpuBackend::moe_combine(const ops::DispatchDims& dims, const int32_t* rows,
                             const float* weights, const float* y, float* out) {
  cpu::moe_combine(dims, rows, weights, y, out);
}

void CpuBackend::moe_combine_backward(const ops::DispatchDims& dims, const int32_t* rows,
                                      const float* weights, const float* y, const float* d_out,
                                      DType grad_dtype, void* d_y, float* d_weights) {
  cpu::moe_combine_backward(dims, rows, weights, y, d_out, grad_dtype, d_y, d_weights);
}

void CpuBackend::adamw_update(const ops::AdamWHyper& hyper, float* param, float* grad,
                              float* m, float* v, ops::ComputeCopy compute, int64_t n) {
  cpu::adamw_update(hyper, param, grad, m, v, compute, n);
}

double CpuBackend::sum_squares(const float* x, int64_t n) { return cpu::sum_squares(x, n); }

}  // namespace meshtrain::cpu
