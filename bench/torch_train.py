#!/usr/bin/env python3
"""PyTorch peer for the training benchmark: the same Llama (RMSNorm, RoPE,
SwiGLU, GQA, tied or untied output) trained with AdamW, fp32 or bf16 autocast.
Runs under Debian's /usr/bin/python3 (PyTorch 1.13, eager) or a PyTorch 2.x venv
(scripts/setup_hf_venv.sh), where it uses what 2.x adds for speed: fused
scaled-dot-product attention, the fused CPU AdamW, and with --compile the whole
training step's forward and backward through torch.compile (inductor).

usage: torch_train.py --precision fp32|bf16 --threads 2 [--compile] [--steps 6] [--dim 512 ...]
prints one JSON line: {"side": "pytorch 2.x compile", "precision": ..., "step_ms": [...], ...}
"""
import argparse
import json
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_tables(head_dim, seq, theta):
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(seq).float(), freqs)
    return torch.cos(angles), torch.sin(angles)


def apply_rope(x, cos, sin):  # x [B, T, H, D], interleaved pairs
    xr = x.float().reshape(*x.shape[:-1], -1, 2)
    a, b = xr[..., 0], xr[..., 1]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    out = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    return out.type_as(x)


class Block(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.h, self.kv, self.hd = a.heads, a.kv_heads, a.dim // a.heads
        self.attn_norm = RMSNorm(a.dim, 1e-5)
        self.wqkv = nn.Linear(a.dim, (a.heads + 2 * a.kv_heads) * self.hd, bias=False)
        self.wo = nn.Linear(a.heads * self.hd, a.dim, bias=False)
        self.ffn_norm = RMSNorm(a.dim, 1e-5)
        self.w13 = nn.Linear(a.dim, 2 * a.hidden, bias=False)
        self.w2 = nn.Linear(a.hidden, a.dim, bias=False)

    def forward(self, x, cos, sin, mask):
        B, T, _ = x.shape
        qkv = self.wqkv(self.attn_norm(x))
        q, k, v = qkv.split([self.h * self.hd, self.kv * self.hd, self.kv * self.hd], dim=-1)
        q = apply_rope(q.view(B, T, self.h, self.hd), cos, sin).transpose(1, 2)
        k = apply_rope(k.view(B, T, self.kv, self.hd), cos, sin).transpose(1, 2)
        v = v.view(B, T, self.kv, self.hd).transpose(1, 2)
        rep = self.h // self.kv
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        if hasattr(F, "scaled_dot_product_attention"):  # 2.x: flash attention on the CPU
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) / math.sqrt(self.hd)
            y = att.masked_fill(mask, float("-inf")).softmax(-1) @ v
        y = y.transpose(1, 2).reshape(B, T, -1)
        x = x + self.wo(y)
        gate, up = self.w13(self.ffn_norm(x)).chunk(2, dim=-1)
        return x + self.w2(F.silu(gate) * up)


class Llama(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.embed = nn.Embedding(a.vocab, a.dim)
        self.blocks = nn.ModuleList(Block(a) for _ in range(a.layers))
        self.norm = RMSNorm(a.dim, 1e-5)
        self.head = nn.Linear(a.dim, a.vocab, bias=False)
        if a.tied:
            self.head.weight = self.embed.weight
        cos, sin = rope_tables(a.dim // a.heads, a.seq, 10000.0)
        self.register_buffer("cos", cos)
        self.register_buffer("sin", sin)
        self.register_buffer("mask", torch.triu(torch.ones(a.seq, a.seq, dtype=torch.bool), 1))

    def forward(self, idx, targets):
        x = self.embed(idx)
        for blk in self.blocks:
            x = blk(x, self.cos, self.sin, self.mask)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def matmul_peak(precision, seconds=1.0, n=2048):
    """This PyTorch's own GEMM peak (GFLOP/s): square n x n matmuls in the step's
    dtype, the best of rounds of seconds/4 (the peer's MFU denominator)."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    a @ b
    best = 0.0
    for _ in range(4):
        calls, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds / 4:
            a @ b
            calls += 1
        best = max(best, 2.0 * n ** 3 * calls / (time.perf_counter() - t0) / 1e9)
    return best


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--compile", action="store_true", help="torch.compile the model (2.x)")
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tied", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    peak = matmul_peak(a.precision)
    model = Llama(a)
    for name, param in model.named_parameters():
        if param.dim() == 2:  # GPT-2 style init, as meshtrain's
            nn.init.normal_(param, std=0.02)
    version = tuple(int(x) for x in torch.__version__.split(".")[:2])
    # The fused CPU AdamW arrived in 2.4; 1.13 has the per-tensor loop only.
    fused = {"fused": True} if version >= (2, 4) else {}
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, **fused)
    step_model = torch.compile(model) if a.compile else model
    side = f"pytorch {torch.__version__.split('+')[0]} {'compile' if a.compile else 'eager'}"
    data = torch.randint(0, a.vocab, (a.batch, a.seq + 1))
    x, y = data[:, :-1], data[:, 1:]
    times = []
    warmup = 3 if a.compile else 1  # compile's first steps trace and build kernels
    for _ in range(a.steps + warmup):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.precision == "bf16"):
            loss = step_model(x, y)
        loss.backward()
        opt.step()
        times.append((time.perf_counter() - t0) * 1000)
    timed = sorted(times[warmup:])
    median = timed[len(timed) // 2]
    print(json.dumps({"side": side, "precision": a.precision, "threads": torch.get_num_threads(),
                      "peak_gflops": round(peak, 1),
                      "warmup_ms": [round(t, 1) for t in times[:warmup]],
                      "step_ms": [round(t, 1) for t in times[warmup:]], "median_ms": round(median, 1),
                      "tokens_per_s": round(a.batch * a.seq / median * 1000, 1), "loss": loss.item()}))


if __name__ == "__main__":
    main()
