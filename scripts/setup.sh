#!/usr/bin/env bash
# Installs every Debian package meshtrain needs (idempotent), makes the project's Python venv
# (build-dir/py-venv), fetches the GPT-2 ranks and builds the given targets (all without any).
# Usage: scripts/setup.sh [build-dir [target...]]   (default: build, every target)
#   e.g. scripts/setup.sh build meshtrain   (the main job: the binary only)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${1:-build}
TARGETS=("${@:2}")

# Why each one is here: docs/setup.md. Check a change with scripts/check_fresh_machine.sh.
PACKAGES=(
  build-essential cmake ninja-build pkg-config git
  libdnnl-dev ocl-icd-opencl-dev libopenmpi-dev openmpi-bin
  libtomlplusplus-dev nlohmann-json3-dev libxxhash-dev libcli11-dev libfmt-dev libpcre2-dev
  libutf8proc-dev libsentencepiece-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  python3-torch python3-numpy libopenblas0-openmp
  python3-venv ca-certificates
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

# The PyPI packages (tiktoken, the tokenizer tests' reference; pip for the ranks below) go into
# a venv under the build folder, made from Debian's /usr/bin/python3: the system Python is
# never changed.
export MESHTRAIN_PY_VENV=$BUILD_DIR/py-venv
bash scripts/py_venv.sh "$MESHTRAIN_PY_VENV" >/dev/null
# GPT-2 BPE ranks (from PyPI's openai-whisper source distribution), verified by SHA-256.
bash scripts/get_gpt2_ranks.sh
# llama.cpp's Jinja engine and the chat templates it ships (PyPI's llama-cpp-python sdist), pinned.
bash scripts/get_llama_jinja.sh
# The cuDNN frontend's headers (PyPI's nvidia-cudnn-frontend wheel), pinned; only where the CUDA
# toolkit is (the CUDA backend's attention graphs, docs/gpu.md).
bash scripts/get_cudnn_frontend.sh

cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
target_args=()
((${#TARGETS[@]})) && target_args=(--target "${TARGETS[@]}")
cmake --build "$BUILD_DIR" -j "$(nproc)" "${target_args[@]}"
