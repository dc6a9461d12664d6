#!/usr/bin/env bash
# chat-jsonl SFT against transformers: a Qwen2 vocabulary (the committed fixture) with TRL's
# Qwen2.5 training template (its {% generation %} blocks); 16 conversations.
#  1. `meshtrain tokenize --chat --mask` gives, for each, the ids and assistant mask that
#     transformers' apply_chat_template(return_assistant_tokens_mask=True) gave
#     (sft_conversations.transformers.jsonl; re-made and compared where HF_PYTHON has
#     transformers, SKIPPED otherwise); there also 30 random conversations for each of four
#     vocabularies (random_masks_check.py).
#  2. A 2-rank run on the conversations (data.format = "chat-jsonl") equals, loss for loss, the
#     same run on transformers' ids and masks as pre-tokenized sft-jsonl records, packed and not.
# usage: chat_sft_parity.sh MPIRUN_PREFIX... -- MESHTRAIN WORK_DIR VOCAB_DIR HF_PYTHON
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/../support/cli_common.sh" "$@"
rest=("${@:$#-1}")  # the two arguments after WORK_DIR
vocab=${rest[0]} hf_py=${rest[1]}
rm -rf "$work" && mkdir -p "$work"
folder=$work/qwen2-chat
python3 "$here/make_model_folder.py" "$vocab/qwen2/tokenizer.json" \
  "$here/templates/qwen2_5_training.jinja" "$folder"
convs=$here/sft_conversations.jsonl ref=$here/sft_conversations.transformers.jsonl

if [ -x "$hf_py" ] && "$hf_py" -c "import transformers" 2>/dev/null; then
  "$hf_py" "$here/chat_template_ref.py" masks "$folder" "$convs" "$work/transformers.jsonl"
  cmp "$work/transformers.jsonl" "$ref" || fail "transformers' ids / masks differ from the committed ones"
  echo "transformers: the committed ids and masks are its own"
  "$hf_py" "$here/random_masks_check.py" "$bin" "$vocab" "$here/templates/qwen2_5_training.jinja" \
    "$work/random" 30
else
  echo "transformers re-check: SKIPPED (no venv at $hf_py)"
fi

python3 - "$bin" "$folder" "$convs" "$ref" <<'PY'
import json, subprocess, sys
bin, folder, convs, ref = sys.argv[1:]
pairs = list(zip(open(convs, encoding="utf-8"), open(ref)))
for i, (conv, want) in enumerate(pairs):
    out = subprocess.run([bin, "tokenize", "--tokenizer", folder, "--chat", "--mask"],
                         input=conv.encode(), capture_output=True, check=True).stdout.decode()
    ids, mask = ([int(x) for x in line.split()] for line in out.splitlines())
    want = json.loads(want)
    assert ids == want["input_ids"], f"conversation {i}: ids differ"
    assert mask == want["assistant_masks"], f"conversation {i}: masks differ\n{mask}\n{want['assistant_masks']}"
print(f"tokenize --chat --mask: {len(pairs)} conversations equal transformers' ids and masks")
PY

cat >"$work/run.toml" <<TOML
[model]
preset = "llama-tiny"
vocab_size = 151936
[train]
steps = 3
batch_size = 4
micro_batch_size = 1
seq_len = 128
threads = 1
checkpoint_interval = -1
eval_interval = 0
log_interval = 1
[optim]
lr = 3e-3
warmup_steps = 1
[data]
tokenizer = "$folder"
TOML
common=(train --config "$work/run.toml")
for pack in true false; do
  "${mpirun[@]}" 2 "$bin" "${common[@]}" --data.sft_pack $pack --data.format chat-jsonl \
    --data.train "$convs" --train.out_dir "$work/chat_$pack" >"$work/chat_$pack.log" 2>&1 \
    || { cat "$work/chat_$pack.log"; fail "chat-jsonl run (pack $pack)"; }
  "${mpirun[@]}" 2 "$bin" "${common[@]}" --data.sft_pack $pack --data.format sft-jsonl \
    --data.train "$ref" --train.out_dir "$work/ids_$pack" >"$work/ids_$pack.log" 2>&1 \
    || { cat "$work/ids_$pack.log"; fail "pre-tokenized run (pack $pack)"; }
  grep "SFT records" "$work/chat_$pack.log" | head -n1
  python3 - "$work/chat_$pack/metrics.jsonl" "$work/ids_$pack/metrics.jsonl" <<'PY'
import json, sys
a, b = ([(r["step"], r["loss"]) for r in map(json.loads, open(p)) if "loss" in r] for p in sys.argv[1:])
assert len(a) == 3 and a == b, (a, b)
print("losses equal:", [l for _, l in a])
PY
done
echo "chat_sft_parity: ok"
