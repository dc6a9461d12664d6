#!/usr/bin/env bash
# LoRA checkpoints through `ckpt export`: a plain format without --merge-lora or
# --base-only is refused with one line naming both flags and --format peft;
# with them (and --format peft) the exports are written, the merged one differs
# from the base, and the PEFT folder has PEFT's two files. (The numbers are
# checked against peft itself by reference_peft_venv and test_ckpt's LoraExport.)
# usage: lora_export.sh MESHTRAIN WORK
set -euo pipefail
bin=$1 work=$2/lora_export
here=$(cd "$(dirname "$0")" && pwd)
rm -rf "$work" && mkdir -p "$work"
"$bin" train --config "$2/good.toml" --train.steps 3 --train.checkpoint_interval 3 --train.eval_interval 0 \
  --train.out_dir "$work/run" --lora.rank 2 >/dev/null
ck=$work/run/step_3
bash "$here/run_case.sh" 1 "^meshtrain: ckpt export: '.*step_3' has LoRA adapters \(lora.rank = 2\): --format hf needs --merge-lora .* or --base-only .*; --format peft writes the adapters alone$" \
  -- "$bin" ckpt export --format hf --checkpoint "$ck" --out "$work/refused"
bash "$here/run_case.sh" 1 "^meshtrain: ckpt export: --format peft writes the adapters alone; --merge-lora and --base-only" \
  -- "$bin" ckpt export --format peft --merge-lora --checkpoint "$ck" --out "$work/refused"
"$bin" ckpt export --format hf --merge-lora --checkpoint "$ck" --out "$work/merged" >/dev/null
"$bin" ckpt export --format hf --base-only --checkpoint "$ck" --out "$work/base" >/dev/null
"$bin" ckpt export --format llama2c --merge-lora --checkpoint "$ck" --out "$work/merged.bin" >/dev/null
"$bin" ckpt export --format peft --checkpoint "$ck" --out "$work/peft" >/dev/null
for f in merged/model.safetensors base/model.safetensors merged.bin peft/adapter_config.json peft/adapter_model.safetensors; do
  [ -f "$work/$f" ] || { echo "FAIL: no $f"; exit 1; }
done
if cmp -s "$work/merged/model.safetensors" "$work/base/model.safetensors"; then
  echo "FAIL: the merged export equals the base (lora_B still zero?)"; exit 1
fi
grep -q '"peft_type": "LORA"' "$work/peft/adapter_config.json" || { echo "FAIL: adapter_config.json"; exit 1; }
# A PEFT adapter (peft's own, the committed fixture) merged into its base by ckpt import: the
# result gives PeftModel's logits.
fixture=$here/../reference/fixtures/peft_tiny_llama
"$bin" ckpt import --format peft --in "$fixture/adapter" --base "$fixture/base" --out "$work/imported" >/dev/null
ids=$(python3 -c "print(','.join(str((7 * t + 3) % 64) for t in range(40)))")
python3 "$here/../support/random_tokens.py" "$work/tokens64.bin" 100 64
"$bin" eval --checkpoint "$work/imported" --data "$work/tokens64.bin" --batches 1 --batch-size 1 --seq-len 8 \
  --logits-ids "$ids" --logits-out "$work/imported_logits.safetensors" >/dev/null
"${MESHTRAIN_PYTHON:-/usr/bin/python3}" - "$here/../reference" "$work/imported_logits.safetensors" "$fixture/logits.safetensors" <<'PY'
import sys
sys.path.insert(0, sys.argv[1])
import numpy as np, stfile
ours, theirs = stfile.read(sys.argv[2])[0]["logits"], stfile.read(sys.argv[3])[0]["logits"]
worst = float(np.max(np.abs(ours.astype(np.float64) - theirs) / np.maximum(1.0, np.abs(theirs))))
print(f"ckpt import --format peft: logits vs PeftModel's {worst:.2e}")
assert worst <= 1e-5, worst
PY
bash "$here/run_case.sh" 1 "^meshtrain: ckpt import: --format peft needs --base" \
  -- "$bin" ckpt import --format peft --in "$fixture/adapter" --out "$work/refused"
echo PASS
