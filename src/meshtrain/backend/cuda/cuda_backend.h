// The CUDA backend: one NVIDIA GPU of the process (runtime.h's choose_device),
// one compute stream, cuBLASLt for the GEMMs (matmul.h), the kernels of this
// folder for the rest (kernels.h), device memory from a caching allocator
// whose tensors count every byte in the MemoryTracker. Operations are issued
// on the stream and return; copies to and from the host and the ops that
// return a value on the host synchronize. docs/gpu.md says what runs here
// and how it was checked.
#pragma once

#include <memory>
#include <string>

#include "meshtrain/backend/backend.h"

namespace meshtrain::cuda {

struct AttentionShape;  // kernels.h
struct SdpaShape;       // sdpa/sdpa.h

// Rows of logits the fused classifier takes at a time: [rows, vocab] f32 and
// their gradient in the compute dtype (1024 x 128K x 6 bytes = 0.8 GB).
inline constexpr int64_t kClassifierRows = 1024;

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(MemoryTracker& tracker);
  ~CudaBackend() override;

  const char* name() const override { return "cuda"; }
  Device device() const override;
  std::string device_name() const override;  // the GPU's name
  int threads() const override { return 1; }

  Tensor allocate(Shape shape, DType dtype, MemCategory category) override;
  void copy_to_host(const Tensor& src, void* dst) override;
  void copy_from_host(const void* src, const Tensor& dst) override;
  void synchronize() override;
  const Allocator& staging_allocator() const override;  // page-locked host memory

  void matmul(const ops::MatmulDims& dims, DType ab, const void* a, const void* b, DType c_dtype,
              void* c, float alpha, bool accumulate, const float* bias) override;
  void matmul_add(const ops::MatmulDims& dims, DType ab, const void* a, const void* b,
                  const float* addend, float* c, const float* bias) override;
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
  void run_copies(const ops::CopyPlan& plan);  // on the stream, device to device
  // Keeps `t` when it has this shape and dtype on this device, else allocates it.
  void ensure(Tensor& t, const Shape& shape, DType dtype, MemCategory category);
  // A pass's keys and values, and its probabilities (`probs` empty: none)
  // unless backward recomputes them.
  void ensure_saved(ops::AttentionSaved& saved, const Shape& kv, const Shape& probs,
                    DType compute);
  // Throws a resource error when a kernel needs more shared memory per block
  // than the device allows (the reference attention kernels: a row of `keys` scores).
  void require_shared(size_t bytes, const char* op, int64_t keys) const;
  // The reference attention kernels' backward for `a` (kernels.h): dq [B, H,
  // Q, D], dk and dv [B, KV, T, D] in f32 workspace.
  struct AttentionGrads {
    Tensor dq, dk, dv;
  };
  AttentionGrads reference_backward(const AttentionShape& a, DType compute,
                                    const ops::AttentionSaved& saved, const float* d_out);
  // cuDNN's fused attention (sdpa/sdpa.h): whether it takes `dims` in
  // `compute` (its graphs built for this device), and its backward, the same
  // grads from the output and statistics forward kept.
  bool takes_fused(const ops::AttentionDims& dims, DType compute);
  AttentionGrads fused_backward(const SdpaShape& s, const ops::AttentionSaved& saved,
                                const float* d_out);
  Tensor sdpa_workspace(size_t bytes);  // undefined for 0 bytes
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace meshtrain::cuda
