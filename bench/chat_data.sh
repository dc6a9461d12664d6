#!/usr/bin/env bash
# Chat and corpus data paths at scale (docs/benchmarks.md#chat-data-prepare-at-100-mb-and-chat-jsonl-packing):
#  1. `meshtrain prepare` of a 100 MB corpus (the KJV 24 times, one document per book and copy)
#     end to end, 2 threads, with Qwen2's and GPT-2's tokenizer.json;
#  2. chat-jsonl packing efficiency: 2000 conversations made from the KJV (a user asks for what
#     follows a verse, the assistant answers with the next 1-12 verses), rendered by Qwen2.5's
#     real template, packed and unpacked rows at seq_len 512, 1024 and 2048.
# usage: bench/chat_data.sh [build-dir]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
bin=$build/meshtrain
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores"
python3 tests/tokenizer/vocab/unpack.py "$work/vocab" >/dev/null
bash scripts/kjv_text.sh "$work/kjv" >/dev/null
mkdir -p "$work/corpus"
for i in $(seq -w 1 24); do
  for f in "$work"/kjv/*.txt; do cp "$f" "$work/corpus/${i}_$(basename "$f")"; done
done
bytes=$(cat "$work"/corpus/*.txt | wc -c)
echo "corpus: $bytes bytes in $(ls "$work/corpus" | wc -l) documents"
for tok in qwen2 gpt2; do
  start=$(date +%s.%N)
  "$bin" prepare --input "$work/corpus" --out "$work/shards_$tok" --tokenizer "$work/vocab/$tok" \
    --threads 2 --progress none >"$work/prepare_$tok.log"
  end=$(date +%s.%N)
  python3 -c "import sys; b, s = int(sys.argv[1]), float(sys.argv[3]) - float(sys.argv[2]); print(f'prepare {sys.argv[4]}: {s:.1f} s, {b / s / 1e6:.1f} MB/s end to end')" \
    "$bytes" "$start" "$end" "$tok"
  tail -n1 "$work/prepare_$tok.log"
done

python3 tests/chat/make_model_folder.py "$work/vocab/qwen2/tokenizer.json" \
  third_party/llama-jinja/models/templates/Qwen-Qwen2.5-7B-Instruct.jinja "$work/qwen2.5"
python3 - "$work/kjv" "$work/chats.jsonl" <<'PY'
import glob, json, random, sys
verses = [l.strip() for f in sorted(glob.glob(sys.argv[1] + "/*.txt")) for l in open(f) if l.strip()]
rng = random.Random(5)
with open(sys.argv[2], "w") as out:
    for _ in range(2000):
        i = rng.randrange(len(verses) - 13)
        k = rng.randint(1, 12)
        chat = [{"role": "user", "content": "What follows: " + verses[i]},
                {"role": "assistant", "content": " ".join(verses[i + 1:i + 1 + k])}]
        out.write(json.dumps({"messages": chat}) + "\n")
PY
cat >"$work/run.toml" <<TOML
[model]
family = "llama"
dim = 32
n_layers = 1
n_heads = 2
n_kv_heads = 2
hidden_dim = 64
vocab_size = 151936
max_seq_len = 2048
[train]
steps = 1
batch_size = 1
checkpoint_interval = -1
eval_interval = 0
[data]
format = "chat-jsonl"
train = "$work/chats.jsonl"
tokenizer = "$work/qwen2.5"
TOML
for seq in 512 1024 2048; do
  for pack in true false; do
    "$bin" train --config "$work/run.toml" --train.seq_len "$seq" --data.sft_pack "$pack" \
      --train.out_dir "$work/run_${seq}_$pack" 2>&1 | grep '^data:' | sed "s/^/seq $seq pack $pack: /"
  done
done
