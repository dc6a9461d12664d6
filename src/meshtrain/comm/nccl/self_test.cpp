#include "meshtrain/comm/nccl/self_test.h"

#include <fmt/format.h>

#include <cmath>
#include <functional>
#include <numeric>

#include "meshtrain/backend/cuda/runtime.h"
#include "meshtrain/comm/nccl/nccl.h"
#include "meshtrain/tensor/dtype.h"

namespace meshtrain {
namespace {

// A device buffer of n floats (or of bf16 values when `bf16`).
class DeviceFloats {
 public:
  DeviceFloats(int64_t n, bool bf16 = false) : n_(n), bf16_(bf16) {
    cuda::check(cudaMalloc(&data_, static_cast<size_t>(std::max<int64_t>(n, 1)) * element()),
                "cudaMalloc");
  }
  ~DeviceFloats() { cudaFree(data_); }
  DeviceFloats(const DeviceFloats&) = delete;
  DeviceFloats& operator=(const DeviceFloats&) = delete;
  void* data() const { return data_; }
  void put(const std::vector<float>& values) const {
    if (!bf16_) {
      cuda::check(cudaMemcpy(data_, values.data(), values.size() * 4, cudaMemcpyHostToDevice), "cudaMemcpy");
      return;
    }
    std::vector<bf16> bits(values.size());
    for (size_t i = 0; i < values.size(); ++i) bits[i] = float_to_bf16(values[i]);
    cuda::check(cudaMemcpy(data_, bits.data(), bits.size() * 2, cudaMemcpyHostToDevice), "cudaMemcpy");
  }
  std::vector<float> get() const {
    std::vector<float> values(static_cast<size_t>(n_));
    cuda::check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    if (!bf16_) {
      cuda::check(cudaMemcpy(values.data(), data_, values.size() * 4, cudaMemcpyDeviceToHost), "cudaMemcpy");
      return values;
    }
    std::vector<bf16> bits(values.size());
    cuda::check(cudaMemcpy(bits.data(), data_, bits.size() * 2, cudaMemcpyDeviceToHost), "cudaMemcpy");
    for (size_t i = 0; i < values.size(); ++i) values[i] = bf16_to_float(bits[i]);
    return values;
  }

 private:
  size_t element() const { return bf16_ ? 2 : 4; }
  void* data_ = nullptr;
  int64_t n_;
  bool bf16_;
};

std::vector<float> ramp(int64_t n, float scale = 1) {
  std::vector<float> v(static_cast<size_t>(n));
  for (size_t i = 0; i < v.size(); ++i) v[i] = scale * static_cast<float>(i % 251) - 100;
  return v;
}

}  // namespace

NcclCheck nccl_self_test(int device) {
  NcclCheck out;
  if (std::string why = cuda::device_unavailable(); !why.empty()) {
    out.skipped = why;
    return out;
  }
  if (device < 0) device = cuda::choose_device();
  FlightRecorder flight;
  NcclCommunicator::Options options;
  options.device = device;
  options.flight = &flight;
  const std::unique_ptr<NcclCommunicator> comm =
      NcclCommunicator::create(nccl_unique_id(), 0, 1, "self", options);
  const int64_t n = 1 << 20;
  auto check = [&](const std::string& what, const std::function<bool()>& run) {
    bool ok = false;
    std::string error;
    try {
      ok = run();
    } catch (const std::exception& e) {
      error = e.what();
    }
    out.lines.push_back(fmt::format("{} {}{}", ok ? "PASS" : "FAIL", what, error.empty() ? "" : ": " + error));
    if (!ok) ++out.failed;
  };
  const std::vector<float> values = ramp(n);
  check(fmt::format("nccl {} on device {}", nccl_version(), device), [] { return true; });
  for (const ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max}) {
    check(fmt::format("all_reduce f32 {} of {} values", reduce_op_name(op), n), [&] {
      const DeviceFloats x(n);
      x.put(values);
      comm->all_reduce(x.data(), n, CommDType::f32, op);
      return x.get() == values;
    });
  }
  check("all_reduce bf16 sum, in f32", [&] {
    const DeviceFloats x(n, true);
    x.put(values);
    comm->all_reduce(x.data(), n, CommDType::bf16, ReduceOp::sum);
    return x.get() == values;  // ramp values are exact in bf16
  });
  check("reduce_scatter f32 and bf16", [&] {
    const DeviceFloats a(n), b(n), c(n, true), d(n, true);
    a.put(values);
    c.put(values);
    comm->reduce_scatter(a.data(), b.data(), n, CommDType::f32, ReduceOp::sum);
    comm->reduce_scatter(c.data(), d.data(), n, CommDType::bf16, ReduceOp::avg);
    return b.get() == values && d.get() == values;
  });
  check("all_gather, in place", [&] {
    const DeviceFloats x(n);
    x.put(values);
    comm->all_gather(x.data(), x.data(), n, CommDType::f32);
    return x.get() == values;
  });
  check("broadcast from root 0", [&] {
    const DeviceFloats x(n);
    x.put(values);
    comm->broadcast(x.data(), n, CommDType::f32, 0);
    return x.get() == values;
  });
  check("all_to_all to self", [&] {
    const DeviceFloats a(n), b(n);
    a.put(values);
    const std::vector<int64_t> counts{n};
    comm->all_to_all(a.data(), counts, b.data(), counts, CommDType::f32);
    return b.get() == values;
  });
  check("send_recv batch to self", [&] {
    const DeviceFloats a(n), b(n);
    a.put(values);
    comm->send_recv_async({{.send = true, .data = a.data(), .count = n, .peer = 0},
                           {.send = false, .data = b.data(), .count = n, .peer = 0}})
        .wait();
    return b.get() == values;
  });
  check("barrier", [&] {
    comm->barrier();
    return true;
  });
  check("split into a group of one", [&] {
    const std::unique_ptr<Communicator> sub = comm->split(0, 0, "self-split");
    const DeviceFloats x(n);
    x.put(values);
    sub->all_reduce(x.data(), n, CommDType::f32, ReduceOp::sum);
    return sub->size() == 1 && x.get() == values;
  });
  check("every call numbered and recorded done", [&] {
    const FlightSnapshot snap = flight.snapshot();
    size_t done = 0;
    for (const FlightEntry& e : snap.calls) done += e.state == CallState::done ? 1 : 0;
    return comm->calls_issued() == comm->stats().total().calls && done == snap.calls.size() &&
           done > 0;
  });
  return out;
}

}  // namespace meshtrain
