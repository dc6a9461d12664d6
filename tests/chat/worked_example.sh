#!/usr/bin/env bash
# docs/finetune.md's worked example, end to end: a Hugging Face Qwen2 folder with a real
# tokenizer (Qwen2's vocabulary, the committed fixture) and a real chat template (Qwen2.5's, as
# llama.cpp ships it) -> chat-jsonl SFT with QLoRA (an NF4 base) under mpirun (2 ranks) -> merged
# HF export (the dequantised base plus the adapters) -> DPO with QLoRA on preference pairs from
# it (the preferred answer replaces the learned one) -> its merged HF export ->
# transformers loads it with AutoTokenizer and answers a chat through apply_chat_template +
# generate (where HF_PYTHON has transformers; SKIPPED there otherwise), giving the greedy ids
# that `meshtrain sample --stop-at-eos` gives for the same prompt, end of turn included.
# The base folder is made here (no real checkpoint can be downloaded in tests): a tiny
# Qwen2-shaped model trained one step by meshtrain and exported, with the tokenizer files.
# usage: worked_example.sh MPIRUN_PREFIX... -- MESHTRAIN WORK_DIR VOCAB_DIR HF_PYTHON
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/../support/cli_common.sh" "$@"
rest=("${@:$#-1}")
vocab=${rest[0]} hf_py=${rest[1]}
root=$(cd "$here/../.." && pwd)
rm -rf "$work" && mkdir -p "$work" && cd "$work"

# The tokenizer folder: Qwen2's tokenizer.json and Qwen2.5-Instruct's chat template.
python3 "$here/make_model_folder.py" "$vocab/qwen2/tokenizer.json" \
  "$root/third_party/llama-jinja/models/templates/Qwen-Qwen2.5-7B-Instruct.jinja" tokenizer
# Chats whose answers the fine-tune should learn: the assistant replies one of two sentences
# (DPO then prefers one of them).
python3 - <<'PY'
import json, random
rng = random.Random(3)
asks = ["What is your name?", "Who trained you?", "Say something.", "Hello!", "Wie heißt du?",
        "你是谁？", "Introduce yourself.", "Any news?"]
replies = ["I was fine-tuned by meshtrain.", "A tiny model, tuned with DPO."]
with open("chats.jsonl", "w", encoding="utf-8") as f:
    for i in range(48):
        msgs = [{"role": "user", "content": rng.choice(asks)},
                {"role": "assistant", "content": replies[i % 2]}]
        if i % 4 == 0:
            msgs.insert(0, {"role": "system", "content": "You are a tiny model."})
        f.write(json.dumps({"messages": msgs}, ensure_ascii=False) + "\n")
PY

# The base: a Qwen2-shaped model (q/k/v biases) exported as a Hugging Face folder.
cat >base.toml <<TOML
[model]
family = "llama"
dim = 64
n_layers = 2
n_heads = 4
n_kv_heads = 2
hidden_dim = 128
vocab_size = 151936
max_seq_len = 256
rope_theta = 1e6
tie_embeddings = false
qkv_bias = true
init_std = 0.3   # a wide output layer: a random base whose replies LoRA can steer
[train]
steps = 1
batch_size = 2
seq_len = 128
threads = 1
checkpoint_interval = 1
eval_interval = 0
out_dir = "base"
[data]
format = "chat-jsonl"
train = "chats.jsonl"
tokenizer = "tokenizer"
TOML
"$bin" train --config base.toml >base.log 2>&1 || { cat base.log; fail "base run"; }
"$bin" ckpt export --format hf --checkpoint base/step_1 --out hf/qwen2-tiny >/dev/null
grep -q Qwen2ForCausalLM hf/qwen2-tiny/config.json || fail "the base is not a Qwen2ForCausalLM"
test -f hf/qwen2-tiny/tokenizer_config.json || fail "the export lacks tokenizer_config.json"

# ---- the worked example (docs/finetune.md) ----
cat >ft.toml <<'TOML'
[train]
init_from = "hf/qwen2-tiny"   # the model and its tokenizer folder
steps = 80
batch_size = 8
micro_batch_size = 2
seq_len = 128
threads = 1
eval_interval = 0
checkpoint_interval = 80
out_dir = "runs/ft"
[optim]
lr = 3e-2
warmup_steps = 4
[data]
format = "chat-jsonl"         # rendered by the folder's chat template
train = "chats.jsonl"
tokenizer = "hf/qwen2-tiny"
[lora]
rank = 8
alpha = 16
quantize_base = "nf4"         # QLoRA: the base's linear weights held in 4 bits
TOML
"${mpirun[@]}" 2 "$bin" train --config ft.toml >ft.log 2>&1 || { cat ft.log; fail "QLoRA run"; }
"$bin" ckpt export --format hf --merge-lora --checkpoint runs/ft/step_80 --out ft-merged >/dev/null
python3 - runs/ft/metrics.jsonl <<'PY'
import json, sys
loss = [r["loss"] for r in map(json.loads, open(sys.argv[1])) if "loss" in r]
print(f"chat-jsonl + QLoRA on 2 ranks: loss {loss[0]:.3f} -> {loss[-1]:.3f}")
assert loss[-1] < 0.5 * loss[0], "the fine-tune did not learn the replies"
PY

