"""Writes the parity fixtures meshtrain's tests compare against (deterministic).

    /usr/bin/python3 tests/reference/generate_fixtures.py --out tests/reference/fixtures

For each case (llama_gqa, gpt2):
  <case>.weights.safetensors    initial weights, registry names and layout, F32;
                                __metadata__ "config" = config.json text
  <case>.reference.safetensors  tokens/targets [B, T] I32, logits [B*T, V], loss [1],
                                grad/<name> (gradient of the mean loss), and a 20-step
                                AdamW run: train/tokens [steps, B, T+1],
                                train/loss_fp32, train/grad_norm (float64 reference),
                                train/loss_bf16 (torch bf16 autocast, for the tolerance);
                                __metadata__ holds the optimizer settings.
  <case>.lora.safetensors       LoRA adapters (registry names) on those weights, the loss
                                and grad/<adapter> (base frozen); the same with adapter
                                dropout under dropout/ (and dropout/samples, the rows' sample
                                indices); __metadata__ rank, alpha, targets, dropout settings.
  <case>.qlora.safetensors      QLoRA (lora.quantize_base = nf4): the same adapters on the
                                base whose block linears (every module LoRA can target) are
                                their NF4 round trip (tests/tensor/nf4_reference.py: quantise
                                the f32 weight, dequantise in f32): nf4/<name> those values
                                (F32), nf4_packed/<name> the packed bytes (I32 words, little
                                endian), the loss and grad/<adapter> with them (float64);
                                __metadata__ rank, alpha, targets, quantize_base.
  <case>.dpo.safetensors        one DPO / IPO step (train/preference.h) on preference rows of
                                the case's seq length: tokens/targets/positions [B, T] I32
                                (segments chosen, rejected, chosen, rejected, ... of 1-2
                                pairs, each a prompt with targets -1 then its response, then
                                padding: input pad, target -1, positions from 0), responses
                                [B, T] I32 (2k / 2k + 1: the row's pair k's chosen / rejected,
                                -1 outside the loss); policy_logps / reference_logps [2 pairs]
                                F64 (summed response log-probabilities, row order: lora's
                                adapters on, and the base alone). Per variant V of DPO_VARIANTS
                                (sigmoid, smooth: label smoothing 0.2, ipo): V/loss (mean over
                                pairs), V/reward_chosen, V/reward_rejected, V/reward_margin,
                                V/reward_accuracy and V/grad/<adapter> of the mean loss (base
                                frozen). full/: full fine-tuning, all base weights trainable
                                and the reference the same weights (z = 0: loss log 2):
                                full/loss, full/grad/<name>. __metadata__ variants and full
                                (the [dpo] settings as JSON), pad, pairs.
moe_<case>.weights.safetensors / .reference.safetensors: Llamas with mixture-of-experts
feed-forwards (MOE_CASES; __metadata__ "moe" = the [moe] settings as JSON): tokens, targets,
logits, loss (cross-entropy), aux (the auxiliary losses' sum, coefficients applied) and
grad/<name> of loss + aux.
stories260k.reference.safetensors: logits of a fixed id sequence and greedy ids from BOS
(with the top-1/top-2 logit margins), from the llama2.c file tests/models/stories260K.bin.
All math is float64 from the float32-rounded weights, so the C++ fp32 error is what is measured.
"""
import argparse
import json
import os
import struct
import sys

import numpy as np
import torch
import torch.nn.functional as F

import reference_model as ref
import stfile

# NF4 with double quantisation, from its definition (tests/tensor/nf4_reference.py).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tensor"))
import nf4_reference as nf4  # noqa: E402

CASES = {
    # GQA, untied, head_dim 8, a hidden size and vocab that are not multiples of 16.
    "llama_gqa": ref.Config("llama", dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=72,
                            vocab_size=97, max_seq_len=16, tie_embeddings=False),
    # Sequence 12 < max_seq_len 16: the unused position rows must get zero gradient.
    "gpt2": ref.Config("gpt2", dim=32, n_layers=2, n_heads=4, n_kv_heads=4, hidden_dim=128,
                       vocab_size=97, max_seq_len=16),
}
SEQ = {"llama_gqa": 16, "gpt2": 12}
BATCH = 2
TRAIN = dict(steps=20, lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
             max_grad_norm=1.0)
STORIES_IDS = [1, 365, 301, 471, 30, 9, 266, 94, 260, 324, 31, 70, 418, 13, 452, 33,
               1, 500, 2, 77, 128, 256, 411, 7]
STORIES_GREEDY = 40


