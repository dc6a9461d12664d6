#!/usr/bin/env bash
# Installs every Debian package meshtrain needs (idempotent) and builds it.
# Usage: scripts/setup.sh [build-dir]   (default: build)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${1:-build}

PACKAGES=(
  build-essential cmake ninja-build pkg-config git
  libdnnl-dev libopenmpi-dev openmpi-bin
  libtomlplusplus-dev nlohmann-json3-dev libcli11-dev libfmt-dev libpcre2-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  python3-torch python3-numpy libopenblas0-openmp
  bible-kjv
)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$BUILD_DIR" -j "$(nproc)"
