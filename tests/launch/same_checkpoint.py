"""Two sharded checkpoints (same layout) hold the same tensors bit for bit:
every rank_*.safetensors tensor's bytes, by name. usage: same_checkpoint.py A B"""
import glob, json, os, struct, sys

def tensors(step_dir):
    out = {}
    for path in sorted(glob.glob(os.path.join(step_dir, "rank_*.safetensors"))):
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
            data = f.read()
        for name, info in header.items():
            if name == "__metadata__":
                continue
            a, b = info["data_offsets"]
            out[os.path.basename(path) + ":" + name] = data[a:b]
    return out

a, b = (tensors(d) for d in sys.argv[1:3])
assert a, f"no tensors in {sys.argv[1]}"
assert a.keys() == b.keys(), f"different tensors: {sorted(a.keys() ^ b.keys())[:5]}"
diff = [k for k in a if a[k] != b[k]]
assert not diff, f"{len(diff)} of {len(a)} tensors differ, e.g. {diff[:3]}"
print(f"{len(a)} tensors bit-identical ({sum(map(len, a.values()))} bytes)")
