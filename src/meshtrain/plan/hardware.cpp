#include "meshtrain/plan/hardware.h"

#include <fmt/format.h>

#include "meshtrain/util/error.h"

namespace meshtrain::plan {
namespace {

constexpr double kTera = 1e12, kGiga = 1e9, kMiB = 1024.0 * 1024.0;
// The calibrated GEMM efficiencies (see catalog()).
constexpr double kA100GemmEfficiency = 0.672, kH100GemmEfficiency = 0.588;

// Sources (docs/plan.md, "GPU catalog"): NVIDIA A100 / H100 / H200 datasheets
// for FLOP/s, HBM bandwidth and NVLink; HBM size as nvidia-smi reports it
// (A100 40960 MiB, A100 80GB 81920 MiB, H100 and H800 81559 MiB, H200 143771 MiB). NICs: HDR 200 Gb/s (A100 DGX), NDR 400 Gb/s (H100/H200 DGX),
// one per GPU. Prices are placeholders of the order of 2025 cloud list prices.
std::vector<GpuSpec> catalog() {
  // The datasheet; the compute curve (zeros here) is set below.
  std::vector<GpuSpec> gpus = {
      {"a100-40gb", 312 * kTera, 40960 * kMiB, 1555 * kGiga, 300 * kGiga, 25 * kGiga, 32 * kGiga, 1.50, 0, 0, 0, 0, {}},
      {"a100-80gb", 312 * kTera, 81920 * kMiB, 2039 * kGiga, 300 * kGiga, 25 * kGiga, 32 * kGiga, 1.80, 0, 0, 0, 0, {}},
      {"h100-sxm", 989.4 * kTera, 81559 * kMiB, 3350 * kGiga, 450 * kGiga, 50 * kGiga, 64 * kGiga, 2.50, 0, 0, 0, 0, {}},
      // H800: the H100 SXM's compute and HBM, NVLink cut to 400 GB/s (200 each way);
      // DeepSeek-V3's cluster (its report, section 3.1): one 400 Gb/s IB NIC per GPU.
      {"h800", 989.4 * kTera, 81559 * kMiB, 3350 * kGiga, 200 * kGiga, 50 * kGiga, 64 * kGiga, 2.00, 0, 0, 0, 0, {}},
      {"h200", 989.4 * kTera, 143771 * kMiB, 4800 * kGiga, 450 * kGiga, 50 * kGiga, 64 * kGiga, 3.50, 0, 0, 0, 0, {}},
  };
  // Compute curves (docs/plan.md, "Compute"). gemm_efficiency is fitted, once
  // per architecture, to one published run with its layout fixed:
  //   A100: Megatron-LM 1T (Narayanan et al. 2021, table 1: 163 TFLOP/s per GPU);
  //   H100: Llama 3 405B on 8,192 GPUs (Llama 3 paper, table 4: 430 TFLOP/s per GPU).
  // Attention: FlashAttention-2 (Dao 2023, figs. 4-7: causal forward + backward at
  // head dim 128 reaches ~50% of peak on A100, ~35-40% on H100). HBM: streaming
  // kernels reach ~85% of the datasheet bandwidth. Kernel overhead: ~4 us per
  // launch and wave ramp.
  for (GpuSpec& g : gpus) {
    const bool ampere = g.name.rfind("a100", 0) == 0;
    g.gemm_efficiency = ampere ? kA100GemmEfficiency : kH100GemmEfficiency;
    g.attention_efficiency = ampere ? 0.50 : 0.40;
    g.memory_efficiency = 0.85;
    g.kernel_overhead_seconds = 4e-6;
    g.fp8_peak_flops = ampere ? 0 : 2 * g.peak_flops;  // H100 / H800 / H200 datasheets: 1979 dense
    g.sms = ampere ? 108 : 132;                          // SXM parts
    g.compute_source = ampere ? "gemm efficiency fitted to Megatron-LM 1T, 163 TFLOP/s/GPU"
                              : "gemm efficiency fitted to Llama 3 405B on 8K H100, 430 TFLOP/s/GPU";
  }
  return gpus;
}

}  // namespace

GpuSpec gpu_spec(std::string_view name) {
  for (GpuSpec& spec : catalog()) {
    if (spec.name == name) return spec;
  }
  fail("plan: unknown GPU '{}' (known: {})", name, fmt::join(gpu_names(), ", "));
}

std::vector<std::string> gpu_names() {
  std::vector<std::string> names;
  for (const GpuSpec& spec : catalog()) names.push_back(spec.name);
  return names;
}

Cluster make_cluster(const GpuSpec& gpu, int64_t gpus, int64_t gpus_per_node) {
  Cluster c;
  c.gpu = gpu;
  c.gpus = gpus;
  c.gpus_per_node = gpus_per_node;
  c.intra = {gpu.nvlink_bandwidth * kDefaultLinkEfficiency, 3e-6};
  c.inter = {gpu.network_bandwidth * kDefaultLinkEfficiency, 10e-6};
  c.price_per_gpu_hour = gpu.price_per_hour;
  return c;
}

void validate(const Cluster& c) {
  MESHTRAIN_CHECK(c.gpus > 0, "plan: --gpus must be > 0, got {}", c.gpus);
  MESHTRAIN_CHECK(c.gpus_per_node > 0, "plan: --gpus-per-node must be > 0, got {}",
                  c.gpus_per_node);
  MESHTRAIN_CHECK(c.gpus <= c.gpus_per_node || c.gpus % c.gpus_per_node == 0,
                  "plan: --gpus {} is not a whole number of {}-GPU nodes", c.gpus,
                  c.gpus_per_node);
  MESHTRAIN_CHECK(c.gpu.peak_flops > 0, "plan: --peak-tflops must be > 0");
  MESHTRAIN_CHECK(c.gpu.hbm_bytes > 0, "plan: --hbm-gib must be > 0");
  MESHTRAIN_CHECK(c.intra.bus_bandwidth > 0, "plan: --intra-bw must be > 0");
  MESHTRAIN_CHECK(c.inter.bus_bandwidth > 0, "plan: --inter-bw must be > 0");
  MESHTRAIN_CHECK(c.intra.latency >= 0, "plan: --intra-latency-us must be >= 0");
  MESHTRAIN_CHECK(c.inter.latency >= 0, "plan: --inter-latency-us must be >= 0");
  MESHTRAIN_CHECK(c.price_per_gpu_hour >= 0, "plan: --price must be >= 0");
}

}  // namespace meshtrain::plan