def init_weights(c, seed):
    """Scales chosen so attention is far from uniform and every term matters."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shape, kind) in ref.param_shapes(c).items():
        x = torch.randn(shape, generator=g, dtype=torch.float64)
        if kind == "norm":
            x = 1.0 + 0.2 * x
        elif kind == "bias":
            x = 0.1 * x
        elif "embed" in name or "wte" in name or "wpe" in name:
            x = 0.5 * x
        else:
            x = x / np.sqrt(shape[0] if c.family == "gpt2" else shape[-1])  # 1/sqrt(fan_in)
        out[name] = x.to(torch.float32).to(torch.float64)  # what the f32 file holds
    return out


def leaf_copy(P, dtype):
    return {k: v.detach().clone().to(dtype).requires_grad_(True) for k, v in P.items()}


def decay_groups(P, c, wd):
    shapes = ref.param_shapes(c)
    decay = [P[k] for k in P if shapes[k][1] == "matrix"]
    no_decay = [P[k] for k in P if shapes[k][1] != "matrix"]
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


def train_trace(P0, c, batches, dtype, autocast):
    P = leaf_copy(P0, dtype)
    opt = torch.optim.AdamW(decay_groups(P, c, TRAIN["weight_decay"]), lr=TRAIN["lr"],
                            betas=(TRAIN["beta1"], TRAIN["beta2"]), eps=TRAIN["eps"])
    losses, norms = [], []
    for batch in batches:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = ref.mean_loss(P, c, batch[:, :-1], batch[:, 1:])
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(list(P.values()), TRAIN["max_grad_norm"])
        losses.append(loss.item())
        norms.append(norm.item())
        opt.step()
    return losses, norms


def f32(t):
    return t.detach().to(torch.float32).numpy()


def model_case(name, c, out_dir, seed):
    P0 = init_weights(c, seed)
    g = torch.Generator().manual_seed(seed + 1)
    T = SEQ[name]
    data = torch.randint(0, c.vocab_size, (BATCH, T + 1), generator=g)
    tokens, targets = data[:, :-1], data[:, 1:]
    # Two batches, alternating, so the loss falls visibly (memorisation) in 20 steps.
    pool = torch.randint(0, c.vocab_size, (2, BATCH, T + 1), generator=g)
    batches = pool[torch.arange(TRAIN["steps"]) % 2]

    config_text = json.dumps(c.hf_config(), indent=2)
    stfile.write(os.path.join(out_dir, f"{name}.weights.safetensors"),
                 {k: f32(v) for k, v in P0.items()}, {"config": config_text})

    P = leaf_copy(P0, torch.float64)
    logits = ref.logits(P, c, tokens)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, c.vocab_size), targets.reshape(-1))
    loss.backward()

    losses, norms = train_trace(P0, c, batches, torch.float64, autocast=False)
    bf16_losses, _ = train_trace(P0, c, batches, torch.float32, autocast=True)
    dev = max(abs(a - b) / abs(b) for a, b in zip(bf16_losses, losses))
    print(f"{name}: loss {loss.item():.6f}, trace {losses[0]:.4f} -> {losses[-1]:.4f}, "
          f"grad norms {min(norms):.3f}..{max(norms):.3f} (clip {TRAIN['max_grad_norm']}), "
          f"torch bf16 autocast vs float64: max rel {dev:.2e}")

    tensors = {"tokens": tokens.to(torch.int32).numpy(), "targets": targets.to(torch.int32).numpy(),
               "logits": f32(logits.reshape(-1, c.vocab_size)), "loss": np.array([loss.item()])}
    for k, v in P.items():
        tensors["grad/" + k] = f32(v.grad)
    tensors["train/tokens"] = batches.to(torch.int32).numpy()
    tensors["train/loss_fp32"] = np.array(losses)
    tensors["train/grad_norm"] = np.array(norms)
    tensors["train/loss_bf16"] = np.array(bf16_losses)
    meta = {k: repr(v) for k, v in TRAIN.items()}
    meta["config"] = config_text
    stfile.write(os.path.join(out_dir, f"{name}.reference.safetensors"), tensors, meta)
    sft_case(name, c, P0, out_dir, seed)


def sft_case(name, c, P0, out_dir, seed):
    """Packed SFT rows: records of (lengths) per row, positions restarting at 0,
    prompt and padding targets -1 (ignore_index), the loss the mean over the
    loss tokens. <case>.sft.safetensors: tokens/targets/positions [B, T] I32,
    loss [1], grad/<name>."""
    T = SEQ[name]
    lengths = [[5, 4, T - 9], [7, T - 10, 3]]  # the last record of row 1 is padding
    g = torch.Generator().manual_seed(seed + 2)
    tokens = torch.randint(0, c.vocab_size, (BATCH, T), generator=g)
    targets = torch.randint(0, c.vocab_size, (BATCH, T), generator=g)
    positions = torch.zeros(BATCH, T, dtype=torch.long)
    for b, row in enumerate(lengths):
        at = 0
        for r, n in enumerate(row):
            positions[b, at:at + n] = torch.arange(n)
            targets[b, at:at + 2] = -1  # each record's first two targets: its prompt
            if b == 1 and r == len(row) - 1:
                targets[b, at:at + n] = -1  # padding
            at += n
    P = leaf_copy(P0, torch.float64)
    out = ref.logits(P, c, tokens, positions=positions)
    loss = torch.nn.functional.cross_entropy(out.reshape(-1, c.vocab_size), targets.reshape(-1),
                                             ignore_index=-1)
    loss.backward()
    print(f"{name} sft: loss {loss.item():.6f} over {(targets >= 0).sum().item()} loss tokens")
    tensors = {"tokens": tokens.to(torch.int32).numpy(), "targets": targets.to(torch.int32).numpy(),
               "positions": positions.to(torch.int32).numpy(), "loss": np.array([loss.item()])}
    for k, v in P.items():
        tensors["grad/" + k] = f32(v.grad)
    stfile.write(os.path.join(out_dir, f"{name}.sft.safetensors"), tensors, {})


# LoRA: every target of the family, rank 4; random A and B (B != 0, unlike LoRA's
# init, so every adapter gradient is non-zero).
LORA = {"llama_gqa": dict(rank=4, alpha=8.0, targets=["q_proj", "k_proj", "v_proj", "o_proj",
                                                      "gate_proj", "up_proj", "down_proj"]),
        "gpt2": dict(rank=4, alpha=8.0, targets=["c_attn", "c_proj", "c_fc"])}


# Adapter dropout: p, the run's seed and step, and the sample index of each batch row.
LORA_DROPOUT = dict(p=0.25, seed=5, step=3, samples=[17, 4])


def lora_adapters(c, spec, seed):
    """The case's adapters (float64 holding f32 values), registry order."""
    g = torch.Generator().manual_seed(seed + 7)
    return {k: (0.1 * torch.randn(shape, generator=g, dtype=torch.float64)).to(torch.float32)
            .to(torch.float64) for k, shape in ref.lora_shapes(c, spec["rank"],
                                                             spec["targets"]).items()}


