#!/usr/bin/env bash
# Installs every Debian package meshtrain needs (idempotent) and builds it.
# Usage: scripts/setup.sh [build-dir]   (default: build)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${1:-build}

PACKAGES=(
  build-essential cmake ninja-build pkg-config git
  libdnnl-dev ocl-icd-opencl-dev libopenmpi-dev openmpi-bin
  libtomlplusplus-dev nlohmann-json3-dev libxxhash-dev libcli11-dev libfmt-dev libpcre2-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  python3-torch python3-numpy libopenblas0-openmp
  bible-kjv
)
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# Test helpers from PyPI for the PATH python3 (not Debian's /usr/bin/python3, which runs torch).
if ! python3 -c "import tiktoken" 2>/dev/null; then
  if [ "$(command -v python3)" = /usr/bin/python3 ]; then  # Debian's own python: no pip by default
    python3 -m pip --version >/dev/null 2>&1 || $SUDO apt-get install -y -qq python3-pip >/dev/null
    python3 -m pip install -q --break-system-packages tiktoken
  else
    python3 -m pip install -q tiktoken
  fi
fi
# GPT-2 BPE ranks (from PyPI's openai-whisper source distribution), verified by SHA-256.
bash scripts/get_gpt2_ranks.sh

cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$BUILD_DIR" -j "$(nproc)"
