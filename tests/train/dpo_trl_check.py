#!/usr/bin/env python3
"""TRL's own DPO loss on dpo_reference.py's cases: run by the hf-venv's python (ctest train.dpo_trl).

For each case, one pair through DPOTrainer._compute_loss (TRL >= 1.0): a trainer made with
object.__new__ holding only what that method reads, reference log-probabilities passed as
precomputed (precompute_ref_log_probs), and a stand-in model whose per-token log-probabilities
put the response's summed log-probability on its first completion token (zeros elsewhere, so
TRL's sum is exact) behind a completion mask of the case's token counts (IPO's divisor). The
loss's gradient reaches the two policy log-probabilities; the rewards are TRL's logged
rewards/chosen and rewards/rejected. Every value must equal dpo_reference.py's to 1e-12 relative
(a sigmoid derivative's relative to the size of its two terms: derivative_scale).

TRL 1.x's "sigmoid" ignores label_smoothing; when the installed one does, the sigmoid cases with
ε > 0 go through its "aot" loss instead, whose per-pair formula on a batch of one pair
(sorting one element is the identity) is −(1 − ε) logσ(βz) − ε logσ(−βz).

Prints {"cases": [...]} like dpo_reference.py, "expected" holding TRL's values, for the C++ test;
exits 77 when trl (or its DPOTrainer._compute_loss) is missing, 1 on a mismatch.
"""
import collections
import json
import math
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dpo_reference  # noqa: E402

SKIP = 77
RTOL = 1e-12


def skip(why):
    print(f"SKIPPED: {why}", file=sys.stderr)
    sys.exit(SKIP)


try:
    import torch
    import trl
    from trl.trainer.dpo_trainer import DPOTrainer
    from trl.trainer.utils import FusedCausalLMOutput
except Exception as e:  # noqa: BLE001: whatever keeps trl from importing is a skip
    skip(f"cannot import trl's DPOTrainer: {type(e).__name__}: {e}")
if not hasattr(DPOTrainer, "_compute_loss"):
    skip(f"trl {trl.__version__}: DPOTrainer has no _compute_loss (this check reads TRL >= 1.0)")


class PairModel(torch.nn.Module):
    """Answers the fused-LM-head forward with fixed per-token log-probabilities."""

    def __init__(self, log_probs):
        super().__init__()
        self.log_probs = log_probs

    def forward(self, labels=None, fused_lm_head=False, **kwargs):
        assert fused_lm_head, "DPOTrainer asks for the fused LM head"
        zeros = torch.zeros_like(self.log_probs.detach())
        return FusedCausalLMOutput(log_probs=self.log_probs, entropy=zeros, mean_logits=zeros,
                                   is_top1=zeros.bool(), label_mask=labels[:, 1:] != -100)


class Accelerator:
    device = torch.device("cpu")

    @staticmethod
    def gather(t):
        return t

    gather_for_metrics = gather


def trainer(beta, loss_type, label_smoothing):
    t = object.__new__(DPOTrainer)
    fields = dict(
        beta=beta, loss_types=[loss_type], loss_weights=[1.0], label_smoothing=label_smoothing,
        ld_alpha=None, f_divergence_type="reverse_kl", f_alpha_divergence_coef=0.5, use_weighting=False,
        aux_loss_enabled=False, precompute_ref_logps=True, ref_model=None, accelerator=Accelerator(),
        _metrics={"train": collections.defaultdict(list), "eval": collections.defaultdict(list)},
        _total_train_tokens=0, _tp_size=1,
        args=types.SimpleNamespace(gradient_checkpointing_kwargs=None, discopop_tau=0.05),
    )
    for k, v in fields.items():
        object.__setattr__(t, k, v)
    return t


