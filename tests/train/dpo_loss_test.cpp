// DPO's per-pair loss (train/preference.h dpo_pair_loss): hand-worked cases
// (a zero margin, label smoothing as softplus(−x) + εx, IPO at its target,
// margins far past exp's range), then agreement to 1e-12 relative with
// tests/train/dpo_reference.py, TRL's formulas in torch float64 with autograd
// under Debian's python3.
//
// Under ctest's train.dpo_trl, MESHTRAIN_DPO_TRL_PYTHON names the hf-venv's
// python: the same cases then go through TRL's DPOTrainer itself
// (tests/train/dpo_trl_check.py, which checks TRL against the reference), and
// a python or trl that is missing makes the process exit 77 (ctest's
// SKIP_RETURN_CODE) instead of passing.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>

#include "meshtrain/train/preference.h"

namespace meshtrain {
namespace {

PairLogps pair_with_margin(double z) {
  PairLogps p;
  p.reference_chosen = -40.0;
  p.reference_rejected = -35.0;
  p.policy_chosen = -40.0 + z + 1.5;
  p.policy_rejected = -35.0 + 1.5;
  p.chosen_tokens = 10;
  p.rejected_tokens = 8;
  return p;
}

TEST(DpoLoss, ZeroMarginIsLogTwo) {
  for (double beta : {0.01, 0.1, 1.0, 3.0}) {
    const PairLoss l = dpo_pair_loss({.beta = beta}, pair_with_margin(0));
    EXPECT_DOUBLE_EQ(l.loss, std::log(2.0));
    EXPECT_DOUBLE_EQ(l.d_policy_chosen, -beta / 2);
    EXPECT_DOUBLE_EQ(l.d_policy_rejected, beta / 2);
    EXPECT_DOUBLE_EQ(l.chosen_reward, beta * 1.5);
    EXPECT_DOUBLE_EQ(l.rejected_reward, beta * 1.5);
  }
}

// −(1 − ε) log σ(x) − ε log σ(−x) = softplus(−x) + ε x: d/dx = ε − σ(−x).
TEST(DpoLoss, LabelSmoothing) {
  const double beta = 0.5;
  for (double eps : {0.0, 0.1, 0.25, 0.5}) {
    for (double z : {-6.0, -0.5, 0.0, 2.0, 9.0}) {
      const double x = beta * z;
      const PairLoss l = dpo_pair_loss({.beta = beta, .label_smoothing = eps}, pair_with_margin(z));
      EXPECT_NEAR(l.loss, std::log1p(std::exp(-x)) + eps * x, 1e-14) << eps << " " << z;
      const double d = beta * (eps - 1 / (1 + std::exp(x)));
      EXPECT_NEAR(l.d_policy_chosen, d, 1e-15) << eps << " " << z;
      EXPECT_NEAR(l.d_policy_rejected, -d, 1e-15) << eps << " " << z;
    }
  }
  // At z = 0 the smoothed pull is smaller: −β (1 − 2ε) / 2.
  const PairLoss half = dpo_pair_loss({.beta = 0.2, .label_smoothing = 0.3}, pair_with_margin(0));
  EXPECT_DOUBLE_EQ(half.loss, std::log(2.0));
  EXPECT_DOUBLE_EQ(half.d_policy_chosen, -0.2 * 0.4 / 2);
}

TEST(DpoLoss, LargeMarginsStayFinite) {
  const DpoSettings s{.beta = 1.0};
  for (double z : {50.0, 800.0, 1e5}) {
    const PairLoss won = dpo_pair_loss(s, pair_with_margin(z));
    EXPECT_GE(won.loss, 0.0);
    EXPECT_NEAR(won.loss, std::exp(-z), 1e-300 + 1e-15 * std::exp(-z));
    EXPECT_LE(won.d_policy_chosen, 0.0);
    EXPECT_NEAR(won.d_policy_chosen, -std::exp(-z), 1e-300 + 1e-15 * std::exp(-z));
    const PairLoss lost = dpo_pair_loss(s, pair_with_margin(-z));
    EXPECT_DOUBLE_EQ(lost.loss, z);
    EXPECT_DOUBLE_EQ(lost.d_policy_chosen, -1.0);
    EXPECT_DOUBLE_EQ(lost.d_policy_rejected, 1.0);
  }
  // Smoothed, a pair won by far still pulls back with ε β.
  const PairLoss smoothed = dpo_pair_loss({.beta = 2.0, .label_smoothing = 0.1}, pair_with_margin(1e4));
  EXPECT_DOUBLE_EQ(smoothed.loss, 0.1 * 2e4);
  EXPECT_DOUBLE_EQ(smoothed.d_policy_chosen, 0.2);
}

// IPO: (z' − 1/(2β))², z' the log-ratios per completion token.
TEST(DpoLoss, IpoAtTargetHasZeroLossAndGradient) {
  PairLogps p;
  p.policy_chosen = -10;
  p.reference_chosen = -14;
  p.chosen_tokens = 2;  // chosen: 4 / 2 = 2
  p.policy_rejected = -7;
  p.reference_rejected = -7;
  p.rejected_tokens = 3;  // rejected: 0
  const DpoSettings ipo{.beta = 0.25, .loss = DpoLoss::ipo};  // target 1 / (2β) = 2
  const PairLoss l = dpo_pair_loss(ipo, p);
  EXPECT_EQ(l.loss, 0.0);
  EXPECT_EQ(l.d_policy_chosen, 0.0);
  EXPECT_EQ(l.d_policy_rejected, 0.0);
  EXPECT_EQ(l.chosen_reward, 0.25 * 4);  // summed, not per token
  EXPECT_EQ(l.rejected_reward, 0.0);

  p.policy_rejected = -10;  // rejected: −3 / 3 = −1, z' = 3: one past the target
  const PairLoss past = dpo_pair_loss(ipo, p);
  EXPECT_DOUBLE_EQ(past.loss, 1.0);
  EXPECT_DOUBLE_EQ(past.d_policy_chosen, 2.0 / 2);
  EXPECT_DOUBLE_EQ(past.d_policy_rejected, -2.0 / 3);
  EXPECT_DOUBLE_EQ(past.rejected_reward, 0.25 * -3);

  p.rejected_tokens = 0;  // a count of 0 is taken as 1 (TRL's clamp): z' = 2 + 3, three past
  const PairLoss clamped = dpo_pair_loss(ipo, p);
  EXPECT_DOUBLE_EQ(clamped.loss, 9.0);
  EXPECT_DOUBLE_EQ(clamped.d_policy_rejected, -2.0 * 3);
}

int exit_code(int status) { return status != -1 && WIFEXITED(status) ? WEXITSTATUS(status) : -1; }

std::string quote(const std::string& s) { return "'" + s + "'"; }

// The command's standard output and exit code (its standard error passes through).
std::pair<std::string, int> output_of(const std::string& command) {
  std::fflush(stdout);
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) return {"", -1};
  std::string out;
  char buf[1 << 16];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, pipe)) > 0;) out.append(buf, n);
  return {out, exit_code(::pclose(pipe))};
}

