#!/usr/bin/env bash
# Fetches GPT-2's BPE merge ranks (tiktoken format) into data/gpt2.tiktoken:
# PyPI's openai-whisper source distribution carries them as
# whisper/assets/gpt2.tiktoken. Idempotent: skips when the file has the right hash.
# pip is the project's venv's (scripts/py_venv.sh; MESHTRAIN_PY_VENV picks which), as
# Debian's python has none. Usage: scripts/get_gpt2_ranks.sh [out-file]
# (default: data/gpt2.tiktoken)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-data/gpt2.tiktoken}
SHA=306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930

have_sha() { [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$SHA" ]; }
if have_sha "$OUT"; then
  echo "get_gpt2_ranks: $OUT present"
  exit 0
fi

PY=$(bash scripts/py_venv.sh)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m pip download -q --no-deps --no-binary :all: openai-whisper -d "$tmp" >&2
sdist=$(ls "$tmp"/openai[-_]whisper-*.tar.gz 2>/dev/null | head -n1)
[ -n "$sdist" ] || { echo "get_gpt2_ranks: no openai-whisper sdist downloaded" >&2; exit 1; }
member=$(tar -tzf "$sdist" | grep '/whisper/assets/gpt2.tiktoken$' | head -n1)
[ -n "$member" ] || { echo "get_gpt2_ranks: $sdist has no whisper/assets/gpt2.tiktoken" >&2; exit 1; }
tar -xzf "$sdist" -C "$tmp" "$member"
have_sha "$tmp/$member" || { echo "get_gpt2_ranks: $member has the wrong SHA-256 (expected $SHA)" >&2; exit 1; }
mkdir -p "$(dirname "$OUT")"
# Through a unique name in the target folder, so concurrent runs never see half a file.
mv "$tmp/$member" "$OUT.tmp.$$" && mv "$OUT.tmp.$$" "$OUT"
echo "get_gpt2_ranks: wrote $OUT"
