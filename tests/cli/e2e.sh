#!/usr/bin/env bash
# End to end: train llama-tiny on the byte-level toy corpus, check the loss
# falls and the metrics and checkpoints exist, resume, sample, export and
# import, then prepare malformed checkpoints for the error cases.
# usage: e2e.sh MESHTRAIN WORK_DIR
set -euo pipefail
BIN=$1 WORK=$2
rm -rf "$WORK/run" "$WORK/resumed"
"$BIN" train --config "$WORK/good.toml" | tee "$WORK/train.log"
test -f "$WORK/run/step_15/manifest.json"
test -f "$WORK/run/step_30/rank_0.safetensors"
test "$(cat "$WORK/run/latest")" = step_30
test "$(grep -c '"loss"' "$WORK/run/metrics.jsonl")" -eq 30
test "$(grep -c '"val_loss"' "$WORK/run/metrics.jsonl")" -eq 2
python3 - "$WORK/run/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
loss = [r["loss"] for r in rows if "loss" in r]
for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "step_ms"):
    assert all(key in r for r in rows if "loss" in r), key
print(f"loss {loss[0]:.4f} -> {loss[-1]:.4f}")
assert loss[-1] < loss[0] - 1.0, "loss did not fall"
PY

# Resume from step 15 into another directory: the same losses, bit for bit.
sed "s|out_dir = .*|out_dir = \"$WORK/resumed\"|" "$WORK/good.toml" >"$WORK/resumed.toml"
"$BIN" train --config "$WORK/resumed.toml" --resume "$WORK/run/step_15" >/dev/null
python3 - "$WORK/run/metrics.jsonl" "$WORK/resumed/metrics.jsonl" <<'PY'
import json, sys
def trace(path):
    return [(r["step"], r["loss"], r["lr"], r["grad_norm"]) for r in map(json.loads, open(path)) if "loss" in r]
full, resumed = trace(sys.argv[1]), trace(sys.argv[2])
assert full[15:] == resumed, f"resumed trace differs:\n{full[15:]}\n{resumed}"
print("resume: bit-identical losses for steps 16..30")
PY
for d in run resumed; do "$BIN" ckpt export --format hf --checkpoint "$WORK/$d/step_30" --out "$WORK/hf_$d" >/dev/null; done
cmp "$WORK/hf_run/model.safetensors" "$WORK/hf_resumed/model.safetensors"

# Inspect lists the layout and files and verifies every checksum.
"$BIN" ckpt inspect --verify "$WORK/run/step_30" | tee "$WORK/inspect.txt"
grep -q "rank_0.safetensors" "$WORK/inspect.txt"
grep -q "model.embed_tokens.weight" "$WORK/inspect.txt"

# Sample: greedy twice gives the same ids; byte-level text is printed.
a=$("$BIN" sample --checkpoint "$WORK/run/step_30" --prompt-ids 65,110,100,32 --temperature 0 --max-new-tokens 40 --print-ids)
b=$("$BIN" sample --checkpoint "$WORK/run/step_30" --prompt-ids 65,110,100,32 --temperature 0 --max-new-tokens 40 --print-ids)
echo "$a"
test "$a" = "$b"
grep -Eq '^65,110,100,32(,[0-9]+){40}$' <<<"$a"
"$BIN" sample --checkpoint "$WORK/run/step_30" --prompt "And the" --temperature 0.8 --top-k 20 --seed 3 --max-new-tokens 100

# Export to HF and llama2.c and back: greedy ids unchanged.
"$BIN" ckpt export --format hf --checkpoint "$WORK/run/step_30" --out "$WORK/hf"
"$BIN" ckpt export --format llama2c --checkpoint "$WORK/run/step_30" --out "$WORK/model.bin"
"$BIN" ckpt import --format llama2c --in "$WORK/model.bin" --out "$WORK/from_llama2c"
for src in "--checkpoint $WORK/hf" "--model-file $WORK/model.bin" "--checkpoint $WORK/from_llama2c"; do
  c=$("$BIN" sample $src --prompt-ids 65,110,100,32 --temperature 0 --max-new-tokens 40 --print-ids)
  test "$(head -1 <<<"$c")" = "$(head -1 <<<"$a")" || { echo "ids differ after $src"; exit 1; }
done

# The exports carry the run's tokenizer (bytes: NUL is bos/eos).
for f in tokenizer.json tokenizer_config.json generation_config.json; do test -s "$WORK/hf/$f"; done
grep -q '"eos_token_id": 0' "$WORK/hf/config.json"
test -s "$WORK/tokenizer.bin"

# eval reproduces the val_loss the run logged at step 30, from another folder too.
want=$(python3 -c "import json,sys; print([r['val_loss'] for r in map(json.loads, open(sys.argv[1])) if 'val_loss' in r and r['step'] == 30][0])" "$WORK/run/metrics.jsonl")
got=$(cd / && "$BIN" eval --checkpoint "$WORK/run/step_30" --data "$WORK/val.bin" --logits-ids 65,110,100 --logits-out "$WORK/logits.safetensors")
echo "$got"
python3 - "$want" "$got" <<'PY'
import re, sys
want, got = float(sys.argv[1]), float(re.search(r"loss ([0-9.]+)", sys.argv[2]).group(1))
assert abs(want - got) < 1e-5, f"eval loss {got} != logged val_loss {want}"
PY
test -s "$WORK/logits.safetensors"

# llm.c: a GPT-2 written by transformers -> llm.c file (f32 and bf16) -> back: same weights.
fixture="$(cd "$(dirname "$0")/../reference/fixtures/hf_tiny_gpt2" && pwd)"
"$BIN" ckpt import --format hf --in "$fixture" --out "$WORK/gpt2_hf" >/dev/null
"$BIN" ckpt export --format llmc --checkpoint "$WORK/gpt2_hf" --out "$WORK/gpt2.bin"
"$BIN" ckpt import --format llmc --in "$WORK/gpt2.bin" --out "$WORK/gpt2_back"
cmp "$WORK/gpt2_hf/model.safetensors" "$WORK/gpt2_back/model.safetensors"
"$BIN" ckpt export --format llmc --dtype bf16 --checkpoint "$WORK/gpt2_hf" --out "$WORK/gpt2_bf16.bin"
test "$(stat -c %s "$WORK/gpt2_bf16.bin")" -eq $(( ($(stat -c %s "$WORK/gpt2.bin") - 1024) / 2 + 1024 ))

# prepare (byte tokenizer) writes shards the trainer reads.
"$BIN" prepare --input "$WORK/text" --out "$WORK/prepared" --tokenizer bytes --val-fraction 0.5 --progress none
"$BIN" train --config "$WORK/good.toml" --data.train "$WORK/prepared/train_*.bin" \
  --data.val "$WORK/prepared/val_000000.bin" --train.steps 2 --train.out_dir "$WORK/run_prepared" >/dev/null

# Malformed checkpoints for the error cases (tests/cli.cmake).
for bad in truncated header_len bad_json; do
  rm -rf "$WORK/ckpt_$bad" && cp -r "$WORK/run/step_30" "$WORK/ckpt_$bad"
done
truncate -s 5000 "$WORK/ckpt_truncated/rank_0.safetensors"
printf '\xff\xff\xff\xff\xff\xff\x00\x00' | dd of="$WORK/ckpt_header_len/rank_0.safetensors" bs=1 conv=notrunc status=none
printf '{"a": ' | dd of="$WORK/ckpt_bad_json/manifest.json" bs=1 conv=notrunc status=none
echo "e2e: OK"
