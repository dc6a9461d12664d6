#!/usr/bin/env bash
# meshtrain's LoRA exports against PyPI transformers + peft (needs build/hf-venv:
# scripts/setup_hf_venv.sh; exits 77, a ctest skip, without it). Per family
# (llama GQA with q/k/v/o targets, gpt2 with c_attn/c_proj/c_fc):
#  1. a tiny LoRA run (a few steps, so lora_B is not zero), then
#     ckpt export --format hf --base-only, --format peft, --format hf --merge-lora,
#     and meshtrain eval --logits-ids: the LoRA model's own logits;
#  2. PeftModel.from_pretrained(base export, PEFT export) gives those logits (1e-5);
#     merge_and_unload() equals the --merge-lora export (1e-6), which gives them too.
# usage: peft_venv_check.sh VENV_PYTHON MESHTRAIN WORK
set -euo pipefail
py=$1 bin=$(realpath "$2") work=$3
here=$(cd "$(dirname "$0")" && pwd)
if [ ! -x "$py" ] || ! "$py" -c "import torch, transformers, safetensors, peft" 2>/dev/null; then
  echo "SKIP: no venv with torch + transformers + peft at $py (scripts/setup_hf_venv.sh)"
  exit 77
fi
rm -rf "$work" && mkdir -p "$work"
python3 "$here/../support/random_tokens.py" "$work/train.bin" 20000 64 3
ids=$(python3 -c "print(','.join(str((7 * t + 3) % 64) for t in range(24)))")
for family in llama gpt2; do
  if [ "$family" = llama ]; then
    model='family = "llama"
dim = 32
n_layers = 2
n_heads = 4
n_kv_heads = 2
hidden_dim = 48
tie_embeddings = false'
    targets='["q_proj", "k_proj", "v_proj", "o_proj"]'
  else
    model='family = "gpt2"
dim = 32
n_layers = 2
n_heads = 4
hidden_dim = 128'
    targets='["c_attn", "c_proj", "c_fc"]'
  fi
  d=$work/$family
  mkdir -p "$d"
  cat >"$d/run.toml" <<TOML
[model]
$model
vocab_size = 64
max_seq_len = 32
init_std = 0.2
[train]
steps = 4
batch_size = 4
seq_len = 32
eval_interval = 0
checkpoint_interval = 4
out_dir = "$d/run"
[optim]
lr = 0.05
warmup_steps = 0
[data]
train = "$work/train.bin"
tokenizer = "bytes"
[lora]
rank = 4
alpha = 8
targets = $targets
TOML
  "$bin" train --config "$d/run.toml" >/dev/null
  ck=$d/run/step_4
  "$bin" ckpt export --format hf --base-only --checkpoint "$ck" --out "$d/base" >/dev/null
  "$bin" ckpt export --format peft --checkpoint "$ck" --out "$d/adapter" --base-model "$d/base" >/dev/null
  "$bin" ckpt export --format hf --merge-lora --checkpoint "$ck" --out "$d/merged" >/dev/null
  "$bin" eval --checkpoint "$ck" --data "$work/train.bin" --batches 1 --batch-size 1 --seq-len 16 \
    --logits-ids "$ids" --logits-out "$d/logits.safetensors" >/dev/null
  "$py" - "$d" "$ids" <<'PY'
import sys, torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
d, ids = sys.argv[1], torch.tensor([[int(x) for x in sys.argv[2].split(",")]])
ours = load_file(f"{d}/logits.safetensors")["logits"].double()
def worst(a, b):
    a, b = a.double(), b.double()
    return ((a - b).abs() / b.abs().clamp(min=1.0)).max().item()
base = AutoModelForCausalLM.from_pretrained(f"{d}/base", attn_implementation="eager").eval()
with torch.no_grad():
    base_logits = base(ids).logits[0]
model = PeftModel.from_pretrained(base, f"{d}/adapter").eval()
with torch.no_grad():
    peft_logits = model(ids).logits[0]
    merged = model.merge_and_unload()
ours_merged = load_file(f"{d}/merged/model.safetensors")
theirs = merged.state_dict()
w = max(worst(t, theirs[name]) for name, t in ours_merged.items())
plain = AutoModelForCausalLM.from_pretrained(f"{d}/merged", attn_implementation="eager").eval()
with torch.no_grad():
    plain_logits = plain(ids).logits[0]
print(f"{d}: PeftModel vs meshtrain logits {worst(peft_logits, ours):.2e}; merge_and_unload vs "
      f"--merge-lora weights {w:.2e}; merged export's logits {worst(plain_logits, ours):.2e}; "
      f"base alone {worst(base_logits, ours):.2e}")
assert worst(base_logits, ours) > 1e-3, "the adapters do not change the model: nothing tested"
assert worst(peft_logits, ours) <= 1e-5, "PeftModel logits differ"
assert w <= 1e-6, "merge_and_unload differs from --merge-lora"
assert worst(plain_logits, ours) <= 1e-5, "merged export's logits differ"
PY
done
echo PASS
