#!/usr/bin/env bash
# An SFT checkpoint whose model has more ids (512) than its tokenizer (bytes, 256), as an HF
# model fine-tuned on byte-level records: `sample` prints every id and marks the ones the
# tokenizer lacks as <|id N|> (with --print-ids and when streaming text), and `eval` takes the
# run's JSONL records or token shards alike.
# usage: sft_wide_vocab.sh MESHTRAIN WORK_DIR   (WORK_DIR from make_inputs.sh: good.toml, val.bin)
set -euo pipefail
BIN=$1 WORK=$2/sft_wide_vocab
records="$(cd "$(dirname "$0")/../train/fixtures" && pwd)"
rm -rf "$WORK"
# make_inputs.sh's tiny run, made an SFT run of one step with 512 ids.
"$BIN" train --config "$2/good.toml" --model.vocab_size 512 --train.steps 1 --train.seq_len 128 \
  --data.format sft-jsonl --data.train "$records/sft_tiny.jsonl" \
  --data.val "$records/sft_tiny_val.jsonl" --train.out_dir "$WORK/run" >/dev/null
step=$WORK/run/step_1

# Near-uniform over 512 ids after one step: a fixed seed draws ids past 255.
"$BIN" sample --checkpoint "$step" --prompt "User: hi" --temperature 1 --seed 3 \
  --max-new-tokens 40 --print-ids >"$WORK/ids.txt"
ids=$(head -n1 "$WORK/ids.txt")
wide=$(tr ',' '\n' <<<"$ids" | awk '$1 >= 256' | head -n1)
[ -n "$wide" ] || { echo "FAIL: no id >= 256 drawn (the test needs one): $ids"; exit 1; }
grep -qF "<|id $wide|>" "$WORK/ids.txt" || { echo "FAIL: id $wide not marked in the text:"; cat "$WORK/ids.txt"; exit 1; }
"$BIN" sample --checkpoint "$step" --prompt "User: hi" --temperature 1 --seed 3 \
  --max-new-tokens 40 >"$WORK/text.txt"
grep -qF "<|id $wide|>" "$WORK/text.txt" || { echo "FAIL: streamed text lacks <|id $wide|>:"; cat "$WORK/text.txt"; exit 1; }
echo "sample: id $wide printed and marked"

# eval: the run's own kind of data, then token shards (byte ids, below 512).
"$BIN" eval --checkpoint "$step" --data "$records/sft_tiny_val.jsonl" --batches 1 | grep -q "loss"
"$BIN" eval --checkpoint "$step" --data "$2/val.bin" --batches 1 --seq-len 64 | tee "$WORK/eval_bin.txt"
grep -q "loss" "$WORK/eval_bin.txt"
echo "sft_wide_vocab: ok"
