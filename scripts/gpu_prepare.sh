#!/usr/bin/env bash
# Run on a CPU machine set up by scripts/setup.sh and built, before
# scripts/gpu_check.sh is sent to a GPU machine: copies the header-only
# libraries the backend-only build takes (fmt, CLI11, from Debian's packages
# here; the cuDNN frontend from third_party/) to build/gpu-vendor, and packs
# the engine's bundle for the training runs (scripts/gpu_bundle.sh:
# build/gpu-bundle.tar.xz). The device tool carries both ignored paths
# (docs/gpu.md).
set -euo pipefail
cd "$(dirname "$0")/.."
vendor=build/gpu-vendor
rm -rf "$vendor"
mkdir -p "$vendor"
cp -r /usr/include/fmt /usr/include/CLI "$vendor/"
# The cuDNN frontend's headers (scripts/get_cudnn_frontend.sh fetched them here).
mkdir -p "$vendor/cudnn-frontend"
cp -r third_party/cudnn-frontend/include "$vendor/cudnn-frontend/"
du -sh "$vendor"
bash scripts/gpu_bundle.sh
