// The CPU backend: the process's cores through OpenMP and oneDNN (the kernels
// in this folder), host memory, one CpuContext.
#pragma once

#include "meshtrain/backend/backend.h"
#include "meshtrain/backend/cpu/context.h"

namespace meshtrain::cpu {

class CpuBackend final : public Backend {
 public:
  // threads <= 0: the cores available to the process (context_threads).
  CpuBackend(int threads, MemoryTracker& tracker);

  const char* name() const override { return "cpu"; }
  Device device() const override { return {}; }
  std::string device_name() const override;  // /proc/cpuinfo's model name
  int threads() const override { return ctx_.threads(); }
  CpuContext& context() { return ctx_; }

  Tensor allocate(Shape shape, DType dtype, MemCategory category) override;
  void copy_to_host(const Tensor& src, void* dst) override;
  void copy_from_host(const void* src, const Tensor& dst) override;
  void synchronize() override {}  // every kernel returns when it is done

  void matmul(const ops::MatmulDims& dims, DType ab, const void* a, const void* b, DType c_dtype,
              void* c, float alpha, bool accumulate, const float* bias) override;
  void grouped_matmul(const ops::GroupedMatmulDims& dims, DType ab, const void* a, const void* b,
                      DType c_dtype, void* c, float alpha, bool accumulate) override;
  double measure_matmul_peak_flops(DType ab, double seconds) override;
  double measure_copy_bandwidth(size_t bytes, double seconds) override;

  void rmsnorm_forward(const float* x, const float* w, DType out_dtype, void* y, float* rstd,
                       int64_t rows, int64_t dim, float eps) override;
  void rmsnorm_backward(const float* x, const float* w, const float* rstd, const float* dy,
                        float* dx, float* dw, int64_t rows, int64_t dim) override;
  void layernorm_forward(const float* x, const float* w, const float* b, DType out_dtype, void* y,
                         float* mean, float* rstd, int64_t rows, int64_t dim, float eps) override;
  void layernorm_backward(const float* x, const float* w, const float* mean, const float* rstd,
                          const float* dy, float* dx, float* dw, float* db, int64_t rows,
                          int64_t dim) override;
  void group_rmsnorm_forward(const ops::GroupNormDims& dims, float* x, const float* w,
                             float* saved, float* rstd) override;
  void group_rmsnorm_backward(const ops::GroupNormDims& dims, const float* saved, const float* w,
                              const float* rstd, DType grad_dtype, void* dy, float* dw) override;

  void swiglu_forward(const float* gate_up, DType out_dtype, void* out, int64_t rows,
                      int64_t hidden) override;
  void swiglu_backward(const float* gate_up, const float* d_out, DType grad_dtype, void* d_gate_up,
                       int64_t rows, int64_t hidden) override;
  void gelu_forward(const float* x, DType out_dtype, void* y, int64_t n) override;
  void gelu_backward(const float* x, const float* dy, DType grad_dtype, void* dx,
                     int64_t n) override;
  void add_inplace(float* x, const float* y, int64_t n) override;
  void mul_inplace(float* x, const float* y, int64_t n) override;
  void add_product(float* x, const float* a, const float* b, int64_t n) override;
  void residual_add(const float* residual, const float* y, const float* bias, float* out,
                    int64_t rows, int64_t n) override;
  void residual_add_norm(const float* residual, const float* y, const float* bias, float* sum,
                         const ops::NormArgs& norm, DType out_dtype, void* out, int64_t rows,
                         int64_t n) override;
  void convert(DType from, const void* src, DType to, void* dst, int64_t n) override;
  void bias_backward(const float* dy, float* dbias, int64_t rows, int64_t n) override;

