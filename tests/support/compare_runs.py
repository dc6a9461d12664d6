"""Two meshtrain runs are the same run: every rank's metrics file has the same steps with the
same loss, grad_norm and val_loss (exactly), and the final checkpoint's shards are the same bytes.
usage: compare_runs.py RANKS STEP OUT_DIR_A OUT_DIR_B [OUT_DIR ...]"""
import filecmp, glob, json, os, sys

ranks, step, ref, others = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4:]

def trace(run):
    out = {}
    for path in sorted(glob.glob(f"{run}/metrics*.jsonl")):
        rows = [json.loads(line) for line in open(path)]
        out[os.path.basename(path)] = [(r["step"], r.get("loss"), r.get("grad_norm"), r.get("val_loss"))
                                       for r in rows if "loss" in r or "val_loss" in r]
    return out

want = trace(ref)
assert len(want) == ranks, f"{ref}: {len(want)} metrics files, expected {ranks}"
for name, rows in want.items():
    assert sum(r[1] is not None for r in rows) == step, f"{ref}/{name}: {rows}"
shards = sorted(os.path.basename(p) for p in glob.glob(f"{ref}/step_{step}/rank_*.safetensors"))
assert len(shards) == ranks, f"{ref}/step_{step}: {shards}"
for run in others:
    got = trace(run)
    assert got.keys() == want.keys(), f"{run}: metrics files {sorted(got)} != {sorted(want)}"
    for name in want:
        for a, b in zip(want[name], got[name]):
            assert a == b, f"{run}/{name}: step {a[0]}: {b[1:]} != {a[1:]} (loss, grad_norm, val_loss)"
        assert len(want[name]) == len(got[name]), f"{run}/{name}: {len(got[name])} rows != {len(want[name])}"
    for shard in shards:
        assert filecmp.cmp(f"{ref}/step_{step}/{shard}", f"{run}/step_{step}/{shard}", shallow=False), \
            f"{run}/step_{step}/{shard} differs from {ref}'s"
    print(f"{run}: same losses, gradient norms and validation losses on {ranks} ranks, same {len(shards)} shards")
