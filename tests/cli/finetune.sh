#!/usr/bin/env bash
# The fine-tuning path through the CLI: a base model as a Hugging Face
# directory (llama-tiny, bytes vocabulary, trained here and exported: the
# committed HF fixtures have 64 ids, fewer than the bytes tokenizer's 256),
# then `meshtrain train` with [data] format = "sft-jsonl", train.init_from =
# that directory and [lora]; its checkpoint samples and evaluates.
# usage: finetune.sh MESHTRAIN WORK_DIR
set -euo pipefail
BIN=$1 WORK=$2/finetune
FIXTURES="$(cd "$(dirname "$0")/../train/fixtures" && pwd)"
rm -rf "$WORK" && mkdir -p "$WORK"
source "$(dirname "$0")/tiny_base.sh"
tiny_base "$BIN" "$WORK" "$FIXTURES"

cat >"$WORK/lora.toml" <<TOML
[train]
steps = 6
batch_size = 4
seq_len = 128
eval_interval = 3
eval_batches = 1
checkpoint_interval = 3
peak_flops = 1e11
init_from = "$WORK/hf"
out_dir = "$WORK/lora"
[optim]
lr = 3e-2
warmup_steps = 0
[data]
format = "sft-jsonl"
tokenizer = "bytes"
sft_pack = true
train = "$FIXTURES/sft_tiny.jsonl"
val = "$FIXTURES/sft_tiny_val.jsonl"
[lora]
rank = 4
alpha = 8
targets = ["q_proj", "v_proj", "down_proj"]
TOML
"$BIN" train --config "$WORK/lora.toml" >/dev/null
test "$(cat "$WORK/lora/latest")" = step_6
python3 - "$WORK/lora/metrics.jsonl" <<'PY'
import json, sys
loss = [r["loss"] for r in map(json.loads, open(sys.argv[1])) if "loss" in r]
print(f"sft + lora from an HF directory: loss {loss[0]:.4f} -> {loss[-1]:.4f}")
assert len(loss) == 6 and loss[-1] < loss[0], "loss did not fall"
PY
# Sample from the LoRA checkpoint (greedy twice: the same text) and evaluate it.
a=$("$BIN" sample --checkpoint "$WORK/lora/step_6" --prompt "User: hi" --temperature 0 --max-new-tokens 20 --print-ids)
b=$("$BIN" sample --checkpoint "$WORK/lora/step_6" --prompt "User: hi" --temperature 0 --max-new-tokens 20 --print-ids)
test -n "$a" && test "$a" = "$b"
"$BIN" eval --checkpoint "$WORK/lora/step_6" --data "$FIXTURES/sft_tiny_val.jsonl" | grep -q "loss"
echo "finetune: ok"
