#include "meshtrain/backend/cuda/sdpa/sdpa.h"

// The frontend reaches cuDNN through cudnn_dlhandle (load_cudnn) and loads a
// CUDA runtime of its own with dlopen when it builds plans for a device
// (CUDNN_FRONTEND_CUDART_LIB_NAME names it); validating a graph needs neither
// a device nor the runtime.
#define NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING
#include <cudnn_frontend.h>

#include <cmath>
#include <exception>
#include <map>
#include <mutex>
#include <unordered_map>

#include "meshtrain/backend/cuda/library.h"
#include "meshtrain/util/error.h"

// With dynamic loading the frontend finds cuDNN's functions through this handle.
namespace cudnn_frontend {
void* cudnn_dlhandle = nullptr;
}  // namespace cudnn_frontend

namespace meshtrain::cuda {
namespace {

// cuDNN 9, once per process (library.h: $MESHTRAIN_CUDNN, the loader's
// path, the toolkit's folder): "" or why it cannot be loaded.
std::string load_cudnn() {
  static std::once_flag once;
  static std::string why;
  std::call_once(once, [] {
    try {
      cudnn_frontend::cudnn_dlhandle = open_library("cuDNN 9", "MESHTRAIN_CUDNN", "libcudnn.so.9");
    } catch (const Error& e) {
      why = e.what();
    }
  });
  return why;
}

namespace fe = cudnn_frontend;
using TensorPtr = std::shared_ptr<fe::graph::Tensor_attributes>;

// The graphs' tensors by uid, as execute's variant packs name them.
enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV };

fe::DataType_t fe_type(DType d) {
  switch (d) {
    case DType::bf16: return fe::DataType_t::BFLOAT16;
    case DType::f16: return fe::DataType_t::HALF;
    case DType::f32: return fe::DataType_t::FLOAT;
    case DType::i32: break;
  }
  return fe::DataType_t::NOT_SET;
}

// [B, heads, T, D] in heads-major layout (q, k, v and their gradients).
void heads_major(fe::graph::Tensor_attributes& t, int64_t b, int64_t h, int64_t s, int64_t d) {
  t.set_dim({b, h, s, d}).set_stride({h * s * d, s * d, d, 1});
}

// [B, H, T, D] stored as [B, T, H, D] (the output and its gradient).
void token_major(fe::graph::Tensor_attributes& t, int64_t b, int64_t h, int64_t s, int64_t d) {
  t.set_dim({b, h, s, d}).set_stride({s * h * d, d, h * d, 1});
}

// The softmax statistics: f32 [B, H, T, 1].
void stats_layout(fe::graph::Tensor_attributes& t, const SdpaShape& s) {
  t.set_data_type(fe::DataType_t::FLOAT)
      .set_dim({s.batch, s.heads, s.seq, 1})
      .set_stride({s.heads * s.seq, s.seq, 1, 1});
}

TensorPtr input(fe::graph::Graph& g, const char* name, Uid uid) {
  return g.tensor(fe::graph::Tensor_attributes().set_name(name).set_uid(uid));
}

// sm_version 0: the device's, asked when the plans are built.
void settle(fe::graph::Graph& g, const SdpaShape& s, int sm_version) {
  g.set_io_data_type(fe_type(s.dtype))
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  if (sm_version > 0) g.set_sm_version(sm_version);
}

float scale_of(const SdpaShape& s) { return 1.0f / std::sqrt(static_cast<float>(s.head_dim)); }

void forward_graph(fe::graph::Graph& g, const SdpaShape& s, int sm_version) {
  settle(g, s, sm_version);
  TensorPtr q = input(g, "q", kQ), k = input(g, "k", kK), v = input(g, "v", kV);
  heads_major(*q, s.batch, s.heads, s.seq, s.head_dim);
  heads_major(*k, s.batch, s.kv_heads, s.seq, s.head_dim);
  heads_major(*v, s.batch, s.kv_heads, s.seq, s.head_dim);
  auto options = fe::graph::SDPA_attributes()
                     .set_name("attention")
                     .set_generate_stats(true)
                     .set_attn_scale(scale_of(s))
                     .set_causal_mask(true);
  // Keys [t - window + 1, t]: the band's left bound is the window (Hugging Face's sliding_window).
  if (s.window > 0) options.set_diagonal_band_left_bound(static_cast<int>(s.window));
  auto [o, stats] = g.sdpa(q, k, v, options);
  o->set_output(true).set_uid(kO);
  token_major(*o, s.batch, s.heads, s.seq, s.head_dim);
  stats->set_output(true).set_uid(kStats);
  stats_layout(*stats, s);
}

void backward_graph(fe::graph::Graph& g, const SdpaShape& s, int sm_version) {
  settle(g, s, sm_version);
  TensorPtr q = input(g, "q", kQ), k = input(g, "k", kK), v = input(g, "v", kV);
  TensorPtr o = input(g, "o", kO), d_o = input(g, "d_o", kDO), stats = input(g, "stats", kStats);
  heads_major(*q, s.batch, s.heads, s.seq, s.head_dim);
  heads_major(*k, s.batch, s.kv_heads, s.seq, s.head_dim);
  heads_major(*v, s.batch, s.kv_heads, s.seq, s.head_dim);
  token_major(*o, s.batch, s.heads, s.seq, s.head_dim);
  token_major(*d_o, s.batch, s.heads, s.seq, s.head_dim);
  stats_layout(*stats, s);
  // Deterministic: dQ summed in a fixed order, so a resumed run repeats itself bit for bit.
  auto options = fe::graph::SDPA_backward_attributes()
                     .set_name("attention_backward")
                     .set_attn_scale(scale_of(s))
                     .set_causal_mask(true)
                     .set_deterministic_algorithm(true);
  if (s.window > 0) options.set_diagonal_band_left_bound(static_cast<int>(s.window));
  auto [dq, dk, dv] = g.sdpa_backward(q, k, v, o, d_o, stats, options);
  dq->set_output(true).set_uid(kDQ);
  heads_major(*dq, s.batch, s.heads, s.seq, s.head_dim);
  dk->set_output(true).set_uid(kDK);
  heads_major(*dk, s.batch, s.kv_heads, s.seq, s.head_dim);
  dv->set_output(true).set_uid(kDV);
  heads_major(*dv, s.batch, s.kv_heads, s.seq, s.head_dim);
}

std::string check(fe::error_t status, const char* which) {
  return status.is_good() ? std::string() : std::string(which) + ": " + status.get_message();
}

std::string check(cudnnStatus_t status, const char* which) {
  return status == CUDNN_STATUS_SUCCESS
             ? std::string()
             : std::string(which) + ": " + fe::detail::get_error_string(status) + " (status " +
                   std::to_string(static_cast<int>(status)) + ")";
}

// Either graph of `s` made by `make` and validated (sm_version > 0: for that
// GPU, no device asked), then, with a handle, built for the device: "" or why not.
template <class Make>
std::string build(fe::graph::Graph& g, Make make, const SdpaShape& s, int sm_version,
                  cudnnHandle_t handle, const char* which) {
  try {
    make(g, s, sm_version);
    if (std::string why = check(g.validate(), which); !why.empty()) return why;
    if (handle == nullptr) return "";
    std::string why = check(g.build_operation_graph(handle), which);
    if (why.empty()) why = check(g.create_execution_plans({fe::HeurMode_t::A}), which);
    if (why.empty()) why = check(g.check_support(handle), which);
    if (why.empty()) why = check(g.build_plans(handle), which);
    return why;
  } catch (const std::exception& e) {
    return std::string(which) + ": cuDNN frontend: " + e.what();
  }
}

}  // namespace

