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
gpt2_ranks = "tok/gpt2.tiktoken"
TOML
# The ranks by a path relative to where training runs; sample and export run elsewhere.
mkdir -p "$WORK/tok" && cp "$RANKS" "$WORK/tok/gpt2.tiktoken"
(cd "$WORK" && "$BIN" train --config "$WORK/run.toml" >/dev/null)
cd /
text=$("$BIN" sample --checkpoint "$WORK/run/step_3" --prompt "And God said" --max-new-tokens 5 --temperature 0)
echo "$text"
[[ "$text" == "And God said"* ]] || { echo "sample text does not start with the prompt" >&2; exit 1; }
ids=$("$BIN" sample --checkpoint "$WORK/run/step_3" --prompt "And God said" --max-new-tokens 5 \
  --temperature 0 --print-ids)
echo "$ids"
# GPT-2's ids for "And", " God", " said", then 5 new ones; then the same text again.
grep -Eq '^1870,1793,531(,[0-9]+){5}$' <<<"$(head -1 <<<"$ids")"
test "$(tail -n +2 <<<"$ids")" = "$text"
# Exports carry the tokenizer: GPT-2's <|endoftext|> 50256 as bos/eos.
"$BIN" ckpt export --format hf --checkpoint "$WORK/run/step_3" --out "$WORK/hf" >/dev/null
grep -q '"eos_token_id": 50256' "$WORK/hf/config.json"
grep -q '"bos_token_id": 50256' "$WORK/hf/generation_config.json"
grep -q '"<|endoftext|>": 50256' "$WORK/hf/tokenizer.json" || grep -q '"<|endoftext|>":50256' "$WORK/hf/tokenizer.json"
"$BIN" ckpt export --format llama2c --checkpoint "$WORK/run/step_3" --out "$WORK/l2c/model.bin" >/dev/null
test -s "$WORK/l2c/tokenizer.bin"
python3 - "$WORK/l2c/tokenizer.bin" <<'PY'
import struct, sys
data = open(sys.argv[1], "rb").read()
(max_len,), at, tokens = struct.unpack_from("<i", data), 4, []
while at < len(data):
    score, n = struct.unpack_from("<fi", data, at)
    tokens.append(data[at + 8: at + 8 + n]); at += 8 + n
assert len(tokens) == 50257 and tokens[50256] == b"<|endoftext|>" and tokens[262] == b" the", len(tokens)
print(f"tokenizer.bin: {len(tokens)} tokens, max length {max_len}")
PY
echo "gpt2_sample_e2e: OK"
