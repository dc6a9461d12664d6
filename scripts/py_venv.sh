#!/usr/bin/env bash
# The project's Python venv for the test references that come from PyPI (tiktoken, for
# tests/tokenizer/tiktoken_ref.py; tokenizers and sentencepiece, for tests/tokenizer/hf_tokenizers_ref.py) and for scripts/get_gpt2_ranks.sh's `pip download`: made
# from Debian's /usr/bin/python3 (python3-venv), never touching the system Python. The PyTorch
# references keep using /usr/bin/python3 itself (python3-torch). Idempotent: quick when the
# venv already imports everything.
# Usage: scripts/py_venv.sh [venv-dir]   (default: build/py-venv); prints the venv's python.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-${MESHTRAIN_PY_VENV:-build/py-venv}}
PACKAGES=(tiktoken tokenizers sentencepiece)
IMPORTS="import tiktoken, tokenizers, sentencepiece"

if ! "$VENV/bin/python" -c "$IMPORTS" 2>/dev/null; then
  echo "py_venv: making $VENV (${PACKAGES[*]}) from /usr/bin/python3" >&2
  /usr/bin/python3 -m venv "$VENV" >&2
  "$VENV/bin/python" -m pip install -q "${PACKAGES[@]}" >&2
  "$VENV/bin/python" -c "$IMPORTS"
fi
echo "$VENV/bin/python"