std::string sdpa_declines(const ops::AttentionDims& d, DType compute) {
  if (std::string why = sdpa_shape_declines(d, compute); !why.empty()) return why;
  return load_cudnn();
}

std::string validate_sdpa(const SdpaShape& s, int sm_version) {
  if (std::string why = load_cudnn(); !why.empty()) return why;
  fe::graph::Graph forward, backward;
  if (std::string why = build(forward, forward_graph, s, sm_version, nullptr, "forward");
      !why.empty()) {
    return why;
  }
  return build(backward, backward_graph, s, sm_version, nullptr, "backward");
}

struct SdpaRunner::Impl {
  CUstream_st* stream = nullptr;
  cudnnHandle_t handle = nullptr;
  bool connected = false;  // the handle made, or why not in no_handle
  std::string no_handle;   // why there is no handle ("" when there is)

  // cuDNN loaded and a handle made on the stream, on the first shape (a run
  // without 16-bit attention never maps cuDNN's libraries).
  void connect() {
    if (connected) return;
    connected = true;
    no_handle = load_cudnn();
    if (!no_handle.empty()) return;
    no_handle = check(fe::detail::create_handle(&handle), "cudnnCreate");
    if (!no_handle.empty()) {
      handle = nullptr;
      return;
    }
    no_handle = check(fe::detail::set_stream(handle, stream), "cudnnSetStream");
  }
  struct Graphs {
    fe::graph::Graph forward, backward;
    int64_t forward_workspace = 0, backward_workspace = 0;
    std::string why;  // "" when both are built
  };
  std::map<SdpaShape, std::unique_ptr<Graphs>> shapes;

