#include "meshtrain/train/metrics.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>

#include "meshtrain/util/error.h"

namespace meshtrain {

nlohmann::json json_number(double value) {
  return std::isfinite(value) ? nlohmann::json(value) : nlohmann::json(nullptr);
}

MetricsLog::MetricsLog(std::string path, bool append, const TrainSettings& train, bool console,
                       bool show_comm)
    : path_(std::move(path)),
      train_(train),
      console_(console),
      show_comm_(show_comm),
      progress_(console ? stdout : nullptr, "auto", "train", "train"),
      out_(path_, !append, "metrics file") {}

void MetricsLog::write(const nlohmann::json& record) {
  out_.append(record.dump());
}

// The console's preference part: the step's mean rewards and accuracy.
std::string preference_summary(const StepRecord& r) {
  if (!r.preference) return "";
  return fmt::format(" | rewards chosen {:.3f} rejected {:.3f} margin {:.3f} acc {:.2f}",
                     r.reward_chosen, r.reward_rejected, r.reward_margin, r.reward_accuracy);
}

// The console's MoE part: the worst layer's expert-load imbalance and the
// layers' mean load-balancing statistic; empty for a dense model.
std::string moe_summary(const std::vector<MoeLayerRecord>& layers) {
  if (layers.empty()) return "";
  double worst = 0, aux = 0;
  for (const MoeLayerRecord& m : layers) {
    worst = std::max(worst, m.imbalance);
    aux += m.aux / static_cast<double>(layers.size());
  }
  return fmt::format(" | experts max/mean {:.2f}, balance {:.3f}", worst, aux);
}

void MetricsLog::on_step(const StepRecord& r) {
  nlohmann::json record{{"step", r.step},
                        {"loss", json_number(r.loss)},
                        {"lr", r.lr},
                        {"grad_norm", json_number(r.grad_norm)},
                        {"tokens_per_s", r.tokens_per_s},
                        {"loss_tokens", r.loss_tokens},
                        {"mfu", r.mfu},
                        {"step_ms", r.step_ms},
                        {"data_ms", r.data_ms},
                        {"comm_ms", r.comm_ms},
                        {"exposed_comm_ms", r.exposed_comm_ms},
                        {"optimizer_ms", r.optimizer_ms},
                        {"gates_ms", r.gates_ms},
                        {"comm_bytes", r.comm_bytes},
                        {"tp_comm_bytes", r.tp_comm_bytes},
                        {"ep_comm_bytes", r.ep_comm_bytes},
                        {"ep_comm_ms", r.ep_comm_ms},
                        {"skipped", r.skipped},
                        {"skipped_steps", r.skipped_steps},
                        {"loss_scale", r.loss_scale}};
  if (r.skipped) record["skip_reason"] = r.skip_reason;
  if (r.offloaded) {
    record["offload_read_bytes"] = r.offload_read_bytes;
    record["offload_written_bytes"] = r.offload_written_bytes;
    record["offload_ready"] = r.offload_ready;
    record["offload_waited"] = r.offload_waited;
  }
  if (r.pipelined) {
    record["pp_busy_ms"] = r.pp_busy_ms;
    record["pp_wait_ms"] = r.pp_wait_ms;
    record["pp_schedule_ms"] = r.pp_schedule_ms;
    record["pp_bubble"] = r.pp_bubble;
    record["pp_bubble_theory"] = r.pp_bubble_theory;
    record["pp_in_flight"] = r.pp_in_flight;
  }
  if (r.preference) {
    record["rewards_chosen"] = r.reward_chosen;
    record["rewards_rejected"] = r.reward_rejected;
    record["rewards_margin"] = r.reward_margin;
    record["rewards_accuracy"] = r.reward_accuracy;
  }
  if (!r.moe.empty()) {
    nlohmann::json layers = nlohmann::json::array();
    for (const MoeLayerRecord& m : r.moe) {
      layers.push_back({{"layer", m.layer},
                        {"tokens_min", m.tokens_min},
                        {"tokens_mean", m.tokens_mean},
                        {"tokens_max", m.tokens_max},
                        {"imbalance", m.imbalance},
                        {"dropped", m.dropped},
                        {"aux", m.aux},
                        {"z", m.z},
                        {"bias_min", m.bias_min},
                        {"bias_max", m.bias_max}});
    }
    record["moe"] = std::move(layers);
  }
  write(record);
  if (console_ && progress_.bar()) {
    draw_progress(r);
    return;
  }
  if (console_ && (r.step % train_.log_interval == 0 || r.step == 1 || r.step == train_.steps)) {
    fmt::print("step {:>5}/{} | loss {:.4f} | lr {:.3e} | grad_norm {:.3f} | {:.0f} tok/s | "
               "MFU {:.1f}% | {:.1f} ms{}{}{}{}\n",
               r.step, train_.steps, r.loss, r.lr, r.grad_norm, r.tokens_per_s, r.mfu * 100,
               r.step_ms,
               preference_summary(r) + moe_summary(r.moe) + (r.ep_comm_bytes > 0
                                         ? fmt::format(" | all-to-all {:.1f} ms, {:.2f} MB",
                                                       r.ep_comm_ms, r.ep_comm_bytes / 1e6)
                                         : ""),
               show_comm_
                   ? fmt::format(" | comm {:.1f} ms, {:.1f} exposed", r.comm_ms, r.exposed_comm_ms)
                   : "",
               r.loss_scale != 1.0 ? fmt::format(" | loss scale {:g}", r.loss_scale) : "",
               r.skipped ? fmt::format(" | skipped ({}; {} so far)", r.skip_reason, r.skipped_steps)
                         : "");
    std::fflush(stdout);
  }
  if (r.rolled_back) {
    write({{"step", r.step},
           {"event", "rollback"},
           {"from_step", r.step},
           {"to_step", r.rollback_to_step},
           {"skipped_batches", r.rollback_skipped_batches},
           {"checkpoint", r.rollback_checkpoint},
           {"reason", r.rollback_reason}});
    if (console_) {
      fmt::print("step {:>5}/{} | rollback to step {} ({}): {}; the data skips {} batches\n",
                 r.step, train_.steps, r.rollback_to_step, r.rollback_checkpoint,
                 r.rollback_reason, r.rollback_skipped_batches);
      std::fflush(stdout);
    }
  }
}

void MetricsLog::draw_progress(const StepRecord& r) {
  const auto now = std::chrono::steady_clock::now();
  if (first_step_ < 0) {
    first_step_ = r.step;
    first_end_ = now;
  }
  const int64_t left = train_.steps - r.step;
  const double per_step_s =
      r.step > first_step_
          ? std::chrono::duration<double>(now - first_end_).count() /
                static_cast<double>(r.step - first_step_)
          : r.step_ms / 1e3;
  progress_.draw(static_cast<double>(r.step) / static_cast<double>(train_.steps),
                 fmt::format("step {}/{} | loss {:.4f} | {:.0f} tok/s | ETA {}{}", r.step,
                             train_.steps, r.loss, r.tokens_per_s,
                             format_duration(per_step_s * static_cast<double>(left)),
                             r.skipped ? " | skipped" : ""),
                 r.step == train_.steps);
}

void MetricsLog::on_eval(int64_t step, double val_loss) {
  write({{"step", step}, {"val_loss", json_number(val_loss)}});
  if (console_) {
    progress_.line(fmt::format("step {:>5}/{} | val_loss {:.4f}", step, train_.steps, val_loss));
  }
}

void MetricsLog::on_checkpoint(int64_t step, const std::string& dir) {
  write({{"step", step}, {"checkpoint", dir}});
  if (console_) {
    progress_.line(fmt::format("checkpoint: {}", dir));
  }
}

}  // namespace meshtrain
