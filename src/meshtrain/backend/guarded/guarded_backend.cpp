#include "meshtrain/backend/guarded/guarded_backend.h"

#include <cstring>
#include <utility>

#include "meshtrain/backend/guarded/guarded_memory.h"
#include "meshtrain/util/error.h"

namespace meshtrain::guarded {

class GuardedBackend::Scope {
 public:
  Scope(const char* op, std::initializer_list<const void*> pointers) {
    int index = 0;
    for (const void* p : pointers) {
      MESHTRAIN_CHECK(p == nullptr || GuardedMemory::instance().contains(p),
                      "guarded backend: {} was given host memory at {} (its pointer argument "
                      "{}): operations take device tensors (Backend::allocate)",
                      op, p, index);
      ++index;
    }
  }

 private:
  GuardedMemory::Open open_;
};

GuardedBackend::GuardedBackend(std::unique_ptr<Backend> inner, MemoryTracker& tracker)
    : Backend(tracker), inner_(std::move(inner)) {}

Device GuardedBackend::device() const { return GuardedMemory::instance().device(); }

std::string GuardedBackend::device_name() const { return inner_->device_name() + " (guarded)"; }

int GuardedBackend::threads() const { return inner_->threads(); }

Tensor GuardedBackend::allocate(Shape shape, DType dtype, MemCategory category) {
  return Tensor(std::move(shape), dtype, category, tracker(), GuardedMemory::instance());
}

void GuardedBackend::copy_to_host(const Tensor& src, void* dst) {
  MESHTRAIN_CHECK(src.device() == device(), "guarded backend: copy_to_host of a {} tensor",
                  src.device().str());
  const Scope scope("copy_to_host", {src.raw()});
  std::memcpy(dst, src.raw(), src.bytes());
}

void GuardedBackend::copy_from_host(const void* src, const Tensor& dst) {
  MESHTRAIN_CHECK(dst.device() == device(), "guarded backend: copy_from_host into a {} tensor",
                  dst.device().str());
  const Scope scope("copy_from_host", {dst.raw()});
  std::memcpy(dst.raw(), src, dst.bytes());
}

void GuardedBackend::synchronize() { inner_->synchronize(); }

ops::RopeTable GuardedBackend::make_rope_table(int64_t head_dim, int64_t max_seq,
                                               std::span<const float> inv_freq) {
  ops::RopeTable host = inner_->make_rope_table(head_dim, max_seq, inv_freq);
  ops::RopeTable table = host;
  for (auto [from, to] : {std::pair{&host.cos, &table.cos}, std::pair{&host.sin, &table.sin}}) {
    *to = allocate(from->shape(), from->dtype(), MemCategory::workspace);  // as the CPU backend's
    copy_from_host(from->raw(), *to);
  }
  return table;
}

double GuardedBackend::fused_classifier(const ops::ClassifierArgs& args) {
  const Scope scope("fused_classifier", {args.h, args.w, args.targets, args.row_weights, args.dh,
                                         args.dw, args.row_losses});
  return inner_->fused_classifier(args);
}

void GuardedBackend::adamw_update(const ops::AdamWHyper& hyper, float* param, float* grad,
                                  float* m, float* v, ops::ComputeCopy compute, int64_t n) {
  const Scope scope("adamw_update", {param, grad, m, v, compute.data});
  inner_->adamw_update(hyper, param, grad, m, v, compute, n);
}

void GuardedBackend::router_backward(const ops::RouterDims& dims, const float* probs,
                                     const int32_t* indices, const float* d_weights,
                                     const ops::RouterAuxGrad& aux, float* d_logits) {
  const Scope scope("router_backward", {probs, indices, d_weights, aux.score_grad, aux.lse,
                                        d_logits});
  inner_->router_backward(dims, probs, indices, d_weights, aux, d_logits);
}

void GuardedBackend::matmul(const ops::MatmulDims& dims, DType ab, const void* a, const void* b, DType c_dtype, void* c, float alpha, bool accumulate, const float* bias) {
  const Scope scope("matmul", {a, b, c, bias});
  inner_->matmul(dims, ab, a, b, c_dtype, c, alpha, accumulate, bias);
}

void GuardedBackend::grouped_matmul(const ops::GroupedMatmulDims& dims, DType ab, const void* a, const void* b, DType c_dtype, void* c, float alpha, bool accumulate) {
  const Scope scope("grouped_matmul", {a, b, c});
  inner_->grouped_matmul(dims, ab, a, b, c_dtype, c, alpha, accumulate);
}

double GuardedBackend::measure_matmul_peak_flops(DType ab, double seconds) {
  const Scope scope("measure_matmul_peak_flops", {});
  return inner_->measure_matmul_peak_flops(ab, seconds);
}

double GuardedBackend::measure_copy_bandwidth(size_t bytes, double seconds) {
  const Scope scope("measure_copy_bandwidth", {});
  return inner_->measure_copy_bandwidth(bytes, seconds);
}

void GuardedBackend::rmsnorm_forward(const float* x, const float* w, DType out_dtype, void* y, float* rstd, int64_t rows, int64_t dim, float eps) {
  const Scope scope("rmsnorm_forward", {x, w, y, rstd});
  inner_->rmsnorm_forward(x, w, out_dtype, y, rstd, rows, dim, eps);
}

void GuardedBackend::rmsnorm_backward(const float* x, const float* w, const float* rstd, const float* dy, float* dx, float* dw, int64_t rows, int64_t dim) {
  const Scope scope("rmsnorm_backward", {x, w, rstd, dy, dx, dw});
  inner_->rmsnorm_backward(x, w, rstd, dy, dx, dw, rows, dim);
}

void GuardedBackend::layernorm_forward(const float* x, const float* w, const float* b, DType out_dtype, void* y, float* mean, float* rstd, int64_t rows, int64_t dim, float eps) {
  const Scope scope("layernorm_forward", {x, w, b, y, mean, rstd});
  inner_->layernorm_forward(x, w, b, out_dtype, y, mean, rstd, rows, dim, eps);
}

void GuardedBackend::layernorm_backward(const float* x, const float* w, const float* mean, const float* rstd, const float* dy, float* dx, float* dw, float* db, int64_t rows, int64_t dim) {
  const Scope scope("layernorm_backward", {x, w, mean, rstd, dy, dx, dw, db});
  inner_->layernorm_backward(x, w, mean, rstd, dy, dx, dw, db, rows, dim);
}

void GuardedBackend::group_rmsnorm_forward(const ops::GroupNormDims& dims, float* x, const float* w, float* saved, float* rstd) {
  const Scope scope("group_rmsnorm_forward", {x, w, saved, rstd});
  inner_->group_rmsnorm_forward(dims, x, w, saved, rstd);
}

void GuardedBackend::group_rmsnorm_backward(const ops::GroupNormDims& dims, const float* saved, const float* w, const float* rstd, DType grad_dtype, void* dy, float* dw) {
  const Scope scope("group_rmsnorm_backward", {saved, w, rstd, dy, dw});
  inner_->group_rmsnorm_backward(dims, saved, w, rstd, grad_dtype, dy, dw);
}

void GuardedBackend::swiglu_forward(const float* gate_up, DType out_dtype, void* out, int64_t rows, int64_t hidden) {
  const Scope scope("swiglu_forward", {gate_up, out});
  inner_->swiglu_forward(gate_up, out_dtype, out, rows, hidden);
}

void GuardedBackend::swiglu_backward(const float* gate_up, const float* d_out, DType grad_dtype, void* d_gate_up, int64_t rows, int64_t hidden) {
  const Scope scope("swiglu_backward", {gate_up, d_out, d_gate_up});
  inner_->swiglu_backward(gate_up, d_out, grad_dtype, d_gate_up, rows, hidden);
}

void GuardedBackend::gelu_forward(const float* x, DType out_dtype, void* y, int64_t n) {
  const Scope scope("gelu_forward", {x, y});
  inner_->gelu_forward(x, out_dtype, y, n);
}

void GuardedBackend::gelu_backward(const float* x, const float* dy, DType grad_dtype, void* dx, int64_t n) {
  const Scope scope("gelu_backward", {x, dy, dx});
  inner_->gelu_backward(x, dy, grad_dtype, dx, n);
}

void GuardedBackend::add_inplace(float* x, const float* y, int64_t n) {
  const Scope scope("add_inplace", {x, y});
  inner_->add_inplace(x, y, n);
}

void GuardedBackend::mul_inplace(float* x, const float* y, int64_t n) {
  const Scope scope("mul_inplace", {x, y});
  inner_->mul_inplace(x, y, n);
}

void GuardedBackend::add_product(float* x, const float* a, const float* b, int64_t n) {
  const Scope scope("add_product", {x, a, b});
  inner_->add_product(x, a, b, n);
}

void GuardedBackend::residual_add(const float* residual, const float* y, const float* bias, float* out, int64_t rows, int64_t n) {
  const Scope scope("residual_add", {residual, y, bias, out});
  inner_->residual_add(residual, y, bias, out, rows, n);
}

void GuardedBackend::residual_add_norm(const float* residual, const float* y, const float* bias, float* sum, const ops::NormArgs& norm, DType out_dtype, void* out, int64_t rows, int64_t n) {
  const Scope scope("residual_add_norm", {residual, y, bias, sum, norm.w, norm.b, norm.mean, norm.rstd, out});
  inner_->residual_add_norm(residual, y, bias, sum, norm, out_dtype, out, rows, n);
}

void GuardedBackend::convert(DType from, const void* src, DType to, void* dst, int64_t n) {
  const Scope scope("convert", {src, dst});
  inner_->convert(from, src, to, dst, n);
}

void GuardedBackend::bias_backward(const float* dy, float* dbias, int64_t rows, int64_t n) {
  const Scope scope("bias_backward", {dy, dbias});
  inner_->bias_backward(dy, dbias, rows, n);
}

void GuardedBackend::attention_forward(const ops::AttentionDims& dims, const ops::RopeTable* rope, DType compute, const float* qkv, void* out, ops::AttentionSaved& saved) {
  const Scope scope("attention_forward", {qkv, out});
  inner_->attention_forward(dims, rope, compute, qkv, out, saved);
}

void GuardedBackend::attention_backward(const ops::AttentionDims& dims, const ops::RopeTable* rope, DType compute, const ops::AttentionSaved& saved, const float* d_out, void* d_qkv) {
  const Scope scope("attention_backward", {d_out, d_qkv});
  inner_->attention_backward(dims, rope, compute, saved, d_out, d_qkv);
}

void GuardedBackend::context_attention_project(const ops::ContextDims& dims, const ops::RopeTable* rope, DType compute, const float* qkv, ops::AttentionSaved& saved, void* kv_send) {
  const Scope scope("context_attention_project", {qkv, kv_send});
  inner_->context_attention_project(dims, rope, compute, qkv, saved, kv_send);
}

void GuardedBackend::context_attention_forward(const ops::ContextDims& dims, DType compute, const void* kv_all, ops::AttentionSaved& saved, void* out) {
  const Scope scope("context_attention_forward", {kv_all, out});
  inner_->context_attention_forward(dims, compute, kv_all, saved, out);
}

void GuardedBackend::context_attention_backward(const ops::ContextDims& dims, const ops::RopeTable* rope, DType compute, const ops::AttentionSaved& saved, const float* d_out, void* d_qkv, float* dkv_all) {
  const Scope scope("context_attention_backward", {d_out, d_qkv, dkv_all});
  inner_->context_attention_backward(dims, rope, compute, saved, d_out, d_qkv, dkv_all);
}

void GuardedBackend::context_attention_finish(const ops::ContextDims& dims, const ops::RopeTable* rope, DType compute, const float* dkv, const float* dq, void* d_qkv) {
  const Scope scope("context_attention_finish", {dkv, dq, d_qkv});
  inner_->context_attention_finish(dims, rope, compute, dkv, dq, d_qkv);
}

void GuardedBackend::head_groups(const ops::HeadGroups& g, DType dtype, const void* rows, void* groups, bool to_groups) {
  const Scope scope("head_groups", {rows, groups});
  inner_->head_groups(g, dtype, rows, groups, to_groups);
}

void GuardedBackend::context_sequence(const ops::ContextDims& dims, int64_t width, DType dtype, const void* by_rank, void* sequence, bool to_sequence) {
  const Scope scope("context_sequence", {by_rank, sequence});
  inner_->context_sequence(dims, width, dtype, by_rank, sequence, to_sequence);
}

void GuardedBackend::ring_attention_forward_block(const ops::ContextDims& dims, DType compute, int64_t block_rank, const void* kv_block, const ops::AttentionSaved& saved, ops::RingState& state, bool first) {
  const Scope scope("ring_attention_forward_block", {kv_block});
  inner_->ring_attention_forward_block(dims, compute, block_rank, kv_block, saved, state, first);
}

void GuardedBackend::ring_attention_forward_finish(const ops::ContextDims& dims, DType compute, ops::RingState& state, ops::AttentionSaved& saved, void* out) {
  const Scope scope("ring_attention_forward_finish", {out});
  inner_->ring_attention_forward_finish(dims, compute, state, saved, out);
}

void GuardedBackend::ring_attention_backward_block(const ops::ContextDims& dims, DType compute, int64_t block_rank, const void* kv_block, const ops::AttentionSaved& saved, const float* d_out, const void* out, float* dq, float* dkv_block) {
  const Scope scope("ring_attention_backward_block", {kv_block, d_out, out, dq, dkv_block});
  inner_->ring_attention_backward_block(dims, compute, block_rank, kv_block, saved, d_out, out, dq, dkv_block);
}

void GuardedBackend::attention_decode(const ops::AttentionDims& dims, const ops::RopeTable* rope, const float* qkv, int64_t pos0, ops::KVCacheLayer& cache, float* out) {
  const Scope scope("attention_decode", {qkv, out});
  inner_->attention_decode(dims, rope, qkv, pos0, cache, out);
}

void GuardedBackend::embedding_forward(const ops::EmbeddingDims& dims, const void* table, DType table_dtype, const float* positions, const int32_t* ids, float* out) {
  const Scope scope("embedding_forward", {table, positions, ids, out});
  inner_->embedding_forward(dims, table, table_dtype, positions, ids, out);
}

void GuardedBackend::embedding_backward(const ops::EmbeddingDims& dims, const int32_t* ids, const float* dout, float* dtable, float* dpositions) {
  const Scope scope("embedding_backward", {ids, dout, dtable, dpositions});
  inner_->embedding_backward(dims, ids, dout, dtable, dpositions);
}

void GuardedBackend::dequantize_nf4(const void* packed, int64_t n, DType to, void* y, nf4::Form form) {
  const Scope scope("dequantize_nf4", {packed, y});
  inner_->dequantize_nf4(packed, n, to, y, form);
}

void GuardedBackend::router_forward(const ops::RouterDims& dims, const float* logits, float* probs, int32_t* indices, float* weights, float* lse) {
  const Scope scope("router_forward", {logits, probs, indices, weights, lse});
  inner_->router_forward(dims, logits, probs, indices, weights, lse);
}

void GuardedBackend::moe_sort(const ops::DispatchDims& dims, const int32_t* indices, int32_t* slots, int32_t* rows, int32_t* counts) {
  const Scope scope("moe_sort", {indices, slots, rows, counts});
  inner_->moe_sort(dims, indices, slots, rows, counts);
}

void GuardedBackend::moe_capacity(const ops::DispatchDims& dims, int64_t capacity, const float* weights, const int32_t* counts, int32_t* slots, int32_t* rows, int32_t* kept) {
  const Scope scope("moe_capacity", {weights, counts, slots, rows, kept});
  inner_->moe_capacity(dims, capacity, weights, counts, slots, rows, kept);
}

void GuardedBackend::moe_permute(const ops::DispatchDims& dims, const int32_t* slots, const float* x, DType out_dtype, void* out) {
  const Scope scope("moe_permute", {slots, x, out});
  inner_->moe_permute(dims, slots, x, out_dtype, out);
}

void GuardedBackend::moe_permute_backward(const ops::DispatchDims& dims, const int32_t* rows, const float* d_out, float* dx) {
  const Scope scope("moe_permute_backward", {rows, d_out, dx});
  inner_->moe_permute_backward(dims, rows, d_out, dx);
}

void GuardedBackend::moe_combine(const ops::DispatchDims& dims, const int32_t* rows, const float* weights, const float* y, float* out) {
  const Scope scope("moe_combine", {rows, weights, y, out});
  inner_->moe_combine(dims, rows, weights, y, out);
}

void GuardedBackend::moe_combine_backward(const ops::DispatchDims& dims, const int32_t* rows, const float* weights, const float* y, const float* d_out, DType grad_dtype, void* d_y, float* d_weights) {
  const Scope scope("moe_combine_backward", {rows, weights, y, d_out, d_y, d_weights});
  inner_->moe_combine_backward(dims, rows, weights, y, d_out, grad_dtype, d_y, d_weights);
}

double GuardedBackend::sum_squares(const float* x, int64_t n) {
  const Scope scope("sum_squares", {x});
  return inner_->sum_squares(x, n);
}

}  // namespace meshtrain::guarded
