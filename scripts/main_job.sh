#!/usr/bin/env bash
# The main job, from raw text to a trained model with the GPT-2 tokenizer:
# set up, write the King James Bible as text (one document per book), tokenize
# it into train/validation shards, train a small Llama (vocab 50257) on them and
# sample from the result. The training runs data-parallel on RANKS ranks
# (default 2) under mpirun. Extra arguments go to `meshtrain train` (overrides).
set -euo pipefail
cd "$(dirname "$0")/.."
RANKS=${RANKS:-2}
# Open MPI refuses to run as root unless told; the scripts run as root in CI.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
bash scripts/setup.sh build meshtrain  # the binary only; scripts/test.sh builds the tests
bash scripts/kjv_text.sh data/kjv/text
./build/meshtrain prepare --input data/kjv/text --out data/kjv/gpt2 --tokenizer gpt2 \
  --gpt2-ranks data/gpt2.tiktoken --val-fraction 0.05
oversubscribe=()
(( RANKS > $(nproc) )) && oversubscribe=(--oversubscribe)
mpirun -np "$RANKS" "${oversubscribe[@]}" ./build/meshtrain train \
  --config configs/llama-kjv-gpt2.toml "$@"
last=$(ls -d runs/llama-kjv-gpt2/step_* | sort -t_ -k2 -n | tail -1)
echo "sampling from $last"
./build/meshtrain sample --checkpoint "$last" --prompt "And God said" --max-new-tokens 120 \
  --temperature 0.8 --top-k 40 --seed 1
