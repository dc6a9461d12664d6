#!/usr/bin/env bash
# Is PyPI's oneDNN 2026.1 (3.x) worth moving to from Debian's 2.6? Builds
# bench/onednn_gemms.cpp against each and runs them A B A B: the fused
# classifier's three GEMMs (the transposed-A dw among them, and dw with a
# transposed C) and a square GEMM, f32 and bf16.
# PyPI's `onednn` is a SYCL build with TBB threads: it needs Intel's SYCL,
# OpenCL-CPU and compiler runtimes (its pip dependencies, about 2 GB) and an
# OpenCL CPU device, which it finds through the venv's libintelocl.
# usage: bench/onednn_versions.sh [rounds=2] [threads=2]   (venv: build/onednn-venv)
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-2}; THREADS=${2:-2}
VENV=build/onednn-venv
if [ ! -f "$VENV/include/oneapi/dnnl/dnnl.hpp" ]; then
  /usr/bin/python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q onednn onednn-devel
fi
ocl=$(ls "$VENV"/lib/libintelocl.so.* | head -1)
g++ -O2 -std=c++20 bench/onednn_gemms.cpp -ldnnl -o build/onednn_gemms_debian
g++ -O2 -std=c++20 bench/onednn_gemms.cpp -I"$VENV/include" -L"$VENV/lib" -ldnnl \
  -Wl,-rpath,"$PWD/$VENV/lib" -o build/onednn_gemms_pypi
lscpu | grep "Model name"
for ((r = 1; r <= ROUNDS; r++)); do
  OMP_NUM_THREADS=$THREADS build/onednn_gemms_debian
  LD_LIBRARY_PATH=$VENV/lib OCL_ICD_FILENAMES=$ocl ONEAPI_DEVICE_SELECTOR=opencl:cpu \
    DNNL_VERBOSE=0 ONEDNN_VERBOSE=0 build/onednn_gemms_pypi
done
