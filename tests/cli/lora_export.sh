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
echo PASS