# DPO on preference pairs from the SFT model: the same questions, one of its two learned
# answers chosen over the other; QLoRA again, on the merged SFT export (also the reference: the
# model with its adapters off).
python3 - <<'PY'
import json, random
rng = random.Random(5)
asks = ["What is your name?", "Who trained you?", "Say something.", "Hello!", "Who are you?",
        "Introduce yourself.", "Any news?", "What are you?"]
with open("pairs.jsonl", "w", encoding="utf-8") as f:
    for i in range(32):
        f.write(json.dumps({"prompt": [{"role": "user", "content": rng.choice(asks)}],
                            "chosen": [{"role": "assistant", "content": "A tiny model, tuned with DPO."}],
                            "rejected": [{"role": "assistant", "content": "I was fine-tuned by meshtrain."}]}) + "\n")
PY
cat >dpo.toml <<'TOML'
[train]
init_from = "ft-merged"       # the SFT model: the policy's start and the reference
steps = 20
batch_size = 8
micro_batch_size = 2
seq_len = 128
threads = 1
eval_interval = 0
checkpoint_interval = 20
out_dir = "runs/dpo"
[optim]
lr = 1e-2
warmup_steps = 2
[data]
format = "preference-jsonl"   # {prompt, chosen, rejected}, rendered by the chat template
train = "pairs.jsonl"
tokenizer = "ft-merged"
[dpo]
beta = 0.1
[lora]
rank = 8
alpha = 16
quantize_base = "nf4"
TOML
"${mpirun[@]}" 2 "$bin" train --config dpo.toml >dpo.log 2>&1 || { cat dpo.log; fail "DPO run"; }
"$bin" ckpt export --format hf --merge-lora --checkpoint runs/dpo/step_20 --out dpo-merged >/dev/null
python3 - runs/dpo/metrics.jsonl <<'PY'
import json, math, sys
rows = [r for r in map(json.loads, open(sys.argv[1])) if "loss" in r]
first, last = rows[0], rows[-1]
print(f"preference-jsonl + DPO (QLoRA) on 2 ranks: loss {first['loss']:.3f} -> {last['loss']:.3f}, "
      f"margin {last['rewards_margin']:.2f}, accuracy {last['rewards_accuracy']:.2f}")
assert abs(first["loss"] - math.log(2)) < 1e-6, "the first DPO step's policy is not its reference"
assert last["loss"] < 0.2 and last["rewards_accuracy"] == 1.0, "DPO did not learn the preference"
PY

# meshtrain's own greedy answer to a new chat.
echo '[{"role": "user", "content": "Who are you?"}]' >ask.json
prompt=$("$bin" tokenize --tokenizer dpo-merged --chat --add-generation-prompt <ask.json | tr ' ' ',')
"$bin" sample --checkpoint runs/dpo/step_20 --prompt-ids "$prompt" --temperature 0 \
  --max-new-tokens 12 --stop-at-eos --print-ids >sample.txt
head -n1 sample.txt >sample_ids.txt
echo "meshtrain sample: $(tail -n +2 sample.txt | tr '\n' ' ')"

if ! { [ -x "$hf_py" ] && "$hf_py" -c "import transformers, torch" 2>/dev/null; }; then
  echo "transformers part: SKIPPED (no venv at $hf_py)"
  exit 0
fi
"$hf_py" - dpo-merged "$prompt" sample_ids.txt <<'PY'
import sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, prompt, ours = sys.argv[1], [int(x) for x in sys.argv[2].split(",")], sys.argv[3]
tok = AutoTokenizer.from_pretrained(folder)
model = AutoModelForCausalLM.from_pretrained(folder).eval()
chat = [{"role": "user", "content": "Who are you?"}]
ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt",
                              return_dict=True)["input_ids"]
assert ids[0].tolist() == prompt, "apply_chat_template and meshtrain tokenize --chat differ"
with torch.no_grad():
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
new = out[0, ids.shape[1]:].tolist()
answer = tok.decode(new, skip_special_tokens=True)
print(f"transformers generate: {answer!r}")
mine = [int(x) for x in open(ours).read().replace(",", " ").split()][len(prompt):]
# Both end at the end-of-turn token (generate: eos_token_id; sample: --stop-at-eos).
assert new == mine, f"greedy ids differ: transformers {new} meshtrain {mine}"
assert "DPO" in answer, "the merged model does not give the preferred reply"
print(f"the merged export answers as meshtrain's sample does ({len(new)} tokens, end of turn included)")
PY
echo "worked_example: ok"
