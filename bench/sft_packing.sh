#!/usr/bin/env bash
# SFT packed vs unpacked rows on the committed JSONL fixture (docs/benchmarks.md#supervised-fine-tuning):
# median tokens/s (row tokens), loss tokens per step and loss tokens/s over steps 6-30.
# bash bench/sft_packing.sh [build/meshtrain]
set -euo pipefail
bin=${1:-build/meshtrain}
out=$(mktemp -d)
for pack in true false; do
  "$bin" train --config configs/sft-tiny-bytes.toml --data.sft_pack "$pack" \
    --train.out_dir "$out/$pack" --overwrite | grep '^data:'
  python3 - "$out/$pack/metrics.jsonl" "$pack" <<'PY'
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1]) if '"tokens_per_s"' in l][5:]
med = lambda xs: sorted(xs)[len(xs) // 2]
ms = med([r["step_ms"] for r in recs])
lt = sum(r["loss_tokens"] for r in recs) / len(recs)
print(f"pack={sys.argv[2]}: tokens/s {med([r['tokens_per_s'] for r in recs]):.0f}, step {ms:.1f} ms, "
      f"loss tokens/step {lt:.1f}, loss tokens/s {lt / ms * 1e3:.0f}")
PY
done
rm -rf "$out"
