// Activation checkpointing: what a training block keeps under each recompute
// mode and how its backward gets the rest back (model.h RecomputePolicy).
#include <utility>

#include "meshtrain/model/model_impl.h"
#include "meshtrain/util/error.h"
#include "meshtrain/util/trace.h"

namespace meshtrain {

namespace {

// Exchanges the tensors `mode` does not keep between a block and the shared
// set, so a block runs on the shared tensors and keeps none of them.
void swap_unkept(BlockActs& a, BlockActs& shared, Recompute mode) {
  using std::swap;
  // Selective: bytes per FLOP to recompute are high (elementwise work, or the
  // attention core's T x T per head at 2 * head_dim FLOPs an element).
  swap(a.xn1, shared.xn1);
  swap(a.mean1, shared.mean1);
  swap(a.rstd1, shared.rstd1);
  swap(a.xn2, shared.xn2);
  swap(a.mean2, shared.mean2);
  swap(a.rstd2, shared.rstd2);
  swap(a.ff_act, shared.ff_act);
  if (mode != Recompute::full) return;
  // Full: the GEMM outputs too (and the probabilities, kept for one block).
  swap(a.qk, shared.qk);
  swap(a.qk_rstd, shared.qk_rstd);
  swap(a.attn.q, shared.attn.q);
  swap(a.attn.k, shared.attn.k);
  swap(a.attn.v, shared.attn.v);
  swap(a.attn.probs, shared.attn.probs);
  swap(a.attn.lse, shared.attn.lse);
  swap(a.attn.out, shared.attn.out);
  swap(a.att, shared.att);
  swap(a.mid, shared.mid);
  swap(a.ff_pre, shared.ff_pre);
  swap(a.moe, shared.moe);
}

}  // namespace

void Model::set_recompute(const RecomputePolicy& policy) {
  MESHTRAIN_CHECK(policy.layers >= 0, "recompute_layers: must be >= 0, got {}", policy.layers);
  MESHTRAIN_CHECK(policy.layers == 0 || policy.mode == Recompute::full,
                  "recompute_layers: {} needs recompute = \"full\" (got \"{}\")", policy.layers,
                  recompute_name(policy.mode));
  impl_->recompute = policy;
  impl_->train = Activations();
  impl_->staged.clear();
  impl_->recomputed = BlockActs();
}

const RecomputePolicy& Model::recompute() const { return impl_->recompute; }

Recompute Model::Impl::layer_recompute(int64_t layer, int64_t chunk_first) const {
  if (recompute.mode != Recompute::full || recompute.layers == 0) return recompute.mode;
  return layer - chunk_first < recompute.layers ? Recompute::full : Recompute::none;
}

void Model::Impl::train_forward_block(int64_t layer, int64_t chunk_first, const Tensor& x,
                                      BlockActs& a, Tensor& out, DType dt, int64_t batch,
                                      int64_t seq) {
  trace::Span span("forward", "layer", layer);
  a.mode = layer_recompute(layer, chunk_first);
  a.attn.recompute_probs = a.mode == Recompute::selective;
  // The routing statistics count this forward, not its recomputation.
  recording_moe = true;
  if (a.mode == Recompute::none) {
    forward_block(layer, x, a, out, dt, batch, seq, nullptr, 0);
  } else {
    swap_unkept(a, recomputed, a.mode);
    forward_block(layer, x, a, out, dt, batch, seq, nullptr, 0);
    swap_unkept(a, recomputed, a.mode);
  }
  recording_moe = false;
}

void Model::Impl::train_backward_block(int64_t layer, const Tensor& x, BlockActs& a, Tensor& out,
                                       DType dt, int64_t batch, int64_t seq) {
  trace::Span span("backward", "layer", layer);
  if (a.mode == Recompute::none) {
    backward_block(layer, x, a, dt, batch, seq);
    return;
  }
  swap_unkept(a, recomputed, a.mode);
  {
    trace::Span recompute_span("recompute", "recompute layer", layer);
    if (a.mode == Recompute::full) {
      forward_block(layer, x, a, out, dt, batch, seq, nullptr, 0);
    } else {
      // The probabilities come back inside attention_backward (recompute_probs).
      const Block& b = block(layer);
      const int64_t rows = batch * seq, srows = shard_rows(rows);
      norm_forward(b.norm1, x, dt, a.xn1, a.mean1, a.rstd1, srows, a.category);
      norm_forward(b.norm2, a.mid, dt, a.xn2, a.mean2, a.rstd2, srows, a.category);
      if (!b.moe.enabled()) mlp_activation(a.ff_pre, dt, a.ff_act, rows, hidden, a.category);
    }
  }
  backward_block(layer, x, a, dt, batch, seq);
  swap_unkept(a, recomputed, a.mode);
}

}  // namespace meshtrain
