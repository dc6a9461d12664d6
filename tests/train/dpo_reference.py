#!/usr/bin/python3
"""Float64 reference of DPO's per-pair loss (train/preference.h) for tests/train/dpo_loss_test.cpp.

Deterministic cases (Python's random.Random(seed), so every python and torch draws the same ones:
tests/train/dpo_trl_check.py reuses them) and, in torch float64 with autograd, TRL's formulas:

  sigmoid  −(1 − ε) logσ(βz) − ε logσ(−βz), z = (πc − refc) − (πr − refr). TRL 1.x's "sigmoid"
           is the ε = 0 form (its label_smoothing feeds robust / exo_pair / aot only); the ε term
           is TRL 0.x's sigmoid (cDPO), written as both wrote it.
  ipo      ((πc − refc) / max(nc, 1) − (πr − refr) / max(nr, 1) − 1 / (2β))², TRL 1.x's ipo branch.
  rewards  β (πc − refc) and β (πr − refr): summed log-probabilities, IPO too.

and the loss's derivatives with respect to πc and πr.

usage: /usr/bin/python3 dpo_reference.py [--cases N] [--seed S]   prints {"cases": [...]} as JSON
"""
import argparse
import json
import math
import random
import sys

LOGP_FIELDS = ("policy_chosen", "policy_rejected", "reference_chosen", "reference_rejected")


def make_cases(n=240, seed=20240611):
    """n random cases, then hand-placed ones: large |βz| either side, an empty completion."""
    rng = random.Random(seed)
    cases = []

    def response(tokens, per_token):
        return -tokens * per_token if tokens > 0 else 0.0

    for i in range(n):
        loss = "sigmoid" if i % 3 != 2 else "ipo"
        beta = 10 ** rng.uniform(-2.0, 0.5)
        eps = 0.0 if loss == "ipo" or rng.random() < 0.4 else rng.choice([0.05, 0.1, 0.25, 0.4, 0.5, rng.uniform(0, 0.5)])
        nc, nr = (int(10 ** rng.uniform(0, 3)) for _ in range(2))
        ref_c = response(nc, rng.uniform(0.05, 6.0))
        ref_r = response(nr, rng.uniform(0.05, 6.0))
        spread = rng.choice([1e-3, 0.1, 1.0, 10.0, 100.0])
        cases.append({
            "name": f"random_{i}", "loss": loss, "beta": beta, "label_smoothing": eps,
            "policy_chosen": ref_c + rng.gauss(0, spread), "policy_rejected": ref_r + rng.gauss(0, spread),
            "reference_chosen": ref_c, "reference_rejected": ref_r,
            "chosen_tokens": nc, "rejected_tokens": nr,
        })
    # |βz| from 30 to 2000 (exp(−βz) far below 1 ulp of 1, down to underflow), both signs.
    for j, bz in enumerate([30.0, -30.0, 100.0, -100.0, 300.0, -300.0, 700.0, -700.0, 2000.0, -2000.0]):
        beta = [0.1, 0.5, 1.0, 2.0][j % 4]
        eps = [0.0, 0.0, 0.1, 0.3][j % 4]
        ref_c, ref_r = -812.5, -640.25
        pr = ref_r + 3.0
        pc = ref_c + 3.0 + bz / beta
        cases.append({"name": f"large_{j}", "loss": "sigmoid", "beta": beta, "label_smoothing": eps,
                      "policy_chosen": pc, "policy_rejected": pr, "reference_chosen": ref_c,
                      "reference_rejected": ref_r, "chosen_tokens": 300, "rejected_tokens": 250})
        cases.append({"name": f"large_ipo_{j}", "loss": "ipo", "beta": beta, "label_smoothing": 0.0,
                      "policy_chosen": pc, "policy_rejected": pr, "reference_chosen": ref_c,
                      "reference_rejected": ref_r, "chosen_tokens": 7, "rejected_tokens": 1})
    # An empty rejected completion: its log-probabilities are 0 and TRL's count clamps to 1.
    for loss in ("sigmoid", "ipo"):
        cases.append({"name": f"empty_rejected_{loss}", "loss": loss, "beta": 0.2, "label_smoothing": 0.0,
                      "policy_chosen": -41.5, "policy_rejected": 0.0, "reference_chosen": -43.0,
                      "reference_rejected": 0.0, "chosen_tokens": 12, "rejected_tokens": 0})
    return cases


def reference(case):
    """{loss, chosen_reward, rejected_reward, d_policy_chosen, d_policy_rejected} in float64."""
    import torch
    import torch.nn.functional as F

    t = {k: torch.tensor([case[k]], dtype=torch.float64, requires_grad=k.startswith("policy"))
         for k in LOGP_FIELDS}
    beta, eps = case["beta"], case["label_smoothing"]
    chosen_logratios = t["policy_chosen"] - t["reference_chosen"]
    rejected_logratios = t["policy_rejected"] - t["reference_rejected"]
    if case["loss"] == "sigmoid":
        logits = chosen_logratios - rejected_logratios
        losses = (-F.logsigmoid(beta * logits) * (1 - eps)
                  - F.logsigmoid(-beta * logits) * eps)
    elif case["loss"] == "ipo":
        chosen_n = torch.tensor([case["chosen_tokens"]], dtype=torch.float64).clamp(min=1.0)
        rejected_n = torch.tensor([case["rejected_tokens"]], dtype=torch.float64).clamp(min=1.0)
        ipo_delta = chosen_logratios / chosen_n - rejected_logratios / rejected_n
        losses = (ipo_delta - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown loss {case['loss']!r}")
    loss = losses.mean()
    loss.backward()
    return {
        "loss": loss.item(),
        "chosen_reward": (beta * chosen_logratios.detach()).item(),
        "rejected_reward": (beta * rejected_logratios.detach()).item(),
        "d_policy_chosen": t["policy_chosen"].grad.item(),
        "d_policy_rejected": t["policy_rejected"].grad.item(),
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cases", type=int, default=240)
    p.add_argument("--seed", type=int, default=20240611)
    a = p.parse_args()
    out = []
    for case in make_cases(a.cases, a.seed):
        expected = reference(case)
        if not all(math.isfinite(v) for v in expected.values()):
            sys.exit(f"dpo_reference: {case['name']}: non-finite reference {expected}")
        out.append({**case, "expected": expected})
    json.dump({"source": "torch float64 reference", "cases": out}, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
