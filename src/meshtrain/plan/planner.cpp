#include "meshtrain/plan/planner.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>

#include "meshtrain/plan/collectives.h"
#include "meshtrain/util/error.h"

namespace meshtrain::plan {

void Job::validate() const {
  MESHTRAIN_CHECK(seq > 0, "plan: --seq must be > 0, got {}", seq);
  MESHTRAIN_CHECK(global_batch > 0, "plan: the global batch must be at least one sequence");
  MESHTRAIN_CHECK(tokens >= 0, "plan: --tokens must be >= 0");
  MESHTRAIN_CHECK(compute_efficiency >= 0 && compute_efficiency <= 1,
                  "plan: --efficiency must be in (0, 1], got {}", compute_efficiency);
  MESHTRAIN_CHECK(finetune.rank >= 1, "plan: --lora-rank must be >= 1, got {}", finetune.rank);
  MESHTRAIN_CHECK(fragmentation >= 0 && fragmentation < 1,
                  "plan: --fragmentation must be in [0, 1), got {}", fragmentation);
  MESHTRAIN_CHECK(reserve_bytes >= 0, "plan: --reserve-gib must be >= 0");
  MESHTRAIN_CHECK(checkpoint_write_bandwidth > 0, "plan: --ckpt-bw must be > 0");
  MESHTRAIN_CHECK(cpu_adam_params_per_second > 0, "plan: --cpu-adam-rate must be > 0");
  MESHTRAIN_CHECK(!fp8 || precision == Precision::bf16,
                  "plan: --fp8 needs --precision bf16 (FP8 GEMMs, bf16 everything else)");
  MESHTRAIN_CHECK(!fp8 || !finetune.adapters(), "plan: --fp8 with LoRA / QLoRA is not modelled");
  MESHTRAIN_CHECK(mtp >= 0, "plan: --mtp must be >= 0, got {}", mtp);
  MESHTRAIN_CHECK(comm_sms >= 0, "plan: --comm-sms must be >= 0, got {}", comm_sms);
}

PlanContext make_context(const ModelConfig& model, const Job& job) {
  model.validate();
  MESHTRAIN_CHECK(!model.moe.enabled() || !job.finetune.adapters(),
                  "plan: LoRA / QLoRA of a mixture-of-experts model is not modelled "
                  "(--finetune full, or a dense model)");
  MESHTRAIN_CHECK(!model.mla.enabled() || !job.finetune.adapters(),
                  "plan: LoRA / QLoRA of latent attention (MLA) is not modelled (--finetune full)");
  PlanContext ctx;
  ctx.model = model;
  ctx.active = active_dense_view(model);
  ctx.counts = count_transformer(model);
  ctx.layer_flops_per_token = layer_train_flops_per_token(model, job.seq);
  ctx.output_flops_per_token = output_train_flops_per_token(model);
  ctx.model_flops_per_token = static_cast<double>(model.n_layers) * ctx.layer_flops_per_token +
                              ctx.output_flops_per_token;
  return ctx;
}

std::string zero_label(const Layout& l) {
  return l.shard > 0 ? fmt::format("{}/{}", l.zero, l.shard) : fmt::format("{}", l.zero);
}

std::string describe(const Layout& l) {
  std::string s = fmt::format("tp {}", l.tp);
  if (l.cp > 1) s += fmt::format(" cp {}", l.cp);
  if (l.ep > 1) s += fmt::format(" ep {}{}", l.ep, l.ep_fold ? " folded" : "");
  s += fmt::format(" pp {}", l.pp);
  if (l.vpp > 1) s += fmt::format(" v {}", l.vpp);
  s += fmt::format(" dp {} zero {} mb {} {}", l.dp, zero_label(l), l.micro_batch,
                   recompute_name(l.recompute));
  if (l.sequence_parallel) s += " sp";
  if (l.offload != Offload::none) s += " offload";
  if (l.schedule == Schedule::gpipe) s += " gpipe";
  return s;
}

std::string check_layout(const PlanContext& ctx, const Cluster& cl, const Job& job,
                         const Layout& l) {
  const ModelConfig& m = ctx.model;
  if (l.tp < 1 || l.pp < 1 || l.vpp < 1 || l.dp < 1 || l.cp < 1 || l.ep < 1 ||
      l.micro_batch < 1) {
    return "tp, cp, ep, pp, vpp, dp and micro-batch must be >= 1";
  }
  if (l.ep > 1) {
    if (!m.moe.enabled()) return "ep > 1 needs a mixture-of-experts model";
    if (l.ep_fold) {
      if (l.tp * l.cp * l.dp % l.ep != 0) {
        return fmt::format("ep {} does not divide tp x cp x dp = {} (--ep-fold)", l.ep,
                           l.tp * l.cp * l.dp);
      }
      if (l.shard > 0) return "--ep-fold with a ZeRO-3 shard group is not modelled";
    } else if (l.dp % l.ep != 0) {
      return fmt::format("ep {} does not divide dp {}", l.ep, l.dp);
    }
    if (m.moe.experts % l.ep != 0) {
      return fmt::format("ep {} does not divide the {} experts", l.ep, m.moe.experts);
    }
    if (l.shard > 0 && l.shard % l.ep != 0) {
      return fmt::format("ep {} does not divide the shard group {}", l.ep, l.shard);
    }
  }
  if (l.zero < 0 || l.zero > 3) return fmt::format("zero stage {} is not 0..3", l.zero);
  if (l.shard != 0) {
    if (l.zero != 3) return "a shard group (hybrid sharding) needs ZeRO-3";
    if (l.shard < 2 || l.shard >= l.dp || l.dp % l.shard != 0) {
      return fmt::format("shard group {} must divide dp {} and be smaller", l.shard, l.dp);
    }
  }
  if (l.tp * l.cp * l.pp * l.dp != cl.gpus) {
    return l.cp > 1 ? fmt::format("tp {} x cp {} x pp {} x dp {} != {} GPUs", l.tp, l.cp, l.pp,
                                  l.dp, cl.gpus)
                    : fmt::format("tp {} x pp {} x dp {} != {} GPUs", l.tp, l.pp, l.dp, cl.gpus);
  }
  if (l.cp > 1 && job.seq % (2 * l.cp) != 0) {
    return fmt::format("cp {} needs seq a multiple of 2 x cp (load-balanced chunks)", l.cp);
  }
  if (m.n_heads % l.tp != 0) return fmt::format("tp {} does not divide {} heads", l.tp, m.n_heads);
  if (m.n_kv_heads % l.tp != 0) {
    return fmt::format("tp {} does not divide {} kv heads", l.tp, m.n_kv_heads);
  }
  if (m.hidden_dim % l.tp != 0) {
    return fmt::format("tp {} does not divide the MLP width {}", l.tp, m.hidden_dim);
  }
  if (l.pp > m.n_layers) return fmt::format("pp {} > {} layers", l.pp, m.n_layers);
  if (!job.pipeline_split.empty()) {
    int64_t sum = 0, fewest = m.n_layers;
    for (int64_t n : job.pipeline_split) {
      sum += n;
      fewest = std::min(fewest, n);
    }
    if (static_cast<int64_t>(job.pipeline_split.size()) != l.pp || sum != m.n_layers ||
        fewest < l.vpp) {
      return fmt::format("--pp-split lists {} stages of {} layers in all (each >= v {}); the "
                         "layout has pp {} and the model {} layers",
                         job.pipeline_split.size(), sum, l.vpp, l.pp, m.n_layers);
    }
  }
  if (l.sequence_parallel && l.tp == 1) return "sequence parallelism needs tp > 1";
  if (job.global_batch % (l.dp * l.micro_batch) != 0) {
    return fmt::format("global batch {} is not a multiple of dp {} x micro-batch {}",
                       job.global_batch, l.dp, l.micro_batch);
  }
  const int64_t m_count = job.global_batch / (l.dp * l.micro_batch);
  if (l.vpp > 1) {
    if (l.schedule != Schedule::interleaved || l.pp == 1) {
      return "virtual stages need the interleaved schedule and pp > 1";
    }
    // Uniform stages hold ceil(L / pp) layers (a stage or two may hold one
    // fewer, as Llama 3's 126 layers on 16 stages), split into v equal chunks.
    const int64_t stage_layers = (m.n_layers + l.pp - 1) / l.pp;
    if (!job.balance_pipeline && stage_layers % l.vpp != 0) {
      return fmt::format("v {} does not divide the {} layers of a stage", l.vpp, stage_layers);
    }
    if (m.n_layers < l.pp * l.vpp) {
      return fmt::format("pp {} x v {} chunks exceed the {} layers", l.pp, l.vpp, m.n_layers);
    }
    if (m_count % l.pp != 0) {
      return fmt::format("interleaving needs micro-batches ({}) a multiple of pp {}", m_count,
                         l.pp);
    }
  }
  if (l.schedule == Schedule::interleaved && l.vpp == 1) return "interleaved needs v > 1";
  if (l.schedule == Schedule::dualpipe && (l.pp < 2 || l.pp % 2 != 0 || m_count % 2 != 0)) {
    return fmt::format("dualpipe needs an even pp >= 2 and an even number of micro-batches "
                       "(pp {}, {} micro-batches)",
                       l.pp, m_count);
  }
  if (l.zero >= 2 && l.pp > 1) {
    return "ZeRO-2/3 with pp > 1 (gradients sharded every micro-batch; DeepSpeed refuses it)";
  }
  return "";
}

double calibrate_efficiency(const PlanContext& ctx, const Cluster& cl, Job job, const Layout& l,
                            double measured) {
  MESHTRAIN_CHECK(measured > 0, "plan: --measured-step-s must be > 0, got {}", measured);
  job.compute_efficiency = 1.0;
  const double fastest = evaluate(ctx, cl, job, l).step_seconds;
  MESHTRAIN_CHECK(measured >= fastest,
                  "plan: a measured step of {:.4g} s is faster than {} can be even at peak "
                  "FLOP/s ({:.4g} s): check the layout, batch and GPU",
                  measured, describe(l), fastest);
  double lo = 1e-4, hi = 1.0;
  for (int i = 0; i < 100 && hi - lo > 1e-9; ++i) {
    job.compute_efficiency = 0.5 * (lo + hi);
    (evaluate(ctx, cl, job, l).step_seconds > measured ? lo : hi) = job.compute_efficiency;
  }
  return 0.5 * (lo + hi);
}

}  // namespace meshtrain::plan
