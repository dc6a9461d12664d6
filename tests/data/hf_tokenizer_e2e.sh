#!/usr/bin/env bash
# A Hugging Face tokenizer end to end: `meshtrain tokenize` (encode, decode,
# --add-special), `prepare` with a real vocabulary (Phi-3's, Llama 2's
# SentencePiece BPE), a tiny Llama trained a few steps, the checkpoint carrying
# the tokenizer files (the original folder is gone by then), `sample --prompt`
# with them, and an HF export whose tokenizer.json is the original's bytes.
# usage: hf_tokenizer_e2e.sh MESHTRAIN WORK_DIR VOCAB_DIR
set -euo pipefail
BIN=$1 WORK=$2 VOCAB=$3
rm -rf "$WORK"
mkdir -p "$WORK/text"
cp -r "$VOCAB/phi3" "$WORK/tok"
ids=$(printf 'And God said, Let there be light' | "$BIN" tokenize --tokenizer "$WORK/tok")
framed=$(printf 'And God said, Let there be light' | "$BIN" tokenize --tokenizer "$WORK/tok" --add-special)
test "$framed" = "1 $ids"  # <s> first: its post-processor
test "$(echo "$ids" | "$BIN" tokenize --tokenizer "$WORK/tok" --decode)" = "And God said, Let there be light"
if "$BIN" tokenize --tokenizer "$WORK/missing" </dev/null 2>"$WORK/err"; then exit 1; fi
grep -q "tokenizer '$WORK/missing': unknown" "$WORK/err"

for book in 1 2 3 4 5 6; do
  for verse in $(seq 40); do
    echo "And God said, Let there be light: and there was light. Verse $book:$verse."
  done >"$WORK/text/book$book.txt"
done
"$BIN" prepare --input "$WORK/text" --out "$WORK/shards" --tokenizer "$WORK/tok" --val-fraction 0.3 \
  --progress none
cat >"$WORK/run.toml" <<TOML
[model]
family = "llama"
dim = 32
n_layers = 1
n_heads = 2
hidden_dim = 64
vocab_size = 32064
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
tokenizer = "$WORK/tok"
TOML
"$BIN" train --config "$WORK/run.toml" >/dev/null
for f in tokenizer.json tokenizer_config.json; do cmp "$WORK/tok/$f" "$WORK/run/step_3/$f"; done
mv "$WORK/tok" "$WORK/tok.gone"  # from here on only the checkpoint's copy exists
cd /
out=$("$BIN" sample --checkpoint "$WORK/run/step_3" --prompt "And God said" --max-new-tokens 4 \
  --temperature 0 --print-ids)
echo "$out"
# <s>, then the prompt's ids as the tokenizer gives them, then 4 new ones.
prompt=$(printf 'And God said' | "$BIN" tokenize --tokenizer "$WORK/tok.gone")
grep -Eq "^1,${prompt// /,}(,[0-9]+){4}\$" <<<"$(head -1 <<<"$out")"
[[ "$(tail -n +2 <<<"$out")" == "<s> And God said"* ]] || [[ "$(tail -n +2 <<<"$out")" == "<s>And God said"* ]]
"$BIN" ckpt export --format hf --checkpoint "$WORK/run/step_3" --out "$WORK/hf" >/dev/null
cmp "$WORK/tok.gone/tokenizer.json" "$WORK/hf/tokenizer.json"
grep -q '"bos_token_id": 1' "$WORK/hf/generation_config.json"
echo "hf_tokenizer_e2e: OK"
