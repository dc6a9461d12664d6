#!/usr/bin/env bash
# The main job: set up, turn the King James Bible into byte-level tokens,
# train a small Llama on it and sample from the result.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh build
bash scripts/kjv_text.sh data/kjv/text
python3 scripts/bytes_to_tokens.py data/kjv/text data/kjv/kjv_bytes
./build/meshtrain train --config configs/llama-tiny-bytes.toml "$@"
last=$(ls -d runs/llama-tiny-bytes/step_* | sort -t_ -k2 -n | tail -1)
echo "sampling from $last"
./build/meshtrain sample --checkpoint "$last" --prompt-ids 65,110,100,32 --max-new-tokens 200 \
  --temperature 0.8 --top-k 40 --seed 1
