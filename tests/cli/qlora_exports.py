"""A QLoRA checkpoint's exports (tests/cli/qlora.sh).

qlora_exports.py MERGED BASE_ONLY PEFT
    The --merge-lora export equals the --base-only export (the dequantised NF4 base) plus each
    adapter's delta, alpha / r · B A, from the PEFT export: what PEFT's merge on a 4-bit base
    does (dequantise, add the delta). f32 files; the sum is checked to 2 ulp.
qlora_exports.py --bitsandbytes HF_BASE BASE_ONLY PEFT   (a python with bitsandbytes)
    Each quantised weight of the base-only export is bitsandbytes' quantize_4bit(nf4, blocksize
    64, compress_statistics) of the HF base's weight, dequantised by its formula (bitsandbytes'
    own CPU dequantize_4bit kernel is wrong for rows that are not whole blocks, e.g. [64, 176]).
    bitsandbytes departs from the definition in two documented ways (tests/tensor: torch's f32
    mean for the offset, a lookup table for the 8-bit scale codes), which move a few block
    scales by one 8-bit step (and an offset one ulp off moves every block's scale by an ulp):
    at least 99% of the values must lie within 1e-6 of their tensor's absmax of bitsandbytes'
    and none farther than 1%.
"""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "reference"))
import stfile  # noqa: E402

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def read(directory):
    return stfile.read(os.path.join(directory, "model.safetensors"))[0]


def check_merge(merged_dir, base_dir, peft_dir):
    merged, base = read(merged_dir), read(base_dir)
    adapter = stfile.read(os.path.join(peft_dir, "adapter_model.safetensors"))[0]
    config = json.load(open(os.path.join(peft_dir, "adapter_config.json")))
    scale = config["lora_alpha"] / config["r"]
    adapted = 0
    for name, w in merged.items():
        want = base[name].astype(np.float64)
        key = "base_model.model." + name[: -len(".weight")]
        if key + ".lora_A.weight" in adapter:
            a = adapter[key + ".lora_A.weight"].astype(np.float64)
            b = adapter[key + ".lora_B.weight"].astype(np.float64)
            want = want + scale * (b @ a)
            adapted += 1
        err = np.abs(w.astype(np.float64) - want)
        bound = 2 * np.spacing(np.abs(want).astype(np.float32)).astype(np.float64) + 1e-12
        assert (err <= bound).all(), f"{name}: merged differs from base + delta by {err.max():.3e}"
    assert adapted > 0, "no adapter found in the PEFT export"
    print(f"exports: merged = base-only + PEFT delta (alpha/r = {scale}) in all {len(merged)} "
          f"tensors, {adapted} adapted")


def check_bitsandbytes(hf_dir, base_dir):
    import torch
    import bitsandbytes.functional as F
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute
    hf, ours = read(hf_dir), read(base_dir)
    total = equal = 0
    worst = 0.0
    for name, w in hf.items():
        if not name.endswith(".weight") or name.split(".")[-2] not in LINEARS:
            continue
        x = torch.from_numpy(w.astype(np.float32))
        packed, state = F.quantize_4bit(x, blocksize=64, compress_statistics=True, quant_type="nf4")
        absmax = F.dequantize_blockwise(state.absmax, state.state2) + state.offset
        deq = _dequantize_4bit_compute(packed.reshape(-1), absmax, state.code, 64, x.shape,
                                       torch.float32).numpy()
        mine = ours[name].astype(np.float32)
        total += mine.size
        diff = np.abs(mine - deq) / np.abs(w).max()
        equal += int((diff <= 1e-6).sum())
        rel = float(diff.max())
        worst = max(worst, rel)
        assert rel <= 0.01, f"{name}: differs from bitsandbytes by {rel:.2%} of its absmax"
    share = equal / total
    assert share >= 0.99, f"only {share:.2%} of the values within 1e-6 of bitsandbytes'"
    print(f"bitsandbytes: {share:.4%} of {total} base values within 1e-6 of its tensor's absmax "
          f"of bitsandbytes', all within {worst:.2%} (its f32 mean / lookup-table departures)")


if __name__ == "__main__":
    if sys.argv[1] == "--bitsandbytes":
        check_bitsandbytes(sys.argv[2], sys.argv[3])
    else:
        check_merge(*sys.argv[1:4])