def reference_batch(out_dir, name):
    """The tokens and targets of the case's reference file."""
    ref_file = stfile.read(os.path.join(out_dir, f"{name}.reference.safetensors"))[0]
    return (torch.from_numpy(ref_file["tokens"].astype(np.int64)),
            torch.from_numpy(ref_file["targets"].astype(np.int64)))


def lora_case(name, c, out_dir, seed):
    """<case>.lora.safetensors: adapters of the case's base weights (same tokens as the
    reference), the mean loss and the gradients of the adapters only (the base is frozen)."""
    P0 = init_weights(c, seed)
    tokens, targets = reference_batch(out_dir, name)
    spec = LORA[name]
    adapters = lora_adapters(c, spec, seed)
    scale = spec["alpha"] / spec["rank"]
    tensors = {k: f32(v) for k, v in adapters.items()}
    # Without dropout, then with LORA_DROPOUT's mask (keyed by sample index and position).
    drop = LORA_DROPOUT
    samples = list(drop["samples"][:tokens.shape[0]])
    for prefix, dropout in (("", None), ("dropout/", ref.lora_dropout(
            drop["p"], drop["seed"], drop["step"], samples, tokens.shape[1]))):
        P = {k: v.clone() for k, v in P0.items()}
        P.update({k: v.clone().requires_grad_(True) for k, v in adapters.items()})
        out = ref.logits(P, c, tokens, lora_scale=scale, dropout=dropout)
        loss = torch.nn.functional.cross_entropy(out.reshape(-1, c.vocab_size),
                                                 targets.reshape(-1))
        loss.backward()
        tensors[prefix + "loss"] = np.array([loss.item()])
        for k in adapters:
            tensors[prefix + "grad/" + k] = f32(P[k].grad)
    tensors["dropout/samples"] = np.array(samples, dtype=np.int64)
    meta = {"rank": str(spec["rank"]), "alpha": repr(spec["alpha"]),
            "targets": ",".join(spec["targets"]), "dropout": repr(drop["p"]),
            "dropout_seed": str(drop["seed"]), "dropout_step": str(drop["step"])}
    stfile.write(os.path.join(out_dir, f"{name}.lora.safetensors"), tensors, meta)
    print(f"{name} lora: loss {loss.item():.6f}, {len(adapters)} adapter tensors")


