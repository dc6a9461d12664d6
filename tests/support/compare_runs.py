"""Two meshtrain runs are the same run: every rank's metrics file has the same steps with the
same loss, grad_norm and val_loss (exactly), and the final checkpoint's shards are the same bytes.
A resumed run repeats the steps after its checkpoint; the later record of a step counts.
usage: compare_runs.py RANKS STEP OUT_DIR_A OUT_DIR_B [OUT_DIR ...]"""
import filecmp, glob, json, os, sys

ranks, step, ref, others = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4:]

def trace(run):
    out = {}
    for path in sorted(glob.glob(f"{run}/metrics*.jsonl")):
        rows = {}
        for line in open(path):
            r = json.loads(line)
            for key in ("loss", "val_loss"):
                if key in r:
                    rows[(r["step"], key)] = (r[key], r.get("grad_norm"))
        out[os.path.basename(path)] = rows
    return out

want = trace(ref)
assert len(want) == ranks, f"{ref}: {len(want)} metrics files, expected {ranks}"
for name, rows in want.items():
    assert sum(k[1] == "loss" for k in rows) == step, f"{ref}/{name}: {sorted(rows)}"
shards = sorted(os.path.basename(p) for p in glob.glob(f"{ref}/step_{step}/rank_*.safetensors"))
assert len(shards) == ranks, f"{ref}/step_{step}: {shards}"
for run in others:
    got = trace(run)
    assert got.keys() == want.keys(), f"{run}: metrics files {sorted(got)} != {sorted(want)}"
    for name in want:
        assert got[name].keys() == want[name].keys(), \
            f"{run}/{name}: records {sorted(set(got[name]) ^ set(want[name]))} in one run only"
        for key in sorted(want[name]):
            assert got[name][key] == want[name][key], \
                f"{run}/{name}: step {key[0]} {key[1]}: {got[name][key]} != {want[name][key]} (value, grad_norm)"
    for shard in shards:
        assert filecmp.cmp(f"{ref}/step_{step}/{shard}", f"{run}/step_{step}/{shard}", shallow=False), \
            f"{run}/step_{step}/{shard} differs from {ref}'s"
    print(f"{run}: same losses, gradient norms and validation losses on {ranks} ranks, same {len(shards)} shards")
