#!/usr/bin/env bash
# Writes the King James Bible (Debian's bible-kjv) as plain text, one document
# per book, verse references stripped: OUT_DIR/NN_Book.txt (default data/kjv/text).
set -euo pipefail
OUT_DIR=${1:-data/kjv/text}
command -v bible >/dev/null || { echo "kjv_text: 'bible' not found; run scripts/setup.sh" >&2; exit 1; }
mkdir -p "$OUT_DIR"
rm -f "$OUT_DIR"/*.txt
bible -f "Gen1:1-Rev22:21" | awk -v dir="$OUT_DIR" '
  {
    ref = $1
    book = ref; sub(/[0-9]+:[0-9]+$/, "", book)
    if (book != current) { n++; current = book; file = sprintf("%s/%02d_%s.txt", dir, n, book) }
    sub(/^[^ ]+ /, "")
    print > file
  }'
echo "kjv_text: wrote $(ls "$OUT_DIR" | wc -l) books to $OUT_DIR"
