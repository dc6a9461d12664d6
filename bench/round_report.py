"""What the fine-tuning benches' reports share (bench/dpo.sh, bench/finetune.sh): a bench's work
directory holds cases.list (a case per line), loads (side, case, load average; tab-separated)
and per case the peers' JSON lines."""
import json
import os
import statistics

CATEGORIES = ["params", "grads", "optimizer", "activations", "workspace"]


def mib(b):
    return b / 2**20


def med(xs):
    return statistics.median(xs) if xs else None


def peer_json(path):
    """A peer run's last JSON line, or None when it wrote nothing."""
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return None
    return json.loads(open(path).read().splitlines()[-1])


def cases_and_loads(work):
    """The bench's cases, and each case's "side load-average" notes."""
    cases = open(f"{work}/cases.list").read().splitlines()
    loads = {}
    for line in open(f"{work}/loads"):
        side, c, avg = line.rstrip("\n").split("\t")
        loads.setdefault(c, []).append(f"{side} {avg}")
    return cases, loads