# DPO / IPO ([dpo] settings per variant; train/preference.h). IPO's beta is larger so its
# target margin 1 / (2 beta) is of the log-ratios' size.
DPO_VARIANTS = {"sigmoid": dict(loss="sigmoid", beta=0.1, label_smoothing=0.0),
                "smooth": dict(loss="sigmoid", beta=0.1, label_smoothing=0.2),
                "ipo": dict(loss="ipo", beta=0.5, label_smoothing=0.0)}
DPO_FULL = dict(loss="sigmoid", beta=0.1, label_smoothing=0.0)
DPO_PAIRS = 5


def preference_rows(c, T, g):
    """DPO_PAIRS random pairs (a prompt shared by chosen and rejected, each response 1-4
    tokens) packed greedily in order into rows of T as meshtrain's SftDataset packs them
    (a pair never split; a row closed when the next pair does not fit), padded with the
    last token id. Returns tokens, targets, positions, responses [B, T] and the pad id.
    Retries (same generator) until every row holds 1 or 2 pairs, some row 2, some row 1,
    and some row padding."""
    pad = c.vocab_size - 1
    while True:
        pairs = []
        while len(pairs) < DPO_PAIRS:
            prompt = 2 + int(torch.randint(0, 3, (1,), generator=g))
            chosen, rejected = (1 + int(n) for n in torch.randint(0, 4, (2,), generator=g))
            size = (prompt + chosen - 1) + (prompt + rejected - 1)
            if T // 3 < size <= T:
                pairs.append((torch.randint(0, c.vocab_size, (prompt,), generator=g),
                              torch.randint(0, c.vocab_size, (chosen,), generator=g),
                              torch.randint(0, c.vocab_size, (rejected,), generator=g)))
        rows, fill = [], T
        for pair in pairs:
            size = sum(len(pair[0]) + len(r) - 1 for r in pair[1:])
            if fill + size > T:
                rows.append([])
                fill = 0
            rows[-1].append(pair)
            fill += size
        counts = [len(r) for r in rows]
        padded = any(sum(len(p[0]) + len(r) - 1 for p in row for r in p[1:]) < T for row in rows)
        if max(counts) == 2 and min(counts) == 1 and padded:
            break
    B = len(rows)
    tokens = torch.full((B, T), pad, dtype=torch.long)
    targets = torch.full((B, T), -1, dtype=torch.long)
    positions = torch.zeros(B, T, dtype=torch.long)
    responses = torch.full((B, T), -1, dtype=torch.long)
    for b, row in enumerate(rows):
        at = 0
        for k, (prompt, *answers) in enumerate(row):
            for j, answer in enumerate(answers):  # chosen, rejected
                record = torch.cat([prompt, answer])  # n tokens: n - 1 (input, target) pairs
                n = len(record) - 1
                tokens[b, at:at + n] = record[:-1]
                positions[b, at:at + n] = torch.arange(n)
                first = at + len(prompt) - 1  # predicts the response's first token
                targets[b, first:at + n] = answer
                responses[b, first:at + n] = 2 * k + j
                at += n
        positions[b, at:] = torch.arange(T - at)
    return tokens, targets, positions, responses, pad


def response_logps(P, c, tokens, targets, positions, responses, lora_scale):
    """Each response's summed log-probability, in row order (per row: pair k's chosen at
    2k, rejected at 2k + 1), and its token count."""
    out = ref.logits(P, c, tokens, positions=positions, lora_scale=lora_scale)
    token_logps = -F.cross_entropy(out.reshape(-1, c.vocab_size), targets.reshape(-1),
                                   ignore_index=-1, reduction="none").reshape(tokens.shape)
    logps, counts = [], []
    for b in range(tokens.shape[0]):
        for r in range(int(responses[b].max()) + 1):
            mask = responses[b] == r
            logps.append(token_logps[b][mask].sum())
            counts.append(int(mask.sum()))
    return torch.stack(logps), torch.tensor(counts, dtype=torch.float64)


