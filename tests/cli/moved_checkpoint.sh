#!/usr/bin/env bash
# A checkpoint carries its run's GPT-2 ranks file: train with a copy of the
# ranks, delete that copy, move the step directory elsewhere and sample,
# evaluate and export from another folder. The manifest lists and checksums
# the carried file (ckpt inspect --verify).
# usage: moved_checkpoint.sh MESHTRAIN WORK GPT2_RANKS
set -euo pipefail
bin=$(realpath "$1") work=$2/moved_checkpoint ranks=$3
if [ ! -f "$ranks" ]; then
  echo "SKIP: no GPT-2 ranks at $ranks"
  exit 77
fi
rm -rf "$work" && mkdir -p "$work/tok" "$work/text" "$work/elsewhere"
cp "$ranks" "$work/tok/gpt2.tiktoken"
for d in $(seq 1 10); do
  for i in $(seq 1 20); do echo "Once upon a time a little cat saw the sun, and it was happy."; done >"$work/text/t$d.txt"
done
"$bin" prepare --input "$work/text" --out "$work/shards" --tokenizer gpt2 --gpt2-ranks "$work/tok/gpt2.tiktoken" \
  --val-fraction 0.2 --progress none >/dev/null
cat >"$work/run.toml" <<TOML
[model]
family = "gpt2"
dim = 16
n_layers = 1
n_heads = 2
hidden_dim = 32
vocab_size = 50257
max_seq_len = 32
[train]
steps = 2
batch_size = 2
seq_len = 16
eval_interval = 0
checkpoint_interval = 2
out_dir = "run"
[data]
train = "shards/train_*.bin"
val = "shards/val_*.bin"
tokenizer = "gpt2"
gpt2_ranks = "tok/gpt2.tiktoken"
TOML
(cd "$work" && "$bin" train --config run.toml >/dev/null)
listing=$("$bin" ckpt inspect --verify "$work/run/step_2")
grep -q "gpt2.tiktoken" <<<"$listing" || { echo "FAIL: the manifest does not list gpt2.tiktoken"; exit 1; }
rm -rf "$work/tok"
mv "$work/run/step_2" "$work/elsewhere/moved"
cd "$work/elsewhere"
out=$("$bin" sample --checkpoint moved --prompt "Once upon a time" --max-new-tokens 4 --temperature 0)
case $out in
  "Once upon a time"*) ;;
  *) echo "FAIL: sample printed '$out'"; exit 1 ;;
esac
"$bin" ckpt export --format hf --checkpoint moved --out hf >/dev/null
[ -f hf/tokenizer.json ] || { echo "FAIL: the export has no tokenizer.json"; exit 1; }
echo PASS
