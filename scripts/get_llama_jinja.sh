#!/usr/bin/env bash
# Fetches llama.cpp's C++ Jinja engine (common/jinja/, MIT) and the real chat templates it ships
# (models/templates/*.jinja) from PyPI's llama-cpp-python source distribution, pinned by
# SHA-256, into third_party/llama-jinja/ (git-ignored). meshtrain renders chat templates with it
# (src/meshtrain/data/chat_template.h; why this engine: docs/tokenizers.md#chat-templates).
# Idempotent: skips when the folder holds the pinned version. pip is the project's venv's
# (scripts/py_venv.sh). Usage: scripts/get_llama_jinja.sh [out-dir]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-third_party/llama-jinja}
VERSION=0.3.36
SHA=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
STAMP="llama-cpp-python $VERSION $SHA"

if [ "$(cat "$OUT/VERSION" 2>/dev/null)" = "$STAMP" ]; then
  echo "get_llama_jinja: $OUT present"
  exit 0
fi

PY=$(bash scripts/py_venv.sh)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$tmp" >&2
sdist="$tmp/llama_cpp_python-$VERSION.tar.gz"
[ -f "$sdist" ] || { echo "get_llama_jinja: no llama-cpp-python $VERSION sdist downloaded" >&2; exit 1; }
[ "$(sha256sum "$sdist" | cut -d' ' -f1)" = "$SHA" ] \
  || { echo "get_llama_jinja: $sdist has the wrong SHA-256 (expected $SHA)" >&2; exit 1; }
root=llama_cpp_python-$VERSION/vendor/llama.cpp
tar -xzf "$sdist" -C "$tmp" --wildcards "$root/LICENSE" "$root/common/jinja/*" \
  "$root/common/json.h" "$root/common/json.cpp" "$root/common/unicode.h" "$root/common/unicode.cpp" \
  "$root/models/templates/*.jinja"
echo "$STAMP" >"$tmp/$root/VERSION"
# Through a unique name beside the target, so concurrent runs never see half a folder.
mkdir -p "$(dirname "$OUT")"
rm -rf "$OUT.tmp.$$" && mv "$tmp/$root" "$OUT.tmp.$$"
rm -rf "$OUT" && mv "$OUT.tmp.$$" "$OUT"
echo "get_llama_jinja: wrote $OUT"