def dpo_loss(v, policy, reference, counts):
    """Mean pair loss and the rewards' means (chosen, rejected, margin, accuracy) of
    variant v, TRL's DPO / IPO: chosen at even, rejected at odd indices."""
    beta, eps = v["beta"], v["label_smoothing"]
    chosen = policy[0::2] - reference[0::2]
    rejected = policy[1::2] - reference[1::2]
    if v["loss"] == "sigmoid":
        x = beta * (chosen - rejected)
        losses = -(1 - eps) * F.logsigmoid(x) - eps * F.logsigmoid(-x)
    else:  # IPO: log-ratios averaged over each response's tokens
        n = counts.clamp(min=1)
        losses = (chosen / n[0::2] - rejected / n[1::2] - 1 / (2 * beta)) ** 2
    rc, rr = (beta * chosen).detach(), (beta * rejected).detach()
    return losses.mean(), (rc.mean(), rr.mean(), (rc - rr).mean(), (rc > rr).double().mean())


def dpo_case(name, c, out_dir, seed):
    """<case>.dpo.safetensors: one step of each DPO_VARIANTS with lora_case's adapters on the
    base weights (the reference: the base alone), and of full fine-tuning (DPO_FULL, every
    base weight trainable, the reference the same weights)."""
    P0 = init_weights(c, seed)
    spec = LORA[name]
    adapters = lora_adapters(c, spec, seed)
    scale = spec["alpha"] / spec["rank"]
    g = torch.Generator().manual_seed(seed + 3)
    tokens, targets, positions, responses, pad = preference_rows(c, SEQ[name], g)
    batch = (tokens, targets, positions, responses)
    with torch.no_grad():
        reference, counts = response_logps(P0, c, *batch, lora_scale=0.0)
    P = {k: v.clone() for k, v in P0.items()}
    P.update({k: v.clone().requires_grad_(True) for k, v in adapters.items()})
    policy, _ = response_logps(P, c, *batch, lora_scale=scale)
    pairs = len(counts) // 2
    margins = (policy - reference).detach()
    assert (margins[0::2] - margins[1::2]).abs().min() > 1e-3, "a pair's accuracy is a tie"
    tensors = {"tokens": tokens.to(torch.int32).numpy(), "targets": targets.to(torch.int32).numpy(),
               "positions": positions.to(torch.int32).numpy(),
               "responses": responses.to(torch.int32).numpy(),
               "policy_logps": policy.detach().numpy(), "reference_logps": reference.numpy()}
    for variant, v in DPO_VARIANTS.items():
        loss, rewards = dpo_loss(v, policy, reference, counts)
        grads = torch.autograd.grad(loss, [P[k] for k in adapters], retain_graph=True)
        tensors[variant + "/loss"] = np.array([loss.item()])
        for key, value in zip(("chosen", "rejected", "margin", "accuracy"), rewards):
            tensors[f"{variant}/reward_{key}"] = np.array([value.item()])
        for k, grad in zip(adapters, grads):
            tensors[f"{variant}/grad/{k}"] = f32(grad)
        print(f"{name} dpo {variant}: loss {loss.item():.6f} over {pairs} pairs in "
              f"{tokens.shape[0]} rows, accuracy {rewards[3].item():.2f}")
    # Full fine-tuning at its first step: the policy is the reference (z = 0 for every pair).
    P = leaf_copy(P0, torch.float64)
    policy, _ = response_logps(P, c, *batch, lora_scale=0.0)
    loss, _ = dpo_loss(DPO_FULL, policy, reference, counts)
    assert abs(loss.item() - np.log(2)) < 1e-12, "full fine-tuning's step 0 is not log 2"
    loss.backward()
    tensors["full/loss"] = np.array([loss.item()])
    for k, v in P.items():
        tensors["full/grad/" + k] = f32(v.grad)
    meta = {"variants": json.dumps(DPO_VARIANTS), "full": json.dumps(DPO_FULL), "pad": str(pad),
            "pairs": str(pairs)}
    stfile.write(os.path.join(out_dir, f"{name}.dpo.safetensors"), tensors, meta)


# QLoRA: the weights lora.quantize_base = nf4 stores as NF4 are those of every module LoRA
# can target (adapted or not).
LORA_MODULES = {"llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                          "down_proj"],
                "gpt2": ["c_attn", "c_proj", "c_fc"]}


def nf4_round_trip(x):
    """x (f32 values, any shape) -> (NF4 dequantised values as float64 of the f32 results,
    packed bytes): quantised flattened row-major, dequantised in f32, as meshtrain does."""
    levels, dyn = nf4.definition_tables()
    flat = x.to(torch.float32).reshape(-1).contiguous()
    packed = nf4.quantize(flat, levels, dyn)["bytes"]
    values = nf4.dequantize_f32(nf4.unpack(packed, flat.numel()), levels, dyn)
    return values.reshape(x.shape).to(torch.float64), packed