  ops::RopeTable make_rope_table(int64_t head_dim, int64_t max_seq,
                                 std::span<const float> inv_freq) override;
  void attention_forward(const ops::AttentionDims& dims, const ops::RopeTable* rope, DType compute,
                         const float* qkv, void* out, ops::AttentionSaved& saved) override;
  void attention_backward(const ops::AttentionDims& dims, const ops::RopeTable* rope, DType compute,
                          const ops::AttentionSaved& saved, const float* d_out,
                          void* d_qkv) override;
  void attention_decode(const ops::AttentionDims& dims, const ops::RopeTable* rope,
                        const float* qkv, int64_t pos0, ops::KVCacheLayer& cache,
                        float* out) override;
  void context_attention_project(const ops::ContextDims& dims, const ops::RopeTable* rope,
                                 DType compute, const float* qkv, ops::AttentionSaved& saved,
                                 void* kv_send) override;
  void context_attention_forward(const ops::ContextDims& dims, DType compute, const void* kv_all,
                                 ops::AttentionSaved& saved, void* out) override;
  void context_attention_backward(const ops::ContextDims& dims, const ops::RopeTable* rope,
                                  DType compute, const ops::AttentionSaved& saved,
                                  const float* d_out, void* d_qkv, float* dkv_all) override;
  void context_attention_finish(const ops::ContextDims& dims, const ops::RopeTable* rope,
                                DType compute, const float* dkv, const float* dq,
                                void* d_qkv) override;
  void head_groups(const ops::HeadGroups& g, DType dtype, const void* rows, void* groups,
                   bool to_groups) override;
  void context_sequence(const ops::ContextDims& dims, int64_t width, DType dtype,
                        const void* by_rank, void* sequence, bool to_sequence) override;
  void ring_attention_forward_block(const ops::ContextDims& dims, DType compute,
                                    int64_t block_rank, const void* kv_block,
                                    const ops::AttentionSaved& saved, ops::RingState& state,
                                    bool first) override;
  void ring_attention_forward_finish(const ops::ContextDims& dims, DType compute,
                                     ops::RingState& state, ops::AttentionSaved& saved,
                                     void* out) override;
  void ring_attention_backward_block(const ops::ContextDims& dims, DType compute,
                                     int64_t block_rank, const void* kv_block,
                                     const ops::AttentionSaved& saved, const float* d_out,
                                     const void* out, float* dq, float* dkv_block) override;

  void embedding_forward(const ops::EmbeddingDims& dims, const void* table, DType table_dtype,
                         const float* positions, const int32_t* ids, float* out) override;
  void embedding_backward(const ops::EmbeddingDims& dims, const int32_t* ids, const float* dout,
                          float* dtable, float* dpositions) override;

  double fused_classifier(const ops::ClassifierArgs& args) override;

  void dequantize_nf4(const void* packed, int64_t n, DType to, void* y,
                      nf4::Form form = nf4::Form::whole) override;
  void router_forward(const ops::RouterDims& dims, const float* logits, float* probs,
                      int32_t* indices, float* weights, float* lse) override;
  void router_backward(const ops::RouterDims& dims, const float* probs, const int32_t* indices,
                       const float* d_weights, const ops::RouterAuxGrad& aux,
                       float* d_logits) override;
  void moe_capacity(const ops::DispatchDims& dims, int64_t capacity, const float* weights,
                    const int32_t* counts, int32_t* slots, int32_t* rows, int32_t* kept) override;
  void moe_sort(const ops::DispatchDims& dims, const int32_t* indices, int32_t* slots,
                int32_t* rows, int32_t* counts) override;
  void moe_permute(const ops::DispatchDims& dims, const int32_t* slots, const float* x,
                   DType out_dtype, void* out) override;
  void moe_permute_backward(const ops::DispatchDims& dims, const int32_t* rows,
                            const float* d_out, float* dx) override;
  void moe_combine(const ops::DispatchDims& dims, const int32_t* rows, const float* weights,
                   const float* y, float* out) override;
  void moe_combine_backward(const ops::DispatchDims& dims, const int32_t* rows,
                            const float* weights, const float* y, const float* d_out,
                            DType grad_dtype, void* d_y, float* d_weights) override;

  void adamw_update(const ops::AdamWHyper& hyper, float* param, float* grad, float* m,
                    float* v, ops::ComputeCopy compute, int64_t n) override;
  double sum_squares(const float* x, int64_t n) override;

 private:
  CpuContext ctx_;
};

}  // namespace meshtrain::cpu
