#!/usr/bin/env bash
# fp16 end to end through the CLI: train llama-tiny on the byte corpus with
# train.precision = "fp16" (the loss falls, every step record carries the loss
# scale), resume it (--resume auto continues the scale), then eval, sample
# and export the fp16-trained checkpoint like any other.
# usage: fp16.sh MESHTRAIN WORK_DIR
set -euo pipefail
BIN=$1 WORK=$2
rm -rf "$WORK/fp16" "$WORK/hf_fp16"
"$BIN" train --config "$WORK/good.toml" --train.precision fp16 --train.steps 20 \
  --train.checkpoint_interval 10 --train.out_dir "$WORK/fp16" --train.loss_scale_init 16777216 \
  | tee "$WORK/fp16.log"
grep -q "loss scale" "$WORK/fp16.log"
"$BIN" train --config "$WORK/good.toml" --train.precision fp16 --train.steps 24 \
  --train.checkpoint_interval 10 --train.out_dir "$WORK/fp16" --train.loss_scale_init 16777216 \
  --resume auto >/dev/null
python3 - "$WORK/fp16/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l]
assert [r["step"] for r in rows] == list(range(1, 21)) + list(range(21, 25)), [r["step"] for r in rows]
assert rows[0]["skipped"] and rows[0]["loss_scale"] == 2 ** 24, rows[0]
scale = [r["loss_scale"] for r in rows]
assert scale[20] == scale[19] / (2 if rows[19]["skipped"] else 1), scale  # resumed with its scale
applied = [r["loss"] for r in rows if not r["skipped"]]
print(f"fp16: {sum(r['skipped'] for r in rows)} skipped, scale {scale[0]:g} -> {scale[-1]:g}, "
      f"loss {applied[0]:.4f} -> {applied[-1]:.4f}")
assert applied[-1] < applied[0] - 0.5, "loss did not fall"
PY
"$BIN" eval --checkpoint "$WORK/fp16/step_24" --data "$WORK/val.bin"
"$BIN" sample --checkpoint "$WORK/fp16/step_24" --prompt "And the" --temperature 0 --max-new-tokens 20
"$BIN" sample --checkpoint "$WORK/fp16/step_24" --prompt "And the" --temperature 0 --max-new-tokens 20 \
  --precision fp16
"$BIN" ckpt export --format hf --checkpoint "$WORK/fp16/step_24" --out "$WORK/hf_fp16" --dtype f16
"$BIN" eval --checkpoint "$WORK/hf_fp16" --data "$WORK/val.bin"
echo "fp16 cli: ok"