def qlora_case(name, c, out_dir, seed):
    """<case>.qlora.safetensors: lora_case's adapters on the case's base weights with every
    block linear replaced by its NF4 round trip; the mean loss and the adapters' gradients."""
    P0 = init_weights(c, seed)
    tokens, targets = reference_batch(out_dir, name)
    spec = LORA[name]
    adapters = lora_adapters(c, spec, seed)
    scale = spec["alpha"] / spec["rank"]
    modules = {k[:-len(".lora_A.weight")] + ".weight"
               for k in ref.lora_shapes(c, 1, LORA_MODULES[c.family])
               if k.endswith(".lora_A.weight")}
    P = {k: v.clone() for k, v in P0.items()}
    tensors = {k: f32(v) for k, v in adapters.items()}
    worst = 0.0
    for k in P0:  # registry order
        if k not in modules:
            continue
        assert P0[k].numel() % nf4.BLOCK == 0, \
            f"{name}: {k} has {P0[k].numel()} elements, not whole NF4 blocks of {nf4.BLOCK}"
        P[k], packed = nf4_round_trip(P0[k])
        tensors["nf4/" + k] = f32(P[k])
        tensors["nf4_packed/" + k] = np.frombuffer(packed, dtype="<i4").copy()
        worst = max(worst, ((P[k] - P0[k]).norm() / P0[k].norm()).item())
    assert len(modules) == sum(1 for k in tensors if k.startswith("nf4/")), "a module is missing"
    P.update({k: v.clone().requires_grad_(True) for k, v in adapters.items()})
    out = ref.logits(P, c, tokens, lora_scale=scale)
    loss = torch.nn.functional.cross_entropy(out.reshape(-1, c.vocab_size), targets.reshape(-1))
    loss.backward()
    tensors["loss"] = np.array([loss.item()])
    for k in adapters:
        tensors["grad/" + k] = f32(P[k].grad)
    meta = {"rank": str(spec["rank"]), "alpha": repr(spec["alpha"]),
            "targets": ",".join(spec["targets"]), "quantize_base": "nf4",
            "block": str(nf4.BLOCK), "scale_block": str(nf4.SCALE_BLOCK)}
    stfile.write(os.path.join(out_dir, f"{name}.qlora.safetensors"), tensors, meta)
    print(f"{name} qlora: loss {loss.item():.6f}, {len(modules)} NF4 weights "
          f"(round trip rel. error <= {worst:.3f})")


# Mixtures of experts on the llama_gqa shape: Mixtral's routing, Qwen2-MoE's (no
# renormalisation, a gated shared expert, a dense first layer), DeepSeek-V3's (sigmoid
# scores, group-limited top-k, scaling, an ungated shared expert), top_k = experts
# without renormalisation (the dense softmax mixture of the experts), and token dropping.
MOE_CASES = {
    "moe_mixtral": ref.Moe(experts=4, top_k=2, hidden_dim=24, aux_loss=0.1, z_loss=0.01),
    "moe_qwen2": ref.Moe(experts=6, top_k=2, hidden_dim=16, renormalize=False, shared_hidden=40,
                         shared_gate=True, first_dense=1, aux_loss=0.1),
    "moe_deepseek": ref.Moe(experts=8, top_k=2, hidden_dim=16, score="sigmoid", scaling=2.5,
                            n_groups=4, topk_groups=2, shared_hidden=32, z_loss=0.01),
    "moe_dense_mixture": ref.Moe(experts=3, top_k=3, hidden_dim=16, renormalize=False),
    # A capacity of 0.75 of the mean load: experts over it drop their lowest-weight choices.
    "moe_capacity": ref.Moe(experts=4, top_k=2, hidden_dim=16, aux_loss=0.1, capacity_factor=0.75),
}
# Today's attention options with their families' MoE layouts (model.qkv_bias, qk_norm, head_dim).
ATTENTION = {
    "attn_qwen2_moe": {"qkv_bias": True},
    "attn_qwen3_moe": {"qk_norm": "head", "head_width": 12},
    "attn_olmoe": {"qk_norm": "full"},
}
MOE_CASES.update({
    "attn_qwen2_moe": ref.Moe(experts=4, top_k=2, hidden_dim=16, renormalize=False, shared_hidden=24,
                              shared_gate=True, aux_loss=0.1),
    "attn_qwen3_moe": ref.Moe(experts=4, top_k=2, hidden_dim=16, first_dense=1, aux_loss=0.1),
    "attn_olmoe": ref.Moe(experts=4, top_k=2, hidden_dim=16, renormalize=False, aux_loss=0.1),
})


