"""Checks that meshtrain's Hugging Face export computes the same function in
Hugging Face's convention: runs hf_export_tool on each fixture's weights, then
evaluates the exported model.safetensors + config.json with a rotate_half Llama
(HF's RoPE) / Conv1D GPT-2 in float64 and compares with meshtrain's logits.
For Llama it also checks that the unpermuted (interleaved) reading of the same
file does NOT match, so the check cannot pass vacuously.

    /usr/bin/python3 tests/reference/check_hf_export.py --tool build/tests/hf_export_tool \
        --work /tmp/hf_check tests/reference/fixtures/llama_gqa.weights.safetensors ...
"""
import argparse
import os
import subprocess
import sys

import numpy as np
import torch

import reference_model as ref
import stfile

TOL = 1e-5  # ||meshtrain - reference|| / ||reference|| (meshtrain runs in fp32)


def rel_error(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tool", required=True)
    parser.add_argument("--work", required=True)
    parser.add_argument("weights", nargs="+")
    args = parser.parse_args()
    torch.set_num_threads(1)
    failed = False
    for weights in args.weights:
        name = os.path.basename(weights).split(".")[0]
        out = os.path.join(args.work, name)
        os.makedirs(out, exist_ok=True)
        subprocess.run([args.tool, weights, out], check=True)
        with open(os.path.join(out, "hf", "config.json")) as f:
            c = ref.Config.from_hf_config(f.read())
        params, _ = stfile.read(os.path.join(out, "hf", "model.safetensors"))
        P = {k: torch.from_numpy(v.astype(np.float64)) for k, v in params.items()}
        mine, _ = stfile.read(os.path.join(out, "meshtrain_logits.safetensors"))
        tokens = torch.from_numpy(mine["tokens"].astype(np.int64))
        expected = mine["logits"].astype(np.float64)
        hf = ref.logits(P, c, tokens, rope="half").reshape(-1, c.vocab_size).numpy()
        err = rel_error(expected, hf)
        ok = err <= TOL
        line = f"{name}: exported checkpoint in HF convention vs meshtrain logits: rel err {err:.2e}"
        if c.family == "llama":
            wrong = ref.logits(P, c, tokens, rope="interleaved").reshape(-1, c.vocab_size).numpy()
            wrong_err = rel_error(expected, wrong)
            ok = ok and wrong_err > 1e-3
            line += f" (same file read with interleaved RoPE: {wrong_err:.2e}, must be large)"
        print(("ok   " if ok else "FAIL ") + line)
        failed |= not ok
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