DpoSettings settings_of(const nlohmann::json& c) {
  DpoSettings s;
  s.beta = c.at("beta").get<double>();
  const std::string loss = c.at("loss").get<std::string>();
  if (loss == "sigmoid") {
    s.loss = DpoLoss::sigmoid;
  } else if (loss == "ipo") {
    s.loss = DpoLoss::ipo;
  } else {
    ADD_FAILURE() << "unknown loss " << loss;
  }
  s.label_smoothing = c.at("label_smoothing").get<double>();
  return s;
}

PairLogps logps_of(const nlohmann::json& c) {
  PairLogps p;
  p.policy_chosen = c.at("policy_chosen").get<double>();
  p.policy_rejected = c.at("policy_rejected").get<double>();
  p.reference_chosen = c.at("reference_chosen").get<double>();
  p.reference_rejected = c.at("reference_rejected").get<double>();
  p.chosen_tokens = c.at("chosen_tokens").get<int64_t>();
  p.rejected_tokens = c.at("rejected_tokens").get<int64_t>();
  return p;
}

// The size of a sigmoid derivative's two terms, β((1 − ε) σ(−x) + ε σ(x)). Near the
// derivative's root they cancel (ε = 0.5 and x ≈ 0: 1e-4 of them left), and there the ulp
// differences of exp and log1p (glibc's here, torch's own there) and, through TRL's aot
// (dpo_trl_check.py), z formed in another order are relative to the terms, not the result.
double derivative_terms(const DpoSettings& s, const PairLogps& p) {
  if (s.loss != DpoLoss::sigmoid) return 0;
  const double x = s.beta * ((p.policy_chosen - p.reference_chosen) - (p.policy_rejected - p.reference_rejected));
  const double sig = 0.5 * (1 + std::tanh(x / 2));
  return s.beta * ((1 - s.label_smoothing) * (1 - sig) + s.label_smoothing * sig);
}