def moe_case(name, m, out_dir, seed):
    base = CASES["llama_gqa"]
    c = ref.Config(**{**base.__dict__, "moe": m, **ATTENTION.get(name, {})})
    P0 = init_weights(c, seed)
    g = torch.Generator().manual_seed(seed + 1)
    data = torch.randint(0, c.vocab_size, (BATCH, SEQ["llama_gqa"] + 1), generator=g)
    tokens, targets = data[:, :-1], data[:, 1:]
    meta = {"config": json.dumps(c.hf_config(), indent=2), "moe": json.dumps(m.__dict__)}
    if name in ATTENTION:
        meta["attention"] = json.dumps(c.attention())
    stfile.write(os.path.join(out_dir, f"{name}.weights.safetensors"),
                 {k: f32(v) for k, v in P0.items()}, meta)
    P = leaf_copy(P0, torch.float64)
    aux = []
    out = ref.logits(P, c, tokens, aux=aux)
    loss = torch.nn.functional.cross_entropy(out.reshape(-1, c.vocab_size), targets.reshape(-1))
    aux_total = sum(aux) if aux else torch.zeros((), dtype=torch.float64)
    (loss + aux_total).backward()
    print(f"{name}: loss {loss.item():.6f}, auxiliary {aux_total.item():.6f}")
    tensors = {"tokens": tokens.to(torch.int32).numpy(), "targets": targets.to(torch.int32).numpy(),
               "logits": f32(out.reshape(-1, c.vocab_size)), "loss": np.array([loss.item()]),
               "aux": np.array([aux_total.item()])}
    for k, v in P.items():
        tensors["grad/" + k] = f32(v.grad)
    stfile.write(os.path.join(out_dir, f"{name}.reference.safetensors"), tensors, {})


