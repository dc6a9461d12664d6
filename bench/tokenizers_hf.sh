#!/usr/bin/env bash
# Hugging Face and SentencePiece tokenizers on the King James Bible, in one run,
# alternating A B A B with the strongest peer (docs/benchmarks.md, "Tokenizers"):
#   1. one thread, one long text (the whole KJV, 4.1 MB): meshtrain's encode vs
#      PyPI tokenizers' encode (sentencepiece's for a tokenizer.model);
#   2. two threads, the KJV eight times as 528 documents: `prepare --threads 2`
#      (loading, encoding, writing shards) vs tokenizers' encode_batch on a
#      two-thread pool (sentencepiece: num_threads=2), encoding only.
# Fixtures: tests/tokenizer/vocab (real vocabularies), unpacked here.
# Usage: bench/tokenizers_hf.sh [build-dir] [rounds]   (defaults: build 2)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
ROUNDS=${2:-2}
BIN=$BUILD/bench/bench_tokenizer
PY=${PYTHON:-$(bash scripts/py_venv.sh "$BUILD/py-venv")}
WORK=$BUILD/bench_tokenizers_hf
[ -x "$BIN" ] || { echo "tokenizers_hf: build it first: cmake --build $BUILD --target bench_tokenizer" >&2; exit 1; }
[ -d "$WORK/kjv" ] || bash scripts/kjv_text.sh "$WORK/kjv" >/dev/null
python3 tests/tokenizer/vocab/unpack.py "$WORK/vocab" >/dev/null
cat "$WORK"/kjv/*.txt >"$WORK/kjv.txt"
mkdir -p "$WORK/kjv8"
for copy in 1 2 3 4 5 6 7 8; do
  for f in "$WORK"/kjv/*.txt; do ln -sf "$(realpath "$f")" "$WORK/kjv8/${copy}_$(basename "$f")"; done
done
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores, load $(cut -d' ' -f1 /proc/loadavg)"
for fixture in gpt2 qwen2 qwen2-llama3 phi3 mistral-v1; do
  tok=$WORK/vocab/$fixture
  echo "== $fixture: one thread, one text ($(wc -c <"$WORK/kjv.txt") bytes)"
  for _ in $(seq "$ROUNDS"); do
    "$BIN" speed "$tok" - 3 "$WORK/kjv.txt"
    "$PY" tests/tokenizer/hf_tokenizers_ref.py bench --tokenizer "$tok" --threads 1 --reps 3 "$WORK/kjv.txt"
  done
  echo "== $fixture: two threads, KJV x8 as 528 documents"
  for _ in $(seq "$ROUNDS"); do
    "$BIN" prepare "$tok" - 2 "$WORK/prepare_$fixture" "$WORK/kjv8"
    "$PY" tests/tokenizer/hf_tokenizers_ref.py bench --tokenizer "$tok" --threads 2 --batch --reps 3 "$WORK"/kjv8/*.txt
  done
done
