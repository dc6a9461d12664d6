// Float64 reference implementations of the ops layer, for `meshtrain ops
// test`: plain loops over host vectors, written to be checked against the
// formulas, never fast. Inputs are what a kernel reads (already rounded to its
// dtype by the caller); outputs are exact up to float64. An op that ADDS into
// an output in the Backend contract adds here too.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "meshtrain/backend/ops.h"
#include "meshtrain/tensor/nf4.h"

namespace meshtrain::ops::reference {

using Vec = std::vector<double>;

// C = alpha * op(A) · op(B) (+ bias) (+ C when accumulate), dense per batch
// unless dims give leading dimensions; c holds the whole output span.
void matmul(const MatmulDims& dims, std::span<const double> a, std::span<const double> b, Vec& c,
            double alpha, bool accumulate, const double* bias);

// Backend::grouped_matmul: ops::GroupedMatmulDims' GEMM per group, one by
// one; c holds the whole output.
void grouped_matmul(const GroupedMatmulDims& dims, const Vec& a, const Vec& b, Vec& c, double alpha,
                    bool accumulate);

void rmsnorm_forward(const Vec& x, const Vec& w, Vec& y, Vec& rstd, int64_t rows, int64_t dim,
                     double eps);
void rmsnorm_backward(const Vec& x, const Vec& w, const Vec& dy, Vec& dx, Vec& dw, int64_t rows,
                      int64_t dim, double eps);
void layernorm_forward(const Vec& x, const Vec& w, const Vec& b, Vec& y, Vec& mean, Vec& rstd,
                       int64_t rows, int64_t dim, double eps);
void layernorm_backward(const Vec& x, const Vec& w, const Vec& dy, Vec& dx, Vec& dw, Vec& db,
                        int64_t rows, int64_t dim, double eps);

void swiglu_forward(const Vec& gate_up, Vec& out, int64_t rows, int64_t hidden);
void swiglu_backward(const Vec& gate_up, const Vec& d_out, Vec& d_gate_up, int64_t rows,
                     int64_t hidden);
void gelu_forward(const Vec& x, Vec& y);
void gelu_backward(const Vec& x, const Vec& dy, Vec& dx);

// Attention over qkv [B, T, (H + 2 KV) D] with RoPE by `inv_freq` (empty: none)
// at each token's position (dims.positions, else t + pos0), causal within a
// record. out [B, T, H D]; the backward gives d_qkv for d_out.
void attention_forward(const AttentionDims& dims, std::span<const float> inv_freq, const Vec& qkv,
                       Vec& out, int64_t pos0 = 0);
void attention_backward(const AttentionDims& dims, std::span<const float> inv_freq, const Vec& qkv,
                        const Vec& d_out, Vec& d_qkv);

void embedding_forward(const EmbeddingDims& dims, const Vec& table, const Vec* positions,
                       std::span<const int32_t> ids, Vec& out);
void embedding_backward(const EmbeddingDims& dims, std::span<const int32_t> ids, const Vec& dout,
                        Vec& dtable, Vec* dpositions);

// Returns the summed loss; dh (overwritten) and dw (added) when not null;
// the last vocab - valid rows of w are padding.
double fused_classifier(const Vec& h, const Vec& w, std::span<const int32_t> targets, int64_t rows,
                        int64_t dim, int64_t vocab, int64_t valid, double grad_scale, Vec* dh,
                        Vec* dw, Vec* row_losses, std::span<const float> row_weights = {});

// grad is left at 0 when hyper.clear_grad.
void adamw_update(const AdamWHyper& hyper, Vec& param, Vec& grad, Vec& m, Vec& v);

// NF4 with double quantisation (tensor/nf4.h): the n values a packed buffer
// holds, NF4[q] * (DYN[c] * s + offset), every product and sum in float64.
void dequantize_nf4(std::span<const uint8_t> packed, int64_t n, Vec& out,
                    nf4::Form form = nf4::Form::whole);

// MoE routing (ops::RouterDims; dims.bias read as given): probs [tokens,
// experts], indices and weights [tokens, top_k], lse [tokens]; the
// backward's d_logits, with the auxiliary terms (ops::RouterAuxGrad: the
// per-expert score gradient, empty for none; z times lse and the logits' softmax).
void router_forward(const RouterDims& dims, const Vec& logits, Vec& probs,
                    std::vector<int32_t>& indices, Vec& weights, Vec& lse);
void router_backward(const RouterDims& dims, const Vec& probs, std::span<const int32_t> indices,
                     const Vec& d_weights, const Vec& score_grad, const Vec& logits, double z,
                     Vec& d_logits);

// Dispatch and combine (ops::DispatchDims), from the router's indices: the
// permuted order, each expert's count, and the row moves.
struct Dispatch {
  std::vector<int32_t> slots, rows, counts;
  std::vector<int32_t> kept;  // after moe_capacity: each expert's kept rows (rows[s] = -1: dropped)
};
Dispatch moe_sort(const DispatchDims& dims, std::span<const int32_t> indices);
// Backend::moe_capacity on a sorted order.
void moe_capacity(const DispatchDims& dims, int64_t capacity, const Vec& weights, Dispatch& order);
void moe_permute(const DispatchDims& dims, const Dispatch& order, const Vec& x, Vec& out);
void moe_permute_backward(const DispatchDims& dims, const Dispatch& order, const Vec& d_out,
                          Vec& dx);
void moe_combine(const DispatchDims& dims, const Dispatch& order, const Vec& weights, const Vec& y,
                 Vec& out);
void moe_combine_backward(const DispatchDims& dims, const Dispatch& order, const Vec& weights,
                          const Vec& y, const Vec& d_out, Vec& d_y, Vec& d_weights);

}  // namespace meshtrain::ops::reference
