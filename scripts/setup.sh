#!/usr/bin/env bash
# Installs every Debian package meshtrain needs (idempotent) and builds it.
# Usage: scripts/setup.sh [build-dir]   (default: build)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${1:-build}

# Why each one is here: docs/setup.md. Check a change with scripts/check_fresh_machine.sh.
PACKAGES=(
  build-essential cmake ninja-build pkg-config git
  libdnnl-dev ocl-icd-opencl-dev libopenmpi-dev openmpi-bin
  libtomlplusplus-dev nlohmann-json3-dev libxxhash-dev libcli11-dev libfmt-dev libpcre2-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  python3-torch python3-numpy libopenblas0-openmp
  python3-pip ca-certificates
  bible-kjv bc
  iproute2 munge slurmctld slurmd slurm-client
  chromium fonts-dejavu-core
  clang-14 libclang-rt-14-dev libomp-14-dev
)
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
# One dpkg-query for all of them: this runs on every test and main-job run.
installed=$(dpkg-query -W -f='${Package} ${Status}\n' "${PACKAGES[@]}" 2>/dev/null \
  | awk '$NF == "installed" && $(NF-1) == "ok" { print $1 }' || true)
missing=()
for p in "${PACKAGES[@]}"; do
  grep -qxF "$p" <<<"$installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# tiktoken (the tokenizer tests' reference) from PyPI, for the PATH python3 that runs
# tests/tokenizer/tiktoken_ref.py. On a fresh Debian machine that is /usr/bin/python3 (which
# also runs the torch references), where pip needs --break-system-packages; on a developer's
# machine it may be a pyenv or venv python with its own pip.
if ! python3 -c "import tiktoken" 2>/dev/null; then
  if [ "$(command -v python3)" = /usr/bin/python3 ]; then
    $SUDO python3 -m pip install -q --break-system-packages tiktoken
  else
    python3 -m pip install -q tiktoken
  fi
fi
# GPT-2 BPE ranks (from PyPI's openai-whisper source distribution), verified by SHA-256.
bash scripts/get_gpt2_ranks.sh

cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$BUILD_DIR" -j "$(nproc)"
