#!/usr/bin/env bash
# Fetches the cuDNN frontend's C++ headers (header-only, MIT) from PyPI's
# nvidia-cudnn-frontend wheel, pinned by version and SHA-256, into
# third_party/cudnn-frontend/ (git-ignored): the CUDA backend builds and
# validates its fused-attention (SDPA) graphs with them (docs/gpu.md). Only
# where the CUDA toolkit is (a build without it never reads them). Idempotent.
# Usage: scripts/get_cudnn_frontend.sh [out-dir]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-third_party/cudnn-frontend}
VERSION=1.32.0
WHEEL=nvidia_cudnn_frontend-$VERSION-cp311-cp311-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl
SHA=c6006556017a4d1c914c52a556c71b1267f2d6a0500f742e7b4edef539878df0
STAMP="nvidia-cudnn-frontend $VERSION $SHA"

if ! command -v nvcc >/dev/null && [ ! -x /usr/local/cuda/bin/nvcc ]; then
  echo "get_cudnn_frontend: no CUDA toolkit here, nothing to fetch"
  exit 0
fi
if [ "$(cat "$OUT/VERSION" 2>/dev/null)" = "$STAMP" ]; then
  echo "get_cudnn_frontend: $OUT present"
  exit 0
fi

PY=$(bash scripts/py_venv.sh)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m pip download -q --no-deps --only-binary :all: --python-version 3.11 \
  --platform manylinux_2_28_x86_64 "nvidia-cudnn-frontend==$VERSION" -d "$tmp" >&2
[ -f "$tmp/$WHEEL" ] || { echo "get_cudnn_frontend: no $WHEEL downloaded" >&2; exit 1; }
[ "$(sha256sum "$tmp/$WHEEL" | cut -d' ' -f1)" = "$SHA" ] \
  || { echo "get_cudnn_frontend: $WHEEL has the wrong SHA-256 (expected $SHA)" >&2; exit 1; }
"$PY" -m zipfile -e "$tmp/$WHEEL" "$tmp/wheel" >&2
mkdir -p "$tmp/out"
mv "$tmp/wheel/include" "$tmp/out/include"
cp "$tmp/wheel/"*.dist-info/licenses/* "$tmp/out/" 2>/dev/null || true
echo "$STAMP" >"$tmp/out/VERSION"
mkdir -p "$(dirname "$OUT")"
rm -rf "$OUT.tmp.$$" && mv "$tmp/out" "$OUT.tmp.$$"
rm -rf "$OUT" && mv "$OUT.tmp.$$" "$OUT"
echo "get_cudnn_frontend: wrote $OUT"
