#!/usr/bin/env bash
# Run on a CPU machine set up by scripts/setup.sh, before scripts/gpu_check.sh
# is sent to a GPU machine: copies the header-only libraries the backend-only
# build takes (fmt, CLI11, from Debian's packages here) to build/gpu-vendor,
# an ignored folder the device tool carries (docs/gpu.md).
set -euo pipefail
cd "$(dirname "$0")/.."
vendor=build/gpu-vendor
rm -rf "$vendor"
mkdir -p "$vendor"
cp -r /usr/include/fmt /usr/include/CLI "$vendor/"
du -sh "$vendor"
