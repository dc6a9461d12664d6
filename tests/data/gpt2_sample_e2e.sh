#!/usr/bin/env bash
# The main job's path in miniature: text -> `meshtrain prepare` (GPT-2) ->
# train a tiny vocab-50257 Llama a few steps -> `meshtrain sample --prompt`
# prints text that starts with the prompt, and the ids are GPT-2's.
# usage: gpt2_sample_e2e.sh MESHTRAIN WORK_DIR GPT2_RANKS
set -euo pipefail
BIN=$1 WORK=$2 RANKS=$3
rm -rf "$WORK"
mkdir -p "$WORK/text"
for book in 1 2 3 4 5 6; do
  for verse in $(seq 40); do
    echo "And God said, Let there be light: and there was light. Verse $book:$verse."
  done >"$WORK/text/book$book.txt"
done
"$BIN" prepare --input "$WORK/text" --out "$WORK/shards" --gpt2-ranks "$RANKS" --val-fraction 0.3 \
  --progress none
cat >"$WORK/run.toml" <<TOML
[model]
family = "llama"
dim = 32
n_layers = 1
n_heads = 2
hidden_dim = 64
vocab_size = 50257
max_seq_len = 32
[train]
steps = 3
batch_size = 4
seq_len = 32
eval_interval = 3
eval_batches = 1
peak_flops = 1e11
out_dir = "$WORK/run"
[data]
train = "$WORK/shards/train_*.bin"
val = "$WORK/shards/val_*.bin"
tokenizer = "gpt2"
gpt2_ranks = "$RANKS"
TOML
"$BIN" train --config "$WORK/run.toml" >/dev/null
text=$("$BIN" sample --checkpoint "$WORK/run/step_3" --prompt "And God said" --max-new-tokens 5 --temperature 0)
echo "$text"
[[ "$text" == "And God said"* ]] || { echo "sample text does not start with the prompt" >&2; exit 1; }
ids=$("$BIN" sample --checkpoint "$WORK/run/step_3" --prompt "And God said" --max-new-tokens 5 \
  --temperature 0 --print-ids)
echo "$ids"
# GPT-2's ids for "And", " God", " said", then 5 new ones; then the same text again.
grep -Eq '^1870,1793,531(,[0-9]+){5}$' <<<"$(head -1 <<<"$ids")"
test "$(tail -n +2 <<<"$ids")" = "$text"
echo "gpt2_sample_e2e: OK"
