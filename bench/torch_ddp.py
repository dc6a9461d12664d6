#!/usr/bin/env python3
"""PyTorch DDP peer for bench/ddp_vs_torch.sh: torch_train.py's Llama under
torch.nn.parallel.DistributedDataParallel (gloo, bucket_cap_mb as meshtrain's
bucket_mb), one process per rank. Debian's torchrun (and python -m
torch.distributed.run) of PyTorch 1.13 fails on Python 3.11 (its Std flag
parsing returns None), so --nproc N starts the ranks itself with
torch.multiprocessing; under a working torchrun, leave --nproc out. Weak scaling: every
rank trains --batch sequences per step. Steps alternate between a normal DDP
step and one under no_sync() (the same compute, no gradient communication),
so the share of the step that communication adds is measured in the same run.
Run with Debian's /usr/bin/python3 (PyTorch 1.13).

usage: bench/torch_ddp.py --nproc N [--threads 1] [--steps 4] [torch_train.py model args]
   or: torchrun --nproc_per_node N bench/torch_ddp.py [...]
prints one JSON line from rank 0: {"side": "pytorch", "ranks": N, "step_ms": median, "nosync_ms": median,
"best_ms": min, "best_nosync_ms": min, ...} (a step's time is its slowest rank's)
"""
import argparse
import contextlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_train import Llama  # noqa: E402  (the same model as the single-rank benchmark)


def median(xs):
    s = sorted(xs)
    return s[len(s) // 2]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--nproc", type=int, default=0, help="start this many ranks (without torchrun)")
    p.add_argument("--port", type=int, default=29517)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--bucket-mb", type=float, default=25)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--tied", type=int, default=1)
    a = p.parse_args()
    if a.nproc > 0:
        torch.multiprocessing.spawn(rank_main, args=(a,), nprocs=a.nproc, join=True)
    else:
        rank_main(None, a)


def rank_main(spawned_rank, a):
    if spawned_rank is not None:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port), RANK=str(spawned_rank),
                          WORLD_SIZE=str(a.nproc), LOCAL_RANK=str(spawned_rank))
    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = Llama(a)
    for _, param in model.named_parameters():
        if param.dim() == 2:
            nn.init.normal_(param, std=0.02)
    # gloo cannot broadcast the bool causal-mask buffer (it is the same on every rank anyway).
    nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ["mask"])
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=a.bucket_mb) if world > 1 else model
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    g = torch.Generator().manual_seed(rank)
    data = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=g)
    x, y = data[:, :-1], data[:, 1:]

    def step(sync):
        dist.barrier()  # start together; not timed
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        ctx = ddp.no_sync() if (world > 1 and not sync) else contextlib.nullcontext()
        with ctx:
            loss = ddp(x, y)
            loss.backward()
        opt.step()
        return (time.perf_counter() - t0) * 1000, float(loss)

    step(True)  # warm-up
    synced, unsynced = [], []
    for _ in range(a.steps):
        synced.append(step(True)[0])
        unsynced.append(step(False)[0])
    # Each step takes as long as its slowest rank; medians and minima over steps.
    t = torch.tensor(synced + unsynced, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    synced, unsynced = t[: a.steps].tolist(), t[a.steps:].tolist()
    if rank == 0:
        step_ms, nosync_ms = median(synced), median(unsynced)
        print(json.dumps({"side": "pytorch", "ranks": world, "threads": torch.get_num_threads(),
                          "batch_per_rank": a.batch, "step_ms": round(step_ms, 1),
                          "nosync_ms": round(nosync_ms, 1), "best_ms": round(min(synced), 1),
                          "best_nosync_ms": round(min(unsynced), 1),
                          "tokens_per_s": round(world * a.batch * a.seq / step_ms * 1000, 1),
                          "exposed_share": round(max(0.0, step_ms - nosync_ms) / step_ms, 4)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
