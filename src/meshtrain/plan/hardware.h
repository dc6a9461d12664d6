// The hardware side of a plan: a catalog of GPUs (peak dense bf16 FLOP/s, HBM
// size and bandwidth, links) and the cluster they sit in. Every value can be
// overridden; docs/plan.md gives the source of each default.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace meshtrain::plan {

struct GpuSpec {
  std::string name;             // catalog key, e.g. "h100-sxm"
  double peak_flops = 0;        // dense bf16 tensor-core FLOP/s (no sparsity)
  double hbm_bytes = 0;         // device memory a process can see
  double hbm_bandwidth = 0;     // bytes/s
  double nvlink_bandwidth = 0;  // per GPU, per direction, bytes/s
  double network_bandwidth = 0; // inter-node, per GPU (one NIC each), per direction, bytes/s
  double pcie_bandwidth = 0;    // host link, per direction, bytes/s (offload)
  double price_per_hour = 0;    // USD per GPU-hour: a placeholder, override with --price
  // The compute curve (plan/compute.h). gemm_efficiency is the one calibrated
  // number per GPU: fitted once to one published run (compute_source), then
  // held fixed; the others are measured figures from their sources.
  double gemm_efficiency = 0;         // large bf16 GEMMs' fraction of peak
  double attention_efficiency = 0;    // flash attention forward + backward, fraction of peak
  double memory_efficiency = 0;       // streaming kernels' fraction of HBM bandwidth
  double kernel_overhead_seconds = 0; // launch + ramp per kernel
  std::string compute_source;
  // Dense FP8 tensor-core FLOP/s (Hopper: twice bf16); 0 where the GPU has
  // none (Ampere). Read by --fp8 (plan/compute.h).
  double fp8_peak_flops = 0;
  // Streaming multiprocessors: kernels that overlap communication with
  // compute take some of them (Job::comm_sms).
  int64_t sms = 0;
};

// Throws Error naming the known GPUs when `name` is not in the catalog.
GpuSpec gpu_spec(std::string_view name);
std::vector<std::string> gpu_names();

// Links are described by what a collective achieves on them: the nccl-tests
// "bus bandwidth" (bytes/s) and a per-step latency (s).
struct Link {
  double bus_bandwidth = 0;
  double latency = 0;
};

struct Cluster {
  GpuSpec gpu;
  int64_t gpus = 1;
  int64_t gpus_per_node = 8;
  Link intra;  // inside a node (NVLink / NVSwitch)
  Link inter;  // between nodes (InfiniBand / RoCE), per GPU
  double price_per_gpu_hour = 0;
  int64_t nodes() const { return (gpus + gpus_per_node - 1) / gpus_per_node; }
};

// Fraction of a link's per-direction bandwidth that NCCL reaches as bus
// bandwidth on large messages (the default for intra and inter links).
inline constexpr double kDefaultLinkEfficiency = 0.8;

// The cluster with defaults from the catalog: links at kDefaultLinkEfficiency
// of the GPU's NVLink / NIC bandwidth, 3 us / 10 us latency, the catalog price.
Cluster make_cluster(const GpuSpec& gpu, int64_t gpus, int64_t gpus_per_node);

// Checks positivity of every field; throws Error naming the option.
void validate(const Cluster& cluster);

}  // namespace meshtrain::plan