// Every case's values against dpo_pair_loss's, to 1e-12 relative (a sigmoid derivative's
// relative to the larger of itself and its terms).
void expect_matches(const nlohmann::json& cases) {
  ASSERT_GT(cases.size(), 200u);
  for (const nlohmann::json& c : cases) {
    const DpoSettings s = settings_of(c);
    const PairLogps p = logps_of(c);
    const PairLoss got = dpo_pair_loss(s, p);
    const nlohmann::json& want = c.at("expected");
    const double terms = derivative_terms(s, p);
    auto check = [&](const char* key, double value, double floor) {
      const double w = want.at(key).get<double>();
      EXPECT_TRUE(std::isfinite(value)) << c.at("name") << " " << key;
      EXPECT_LE(std::abs(value - w), 1e-12 * std::max({std::abs(w), std::abs(value), floor}))
          << c.at("name") << " " << key << ": " << value << " vs " << w << " (" << c.dump() << ")";
    };
    check("loss", got.loss, 0);
    check("chosen_reward", got.chosen_reward, 0);
    check("rejected_reward", got.rejected_reward, 0);
    check("d_policy_chosen", got.d_policy_chosen, terms);
    check("d_policy_rejected", got.d_policy_rejected, terms);
  }
}

const std::string kScripts = std::string(MESHTRAIN_SOURCE_DIR) + "/tests/train/";

TEST(DpoReference, MatchesTorchFloat64) {
  const std::string python = "/usr/bin/python3";
  if (exit_code(std::system((quote(python) + " -c 'import torch' >/dev/null 2>&1").c_str())) != 0)
    GTEST_SKIP() << python << " cannot import torch";
  const std::string command = quote(python) + " " + quote(kScripts + "dpo_reference.py");
  const auto [out, rc] = output_of(command);
  ASSERT_EQ(rc, 0) << command;
  expect_matches(nlohmann::json::parse(out).at("cases"));
}

TEST(DpoReference, MatchesTrl) {
  const char* trl_python = std::getenv("MESHTRAIN_DPO_TRL_PYTHON");
  if (trl_python == nullptr || *trl_python == '\0')
    GTEST_SKIP() << "MESHTRAIN_DPO_TRL_PYTHON unset (ctest train.dpo_trl sets it)";
  const std::string python = trl_python;
  if (exit_code(std::system((quote(python) + " -c 'import torch' >/dev/null 2>&1").c_str())) != 0) {
    std::printf("SKIPPED: %s cannot import torch\n", python.c_str());
    std::fflush(stdout);
    std::exit(77);  // ctest's train.dpo_trl: a skip (SKIP_RETURN_CODE)
  }
  const std::string command = quote(python) + " " + quote(kScripts + "dpo_trl_check.py");
  const auto [out, rc] = output_of(command);
  if (rc == 77) {  // trl not importable
    std::fflush(stdout);
    std::exit(77);
  }
  ASSERT_EQ(rc, 0) << command;
  expect_matches(nlohmann::json::parse(out).at("cases"));
}

}  // namespace
}  // namespace meshtrain