def load_llama2c(path):
    """llama2.c legacy v0 file -> (Config, params dict in registry names, float64)."""
    with open(path, "rb") as f:
        raw = f.read()
    dim, hidden, layers, heads, kv_heads, vocab, seq = struct.unpack("<7i", raw[:28])
    tied = vocab > 0
    vocab = abs(vocab)
    c = ref.Config("llama", dim, layers, heads, kv_heads, hidden, vocab, seq, tie_embeddings=tied)
    w = np.frombuffer(raw, dtype="<f4", offset=28).astype(np.float64)
    pos = 0

    def take(*shape):
        nonlocal pos
        n = int(np.prod(shape))
        out = torch.from_numpy(w[pos:pos + n].reshape(shape).copy())
        pos += n
        return out

    kv = kv_heads * dim // heads
    P = {"model.embed_tokens.weight": take(vocab, dim)}
    order = [("input_layernorm.weight", (dim,)), ("self_attn.q_proj.weight", (dim, dim)),
             ("self_attn.k_proj.weight", (kv, dim)), ("self_attn.v_proj.weight", (kv, dim)),
             ("self_attn.o_proj.weight", (dim, dim)), ("post_attention_layernorm.weight", (dim,)),
             ("mlp.gate_proj.weight", (hidden, dim)), ("mlp.down_proj.weight", (dim, hidden)),
             ("mlp.up_proj.weight", (hidden, dim))]
    for suffix, shape in order:
        for layer in range(layers):
            P[f"model.layers.{layer}.{suffix}"] = take(*shape)
    P["model.norm.weight"] = take(dim)
    hd = dim // heads
    freq_cos, freq_sin = take(seq, hd // 2), take(seq, hd // 2)
    cos, sin = ref.rope_angles(c, torch.arange(seq), torch.float64)
    assert torch.allclose(freq_cos, cos, atol=1e-4) and torch.allclose(freq_sin, sin, atol=1e-4), \
        "file's RoPE tables are not theta 10000 over interleaved pairs"
    if not tied:
        P["lm_head.weight"] = take(vocab, dim)
    assert pos == len(w), f"{path}: {len(w) - pos} floats left over"
    return c, P


def runc_greedy(path, steps):
    """A second, independent implementation: llama2.c's run.c forward, one token at a time
    with a KV cache and the file's own RoPE tables (numpy, float64)."""
    raw = open(path, "rb").read()
    dim, hid, L, H, KV, V, S = struct.unpack("<7i", raw[:28])
    w = np.frombuffer(raw, dtype="<f4", offset=28).astype(np.float64)
    hs, V = dim // H, abs(V)
    kvd, pos_ = KV * hs, [0]

    def take(*shape):
        n = int(np.prod(shape))
        out = w[pos_[0]:pos_[0] + n].reshape(shape)
        pos_[0] += n
        return out

    emb, ra = take(V, dim), take(L, dim)
    wq, wk, wv, wo = take(L, dim, dim), take(L, kvd, dim), take(L, kvd, dim), take(L, dim, dim)
    rf, w1, w2, w3 = take(L, dim), take(L, hid, dim), take(L, dim, hid), take(L, hid, dim)
    rfin, fcr, fci = take(dim), take(S, hs // 2), take(S, hs // 2)
    wcls = emb if struct.unpack("<i", raw[20:24])[0] > 0 else take(V, dim)

    def rms(x, g):
        return g * (x / np.sqrt((x * x).mean() + 1e-5))

    def rotate(x, pos):
        x = x.reshape(-1, hs // 2, 2)
        c, s = fcr[pos][None, :], fci[pos][None, :]
        return np.stack((x[..., 0] * c - x[..., 1] * s, x[..., 0] * s + x[..., 1] * c), -1).ravel()

    kc, vc = np.zeros((L, S, kvd)), np.zeros((L, S, kvd))
    token, out = 1, []
    for pos in range(steps):
        x = emb[token].copy()
        for l in range(L):
            xb = rms(x, ra[l])
            q, k, v = rotate(wq[l] @ xb, pos), rotate(wk[l] @ xb, pos), wv[l] @ xb
            kc[l, pos], vc[l, pos] = k, v
            att = np.zeros(dim)
            for h in range(H):
                kh = h // (H // KV)
                keys, vals = kc[l, :pos + 1, kh * hs:(kh + 1) * hs], vc[l, :pos + 1, kh * hs:(kh + 1) * hs]
                score = keys @ q[h * hs:(h + 1) * hs] / np.sqrt(hs)
                a = np.exp(score - score.max())
                att[h * hs:(h + 1) * hs] = (a / a.sum()) @ vals
            x = x + wo[l] @ att
            xb = rms(x, rf[l])
            hb = w1[l] @ xb
            x = x + w2[l] @ (hb / (1 + np.exp(-hb)) * (w3[l] @ xb))
        token = int((wcls @ rms(x, rfin)).argmax())
        out.append(token)
    return out


def stories_case(path, out_dir):
    c, P = load_llama2c(path)
    ids = torch.tensor([STORIES_IDS])
    logits = ref.logits(P, c, ids)[0]
    seq, margins = [1], []
    for _ in range(STORIES_GREEDY):
        last = ref.logits(P, c, torch.tensor([seq]))[0, -1]
        top = torch.topk(last, 2).values
        margins.append((top[0] - top[1]).item())
        seq.append(int(last.argmax()))
    assert seq[1:] == runc_greedy(path, STORIES_GREEDY), "reference and run.c port disagree"
    print(f"stories260K: greedy {seq[1:]}, smallest top-2 margin {min(margins):.2e}")
    stfile.write(os.path.join(out_dir, "stories260k.reference.safetensors"),
                 {"tokens": np.array(STORIES_IDS, dtype=np.int32), "logits": f32(logits),
                  "greedy": np.array(seq[1:], dtype=np.int32), "greedy_margin": np.array(margins)})


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(here, "fixtures"))
    parser.add_argument("--stories", default=os.path.join(os.path.dirname(here), "models", "stories260K.bin"))
    parser.add_argument("--only", help="write the MoE case of this name only")
    args = parser.parse_args()
    torch.set_num_threads(1)  # fixed reduction order: bit-identical fixtures run to run
    os.makedirs(args.out, exist_ok=True)
    if args.only:
        seed = list(MOE_CASES).index(args.only)
        moe_case(args.only, MOE_CASES[args.only], args.out, 2000 + 10 * seed)
        return
    for seed, (name, c) in enumerate(CASES.items()):
        model_case(name, c, args.out, 1000 + 10 * seed)
        lora_case(name, c, args.out, 1000 + 10 * seed)
        qlora_case(name, c, args.out, 1000 + 10 * seed)
        dpo_case(name, c, args.out, 1000 + 10 * seed)
    for seed, (name, m) in enumerate(MOE_CASES.items()):
        moe_case(name, m, args.out, 2000 + 10 * seed)
    stories_case(args.stories, args.out)


if __name__ == "__main__":
    main()