def trl_values(case, loss_type, label_smoothing):
    nc, nr = case["chosen_tokens"], case["rejected_tokens"]
    length = 2 + max(nc, nr)  # a one-token prompt, the completion, at least one pad
    completion_mask = torch.zeros(2, length, dtype=torch.long)
    completion_mask[0, 1:1 + nc] = 1
    completion_mask[1, 1:1 + nr] = 1
    attention_mask = completion_mask.clone()
    attention_mask[:, 0] = 1
    pc = torch.tensor(case["policy_chosen"], dtype=torch.float64, requires_grad=True)
    pr = torch.tensor(case["policy_rejected"], dtype=torch.float64, requires_grad=True)
    rest = torch.zeros(length - 2, dtype=torch.float64)
    log_probs = torch.stack([torch.cat([pc.view(1), rest]), torch.cat([pr.view(1), rest])])
    model = PairModel(log_probs).train()
    t = trainer(case["beta"], loss_type, label_smoothing)
    object.__setattr__(t, "model", model)
    inputs = {
        "input_ids": torch.ones(2, length, dtype=torch.long), "attention_mask": attention_mask,
        "completion_mask": completion_mask,
        "ref_chosen_logps": torch.tensor([case["reference_chosen"]], dtype=torch.float64),
        "ref_rejected_logps": torch.tensor([case["reference_rejected"]], dtype=torch.float64),
    }
    loss = t._compute_loss(model, inputs, return_outputs=False)
    loss.backward()
    metrics = t._metrics["train"]
    return {
        "loss": loss.item(),
        "chosen_reward": metrics["rewards/chosen"][-1],
        "rejected_reward": metrics["rewards/rejected"][-1],
        "d_policy_chosen": pc.grad.item(),
        "d_policy_rejected": pr.grad.item(),
    }


def sigmoid_takes_label_smoothing():
    case = {"beta": 0.5, "policy_chosen": -3.0, "policy_rejected": -5.0, "reference_chosen": -4.0,
            "reference_rejected": -4.5, "chosen_tokens": 2, "rejected_tokens": 3}
    return trl_values(case, "sigmoid", 0.25)["loss"] != trl_values(case, "sigmoid", 0.0)["loss"]


def close(a, b, scale=0.0):
    return a == b or abs(a - b) <= RTOL * max(abs(a), abs(b), scale)


def derivative_scale(case):
    """The size of a sigmoid derivative's two terms, β((1 − ε) σ(−x) + ε σ(x)): near its root they
    cancel, and TRL's aot forms z in another order ((πc − πr) − (refc − refr)), so the rounding
    differences there are relative to the terms (as in dpo_loss_test.cpp's derivative_terms)."""
    if case["loss"] != "sigmoid":
        return 0.0
    beta, eps = case["beta"], case["label_smoothing"]
    z = ((case["policy_chosen"] - case["reference_chosen"])
         - (case["policy_rejected"] - case["reference_rejected"]))
    sig = 0.5 * (1 + math.tanh(beta * z / 2))  # σ(βz), for a size only
    return beta * ((1 - eps) * (1 - sig) + eps * sig)


def main():
    smoothing_in_sigmoid = sigmoid_takes_label_smoothing()
    out, bad, via_aot = [], [], 0
    for case in dpo_reference.make_cases():
        loss_type = case["loss"]
        if loss_type == "sigmoid" and case["label_smoothing"] > 0 and not smoothing_in_sigmoid:
            loss_type = "aot"
            via_aot += 1
        got = trl_values(case, loss_type, case["label_smoothing"])
        want = dpo_reference.reference(case)
        for k, v in want.items():
            scale = derivative_scale(case) if k.startswith("d_") else 0.0
            if not (math.isfinite(got[k]) and close(got[k], v, scale)):
                bad.append(f"{case['name']} ({loss_type}): {k}: trl {got[k]!r}, reference {v!r}")
        out.append({**case, "trl_loss_type": loss_type, "expected": got})
    note = (f"trl {trl.__version__}, torch {torch.__version__}: {len(out)} cases"
            + ("" if smoothing_in_sigmoid else
               f"; its sigmoid ignores label_smoothing: {via_aot} sigmoid cases with it through 'aot'"))
    print(note, file=sys.stderr)
    if bad:
        print("\n".join(["dpo_trl_check: TRL and dpo_reference.py differ:"] + bad), file=sys.stderr)
        sys.exit(1)
    json.dump({"source": f"trl {trl.__version__}", "cases": out}, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
