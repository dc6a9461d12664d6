#!/usr/bin/env bash
# Sets up (packages + build) and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh build  # every target
ctest --test-dir build --output-on-failure -j 2 --timeout 900
