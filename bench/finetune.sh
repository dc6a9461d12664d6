#!/usr/bin/env bash
# Full fine-tuning vs LoRA (rank 8 on q_proj and v_proj, bf16) on llama-60M and on an
# imported Hugging Face model (a ~100M Llama with GQA that transformers writes, through
# `ckpt import --format hf` and train.init_from): per category the MemoryTracker's peak
# (the run's end record) next to the engine's prediction (train/memory_plan, what
# `meshtrain plan --config` prints), the GPU planner's fine-tuning memory
# (`meshtrain plan --config RUN --gpus 1 --finetune full|lora`, plan/finetune.cpp), and tokens/s.
# One rank, train.threads 2, batch 4 x seq 256, a few steps: minutes in all.
# usage: bench/finetune.sh [steps=3]   (needs build/hf-venv for the imported model,
#        scripts/setup_hf_venv.sh; without it that half is skipped)
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/common.sh
STEPS=${1:-3}
VENV_PY=${MESHTRAIN_HF_VENV:-build/hf-venv}/bin/python

# run_case NAME MODEL VOCAB LORA(0|1): trains, then plans the same config. MODEL is a
# preset name, or a directory for train.init_from.
run_case() {
  local name=$1 model=$2 vocab=$3 lora=$4 d=$work/$1
  mkdir -p "$d"
  {
    if [ -d "$model" ]; then
      printf '[train]\ninit_from = "%s"\n' "$model"
    else
      printf '[model]\npreset = "%s"\n[train]\n' "$model"
    fi
    cat <<TOML
precision = "bf16"
steps = $STEPS
batch_size = 4
micro_batch_size = 4
seq_len = 256
threads = 2
eval_interval = 0
log_interval = 1
peak_flops = 1e11
checkpoint_interval = -1
out_dir = "$d/run"
[optim]
lr = 1e-4
warmup_steps = 0
[data]
train = "$work/train_$vocab.bin"
tokenizer = "bytes"
TOML
    if [ "$lora" = 1 ]; then printf '[lora]\nrank = 8\nalpha = 16\ntargets = ["q_proj", "v_proj"]\n'; fi
  } >"$d/run.toml"
  "$BIN" train --config "$d/run.toml" >"$d/train.log"
  local method=full
  [ "$lora" = 1 ] && method=lora
  "$BIN" plan --config "$d/run.toml" --gpus 1 --finetune "$method" --lora-rank 8 --lora-targets qv \
    --seq 256 --global-batch 4 --json >"$d/plan.json"
  echo "$name" >>"$work/cases"
}

random_tokens 40000 50257 && mv "$work/train.bin" "$work/train_50257.bin"
run_case "llama-60M full" llama-60M 50257 0
run_case "llama-60M LoRA" llama-60M 50257 1

if [ -x "$VENV_PY" ]; then
  # A ~100M Llama (GQA 12/4 heads, untied, vocabulary 32000) as transformers writes it (bf16).
  "$VENV_PY" - "$work/hf" <<'PY'
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
c = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
                num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=512,
                tie_word_embeddings=False)
LlamaForCausalLM(c).to(torch.bfloat16).save_pretrained(sys.argv[1])
PY
  "$BIN" ckpt import --format hf --in "$work/hf" --out "$work/imported" --dtype bf16 >/dev/null
  random_tokens 40000 32000 && mv "$work/train.bin" "$work/train_32000.bin"
  run_case "imported full" "$work/imported" 32000 0
  run_case "imported LoRA" "$work/imported" 32000 1
else
  echo "(no $VENV_PY: the imported-model half is skipped)" >&2
fi

python3 - "$work" <<'PY'
import json, sys
work = sys.argv[1]
cats = ["params", "grads", "optimizer", "activations", "workspace"]
mib = lambda b: b / 2**20
print(f"{'case':<15} " + " ".join(f"{c:>17}" for c in cats) +
      f" {'total':>8} {'GPU plan p/g/o':>20} {'tok/s':>7}")
for name in open(f"{work}/cases").read().splitlines():
    d = f"{work}/{name}"
    recs = [json.loads(l) for l in open(f"{d}/run/metrics.jsonl")]
    end = [r for r in recs if r.get("memory") == "end"][-1]
    steps = [r for r in recs if "tokens_per_s" in r and r.get("step", 0) > 1]
    tok_s = sum(r["tokens_per_s"] for r in steps) / max(1, len(steps))
    plan = json.load(open(f"{d}/plan.json"))
    gpu = plan["search"]["ranked"][0]["memory_bytes"] if "search" in plan else plan["ranked"][0]["memory_bytes"]
    cells = [f"{mib(end['bytes'][c + '_peak']):7.1f}/{mib(end['predicted'][c]):7.1f}" for c in cats]
    total = sum(end["bytes"][c + "_peak"] for c in cats)
    p = "/".join(f"{mib(gpu[k]):.1f}" for k in ("params", "grads", "optimizer"))
    print(f"{name:<15} " + " ".join(f"{c:>17}" for c in cells) +
          f" {mib(total):8.1f} {p:>20} {tok_s:7.0f}")
print("MiB measured/predicted (engine); GPU plan: the planner's params/grads/optimizer MiB on one GPU")
PY
