#include "meshtrain/backend/cuda/sdpa/sdpa.h"

// The frontend loads cuDNN and the CUDA runtime with dlopen when it needs them:
// building and validating a graph loads neither.
#define NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING
#include <cudnn_frontend.h>

#include <dlfcn.h>

#include <cmath>
#include <exception>
#include <memory>
#include <mutex>

// With dynamic loading the frontend finds cuDNN's functions through this handle.
namespace cudnn_frontend {
void* cudnn_dlhandle = nullptr;
}  // namespace cudnn_frontend

namespace meshtrain::cuda {
namespace {

// cuDNN 9, once per process: "" or why it cannot be loaded.
std::string load_cudnn() {
  static std::once_flag once;
  static std::string why;
  std::call_once(once, [] {
    for (const char* name : {"libcudnn.so.9", MESHTRAIN_CUDA_LIBDIR "/libcudnn.so.9"}) {
      cudnn_frontend::cudnn_dlhandle = dlopen(name, RTLD_NOW | RTLD_LOCAL);
      if (cudnn_frontend::cudnn_dlhandle != nullptr) return;
    }
    why = std::string("cuDNN 9 could not be loaded: ") + dlerror();
  });
  return why;
}

namespace fe = cudnn_frontend;
using TensorPtr = std::shared_ptr<fe::graph::Tensor_attributes>;

fe::DataType_t fe_type(DType d) {
  switch (d) {
    case DType::bf16: return fe::DataType_t::BFLOAT16;
    case DType::f16: return fe::DataType_t::HALF;
    case DType::f32: return fe::DataType_t::FLOAT;
    case DType::i32: break;
  }
  return fe::DataType_t::NOT_SET;
}

// [B, heads, T, D] in heads-major layout (q, k, v, their gradients).
TensorPtr heads_major(fe::graph::Graph& g, const char* name, int64_t b, int64_t h, int64_t t,
                      int64_t d) {
  return g.tensor(fe::graph::Tensor_attributes().set_name(name).set_dim({b, h, t, d}).set_stride(
      {h * t * d, t * d, d, 1}));
}

// [B, H, T, D] stored as [B, T, H, D] (the output and its gradient).
TensorPtr token_major(fe::graph::Graph& g, const char* name, int64_t b, int64_t h, int64_t t,
                      int64_t d) {
  return g.tensor(fe::graph::Tensor_attributes().set_name(name).set_dim({b, h, t, d}).set_stride(
      {t * h * d, d, h * d, 1}));
}

void settle(fe::graph::Graph& g, const SdpaShape& s, int sm_version) {
  g.set_io_data_type(fe_type(s.dtype))
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  g.set_sm_version(sm_version);
}

std::string check(fe::error_t status, const char* which) {
  return status.is_good() ? std::string() : std::string(which) + ": " + status.get_message();
}

}  // namespace

std::string validate_sdpa(const SdpaShape& s, int sm_version) {
  if (std::string why = load_cudnn(); !why.empty()) return why;
  const float scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim));
  try {
    fe::graph::Graph forward;
    settle(forward, s, sm_version);
    auto q = heads_major(forward, "q", s.batch, s.heads, s.seq, s.head_dim);
    auto k = heads_major(forward, "k", s.batch, s.kv_heads, s.seq, s.head_dim);
    auto v = heads_major(forward, "v", s.batch, s.kv_heads, s.seq, s.head_dim);
    auto options = fe::graph::SDPA_attributes()
                       .set_name("attention")
                       .set_generate_stats(true)
                       .set_attn_scale(scale)
                       .set_causal_mask(true);
    if (s.window > 0) options.set_sliding_window_length(static_cast<int>(s.window));
    auto [o, stats] = forward.sdpa(q, k, v, options);
    o->set_output(true).set_dim({s.batch, s.heads, s.seq, s.head_dim}).set_stride(
        {s.seq * s.heads * s.head_dim, s.head_dim, s.heads * s.head_dim, 1});
    stats->set_output(true).set_data_type(fe::DataType_t::FLOAT);
    if (std::string why = check(forward.validate(), "forward"); !why.empty()) return why;

    fe::graph::Graph backward;
    settle(backward, s, sm_version);
    auto bq = heads_major(backward, "q", s.batch, s.heads, s.seq, s.head_dim);
    auto bk = heads_major(backward, "k", s.batch, s.kv_heads, s.seq, s.head_dim);
    auto bv = heads_major(backward, "v", s.batch, s.kv_heads, s.seq, s.head_dim);
    auto bo = token_major(backward, "o", s.batch, s.heads, s.seq, s.head_dim);
    auto d_o = token_major(backward, "d_o", s.batch, s.heads, s.seq, s.head_dim);
    auto bstats = backward.tensor(fe::graph::Tensor_attributes()
                                      .set_name("stats")
                                      .set_dim({s.batch, s.heads, s.seq, 1})
                                      .set_stride({s.heads * s.seq, s.seq, 1, 1})
                                      .set_data_type(fe::DataType_t::FLOAT));
    auto back_options = fe::graph::SDPA_backward_attributes()
                            .set_name("attention_backward")
                            .set_attn_scale(scale)
                            .set_causal_mask(true);
    if (s.window > 0) back_options.set_sliding_window_length(static_cast<int>(s.window));
    auto [dq, dk, dv] = backward.sdpa_backward(bq, bk, bv, bo, d_o, bstats, back_options);
    dq->set_output(true).set_dim({s.batch, s.heads, s.seq, s.head_dim}).set_stride(
        {s.heads * s.seq * s.head_dim, s.seq * s.head_dim, s.head_dim, 1});
    for (const TensorPtr& t : {dk, dv}) {
      t->set_output(true).set_dim({s.batch, s.kv_heads, s.seq, s.head_dim}).set_stride(
          {s.kv_heads * s.seq * s.head_dim, s.seq * s.head_dim, s.head_dim, 1});
    }
    return check(backward.validate(), "backward");
  } catch (const std::exception& e) {
    return std::string("cuDNN frontend: ") + e.what();
  }
}

}  // namespace meshtrain::cuda
