#!/usr/bin/env bash
# Tokenizer throughput on the King James Bible, in one run:
#   1. meshtrain's GPT-2 encoder vs PyPI tiktoken, both single-threaded,
#      alternating A B A B (each number: best of 3 passes over all 66 books);
#   2. `prepare` (GPT-2, 5% validation) on 1 vs 2 threads, alternating, over
#      the KJV eight times (528 documents, 33 MB, as links to the books), and a
#      check that both wrote the same shards.
# Usage: bench/bench_tokenizer.sh [build-dir] [rounds]   (defaults: build 2)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
ROUNDS=${2:-2}
BIN=$BUILD/bench/bench_tokenizer
RANKS=${MESHTRAIN_GPT2_RANKS:-data/gpt2.tiktoken}
PY=${PYTHON:-$(bash scripts/py_venv.sh "$BUILD/py-venv")}  # tiktoken: the project's venv
WORK=$BUILD/bench_tokenizer
[ -x "$BIN" ] || { echo "bench_tokenizer: build it first: cmake --build $BUILD --target bench_tokenizer" >&2; exit 1; }
bash scripts/get_gpt2_ranks.sh "$RANKS" >/dev/null
[ -d "$WORK/kjv" ] || bash scripts/kjv_text.sh "$WORK/kjv" >/dev/null
files=("$WORK"/kjv/*.txt)

echo "== encode, one thread, KJV ($(cat "${files[@]}" | wc -c) bytes, ${#files[@]} books), $(nproc) cores, load $(cut -d' ' -f1 /proc/loadavg)"
for _ in $(seq "$ROUNDS"); do
  "$BIN" speed gpt2 "$RANKS" 3 "${files[@]}"
  RAYON_NUM_THREADS=1 "$PY" tests/tokenizer/tiktoken_ref.py bench --ranks "$RANKS" --reps 3 "${files[@]}"
done

mkdir -p "$WORK/kjv8"
for copy in 1 2 3 4 5 6 7 8; do
  for f in "${files[@]}"; do ln -sf "$(realpath "$f")" "$WORK/kjv8/${copy}_$(basename "$f")"; done
done
echo "== prepare, KJV x8 ($(cat "$WORK"/kjv8/*.txt | wc -c) bytes; time includes loading the ranks and writing shards)"
for _ in $(seq "$ROUNDS"); do
  for t in 1 2; do "$BIN" prepare gpt2 "$RANKS" "$t" "$WORK/prepare_t$t" "$WORK/kjv8"; done
done
for f in "$WORK"/prepare_t1/*.bin; do
  cmp -s "$f" "$WORK/prepare_t2/$(basename "$f")" || { echo "prepare: $(basename "$f") differs between 1 and 2 threads" >&2; exit 1; }
done
echo "prepare: 1- and 2-thread shards identical"