  const Graphs& built(const SdpaShape& s) const {
    auto it = shapes.find(s);
    MESHTRAIN_CHECK(it != shapes.end() && it->second->why.empty(),
                    "cuDNN attention: shape B {} H {} KV {} T {} D {} not prepared", s.batch,
                    s.heads, s.kv_heads, s.seq, s.head_dim);
    return *it->second;
  }

  void run(const fe::graph::Graph& g, std::unordered_map<int64_t, void*>& pack, void* workspace,
           const char* which) const {
    const std::string why = check(g.execute(handle, pack, workspace), which);
    MESHTRAIN_CHECK_AS(ErrorKind::resource, why.empty(), "cuDNN attention: {}", why);
  }
};

SdpaRunner::SdpaRunner(CUstream_st* stream) : impl_(std::make_unique<Impl>()) {
  impl_->stream = stream;
}

SdpaRunner::~SdpaRunner() {
  if (impl_->handle != nullptr) fe::detail::destroy_handle(impl_->handle);
}

std::string SdpaRunner::prepare(const SdpaShape& s) {
  Impl& m = *impl_;
  auto [it, fresh] = m.shapes.try_emplace(s);
  if (!fresh) return it->second->why;
  auto graphs = std::make_unique<Impl::Graphs>();
  m.connect();
  graphs->why = m.no_handle;
  if (graphs->why.empty()) {
    graphs->why = build(graphs->forward, forward_graph, s, 0, m.handle, "forward");
  }
  if (graphs->why.empty()) {
    graphs->why = build(graphs->backward, backward_graph, s, 0, m.handle, "backward");
  }
  if (graphs->why.empty()) {
    graphs->why = check(graphs->forward.get_workspace_size(graphs->forward_workspace), "forward");
  }
  if (graphs->why.empty()) {
    graphs->why =
        check(graphs->backward.get_workspace_size(graphs->backward_workspace), "backward");
  }
  it->second = std::move(graphs);
  return it->second->why;
}

size_t SdpaRunner::forward_workspace(const SdpaShape& s) const {
  return static_cast<size_t>(impl_->built(s).forward_workspace);
}

size_t SdpaRunner::backward_workspace(const SdpaShape& s) const {
  return static_cast<size_t>(impl_->built(s).backward_workspace);
}

// cuDNN's variant pack takes void* for its inputs too; it does not write them.
void SdpaRunner::forward(const SdpaShape& s, const SdpaForward& io, void* workspace) const {
  std::unordered_map<int64_t, void*> pack{{kQ, const_cast<void*>(io.q)},
                                          {kK, const_cast<void*>(io.k)},
                                          {kV, const_cast<void*>(io.v)},
                                          {kO, io.o},
                                          {kStats, io.stats}};
  impl_->run(impl_->built(s).forward, pack, workspace, "forward");
}

void SdpaRunner::backward(const SdpaShape& s, const SdpaBackward& io, void* workspace) const {
  std::unordered_map<int64_t, void*> pack{{kQ, const_cast<void*>(io.q)},
                                          {kK, const_cast<void*>(io.k)},
                                          {kV, const_cast<void*>(io.v)},
                                          {kO, const_cast<void*>(io.o)},
                                          {kDO, const_cast<void*>(io.d_o)},
                                          {kStats, const_cast<float*>(io.stats)},
                                          {kDQ, io.dq},
                                          {kDK, io.dk},
                                          {kDV, io.dv}};
  impl_->run(impl_->built(s).backward, pack, workspace, "backward");
}

}  // namespace meshtrain::cuda
