#!/usr/bin/env python3
"""PyTorch 2.x peer for the MoE benchmark (bench/moe_vs_dense.sh): transformers'
Qwen3-MoE modules at meshtrain's shape (every layer routed, top-k of E with
renormalised softmax weights, SwiGLU experts), trained with the fused CPU AdamW,
fp32 or bf16 autocast. --experts-impl picks transformers' experts kernel:
grouped_mm (torch._grouped_mm over the sorted tokens) or eager (a loop over the
experts that received tokens); --compile runs the step's forward and backward
through torch.compile. Qwen3's attention adds RMSNorm on q and k (a few MFLOPs
a step, 0.1% of it): the one difference from meshtrain's block.

usage: torch_moe.py --precision fp32 --threads 2 [--compile] [--experts-impl grouped_mm]
prints one JSON line like bench/torch_train.py.
"""
import argparse
import json
import time

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from torch_train import matmul_peak


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--experts-impl", default="grouped_mm", choices=["grouped_mm", "eager"])
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--moe-hidden", type=int, default=512)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    peak = matmul_peak(a.precision)
    config = Qwen3MoeConfig(
        vocab_size=a.vocab, hidden_size=a.dim, intermediate_size=a.moe_hidden,
        moe_intermediate_size=a.moe_hidden, num_hidden_layers=a.layers,
        num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, head_dim=a.dim // a.heads,
        num_experts=a.experts, num_experts_per_tok=a.top_k, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=a.seq,
        tie_word_embeddings=True, output_router_logits=False, attn_implementation="sdpa",
        experts_implementation=a.experts_impl)
    model = Qwen3MoeForCausalLM(config)
    params = sum(t.numel() for t in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=True)
    step_model = torch.compile(model) if a.compile else model
    side = (f"torch {torch.__version__.split('+')[0]} qwen3-moe {a.experts_impl} "
            f"{'compile' if a.compile else 'eager'}")
    ids = torch.randint(0, a.vocab, (a.batch, a.seq))
    times, cpu_times = [], []
    warmup = 3 if a.compile else 1
    for _ in range(a.steps + warmup):
        t0, c0 = time.perf_counter(), time.process_time()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.precision == "bf16"):
            loss = step_model(input_ids=ids, labels=ids).loss  # shifted inside: seq - 1 targets
        loss.backward()
        opt.step()
        times.append((time.perf_counter() - t0) * 1000)
        cpu_times.append((time.process_time() - c0) * 1000)
    timed = sorted(times[warmup:])
    median = timed[len(timed) // 2]
    print(json.dumps({"side": side, "precision": a.precision, "threads": torch.get_num_threads(),
                      "peak_gflops": round(peak, 1), "params": params,
                      "warmup_ms": [round(t, 1) for t in times[:warmup]],
                      "step_ms": [round(t, 1) for t in times[warmup:]], "median_ms": round(median, 1),
                      "step_cpu_ms": [round(t, 1) for t in cpu_times[warmup:]],
                      "tokens_per_s": round(a.batch * a.seq / median * 1000, 1), "loss": loss.item()}))


if __name__ == "__main__":
    main()
