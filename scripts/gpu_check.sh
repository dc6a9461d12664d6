#!/usr/bin/env bash
# The checks that need an NVIDIA GPU, as one command for a lent machine (one
# H100 / H200, 16 cores, nvcc + CMake + ninja + PyTorch wheels, no Open MPI,
# no oneDNN, no package registry): docs/gpu.md. Within 8 minutes it
#   1. prints the GPU, driver, toolkit and library versions;
#   2. builds the ops layer alone (MESHTRAIN_BACKEND_ONLY: meshtrain-ops, the
#      CUDA backend for sm_90) with fmt / CLI11 headers carried in
#      build/gpu-vendor (scripts/gpu_prepare.sh makes it on a CPU machine);
#   3. runs `ops test --backend cuda` (every op vs float64, every dtype the suite has);
#   4. runs `ops nccl`: the NCCL communicator on one rank, every call checked;
#   5. times GEMMs (bf16 4096^3 and 8192^3, the model's shapes) and attention;
#   6. with the engine's bundle carried (build/gpu-bundle.tar.xz, made by
#      scripts/gpu_bundle.sh: the binary, its libraries and loader, the data),
#      the 20-step training runs on CUDA against CPU and the GPT-2 124M step
#      (scripts/gpu_train_check.sh); SKIPPED, saying so, without it;
# and writes a summary table to OUT/summary.md whose last line is the verdict.
# usage: bash scripts/gpu_check.sh [OUT]      (OUT: $OUT, else build/gpu-check)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-build/gpu-check}}
mkdir -p "$out"
exec > >(tee "$out/gpu_check.log") 2>&1
summary=$out/summary.md
rows=()
row() { rows+=("| $1 | $2 | $3 |"); echo "-- $1: $2 ($3)"; }
section() { echo; echo "== $*"; }
started=$SECONDS

section "machine"
gpu=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)
echo "gpu: ${gpu:-none (nvidia-smi failed)}"
nvcc_version=$(nvcc --version 2>/dev/null | sed -n 's/.*release \([0-9.]*\).*/\1/p')
echo "nvcc: ${nvcc_version:-not found}; cmake: $(cmake --version 2>/dev/null | head -1); cores: $(nproc)"
python3 - <<'EOF' 2>/dev/null || echo "python: no torch"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version())
EOF
row "machine" "${gpu:-no GPU}" "nvcc ${nvcc_version:-none}"
if [[ -z $gpu ]]; then
  row "verdict" "SKIPPED" "no GPU on this machine"
  { echo "| check | result | detail |"; echo "|---|---|---|"; printf '%s\n' "${rows[@]}"; } > "$summary"
  echo "gpu_check: SKIPPED: no GPU"
  exit 0
fi

wheel() {  # a file under site-packages/nvidia
  python3 -c 'import glob, site, sys
for p in site.getsitepackages():
    for m in sorted(glob.glob(p + "/nvidia/" + sys.argv[1], recursive=True)): print(m)' "$1" 2>/dev/null | head -1
}
# cuBLASLt: the toolkit's, else the one PyTorch's wheels ship (backend/cuda/cublaslt.h).
lt=$(ls /usr/local/cuda/lib64/libcublasLt.so.* /usr/local/cuda/lib/libcublasLt.so.* 2>/dev/null | head -1)
if [[ -z $lt ]]; then
  lt=$(wheel '**/libcublasLt.so.*')
fi
[[ -n $lt ]] && export MESHTRAIN_CUBLASLT=$lt
echo "cuBLASLt: ${lt:-not found}"
# NCCL likewise (comm/nccl/nccl.h): its header for the build, its library for the run.
nccl_h=$(ls /usr/local/cuda/include/nccl.h 2>/dev/null || wheel 'nccl/include/nccl.h')
nccl_so=$(ls /usr/local/cuda/lib64/libnccl.so.2 /usr/local/cuda/lib/libnccl.so.2 2>/dev/null | head -1)
[[ -z $nccl_so ]] && nccl_so=$(wheel 'nccl/lib/libnccl.so.2')
[[ -n $nccl_so ]] && export MESHTRAIN_NCCL=$nccl_so
echo "NCCL: header ${nccl_h:-not found}, library ${nccl_so:-not found}"
# cuDNN for the fused attention (backend/cuda/sdpa): cudnn.h for the build (the frontend's
# headers are carried in build/gpu-vendor), libcudnn.so.9 and its engines' folder for the
# run, and the toolkit's CUDA runtime for the frontend's own calls.
cudnn_h=$(ls /usr/local/cuda/include/cudnn.h 2>/dev/null || wheel 'cudnn/include/cudnn.h')
cudnn_so=$(ls /usr/local/cuda/lib64/libcudnn.so.9 /usr/local/cuda/lib/libcudnn.so.9 2>/dev/null | head -1)
[[ -z $cudnn_so ]] && cudnn_so=$(wheel 'cudnn/lib/libcudnn.so.9')
if [[ -n $cudnn_so ]]; then
  export MESHTRAIN_CUDNN=$cudnn_so
  export LD_LIBRARY_PATH=$(dirname "$cudnn_so")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
cudart_so=$(ls /usr/local/cuda/lib64/libcudart.so.13 /usr/local/cuda/lib/libcudart.so.13 2>/dev/null | head -1)
[[ -n $cudart_so ]] && export CUDNN_FRONTEND_CUDART_LIB_NAME=$cudart_so
echo "cuDNN: header ${cudnn_h:-not found}, library ${cudnn_so:-not found}, runtime ${cudart_so:-not found}"

section "build (backend only)"
vendor=$PWD/build/gpu-vendor
build=build/gpu
if cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMESHTRAIN_BACKEND_ONLY=ON \
      -DMESHTRAIN_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DMESHTRAIN_NATIVE=OFF \
      -DMESHTRAIN_VENDOR_INCLUDE="$vendor" ${nccl_h:+-DMESHTRAIN_NCCL_INCLUDE="$(dirname "$nccl_h")"} \
      -DMESHTRAIN_CUDNN_FRONTEND="$vendor/cudnn-frontend/include" \
      ${cudnn_h:+-DMESHTRAIN_CUDNN_INCLUDE="$(dirname "$cudnn_h")"} \
      >"$out/configure.log" 2>&1 &&
   cmake --build "$build" -j "$(nproc)" --target meshtrain-ops >"$out/build.log" 2>&1; then
  row "build" "PASS" "meshtrain-ops with the CUDA backend, sm_90, $((SECONDS - started)) s"
else
  tail -30 "$out/configure.log" "$out/build.log"
  row "build" "FAIL" "see configure.log / build.log"
  { echo "| check | result | detail |"; echo "|---|---|---|"; printf '%s\n' "${rows[@]}"; } > "$summary"
  echo "gpu_check: FAIL: the build"
  exit 1
fi
ops=$build/meshtrain-ops

section "ops test --backend cuda"
"$ops" ops test --backend cuda > "$out/ops_test.txt" 2>&1
rc=$?
tail -60 "$out/ops_test.txt"
passed=$(grep -o 'cases passed' "$out/ops_test.txt" | wc -l)
failed_line=$(grep -E 'cases failed' "$out/ops_test.txt" | tail -1)
if (( rc == 0 )); then
  row "ops test --backend cuda" "PASS" "$(tail -1 "$out/ops_test.txt")"
else
  row "ops test --backend cuda" "FAIL" "${failed_line:-exit $rc} ($passed ops listed)"
fi

section "ops nccl (one rank)"
"$ops" ops nccl > "$out/nccl.txt" 2>&1
rc=$?
cat "$out/nccl.txt"
case $rc in
  0) row "NCCL, one rank" "PASS" "$(tail -1 "$out/nccl.txt")" ;;
  8) row "NCCL, one rank" "SKIPPED" "$(tail -1 "$out/nccl.txt")" ;;
  *) row "NCCL, one rank" "FAIL" "$(grep -m1 '^FAIL' "$out/nccl.txt" || tail -1 "$out/nccl.txt")" ;;
esac

section "timings"
perf() {  # label args...
  local label=$1; shift
  timeout 120 "$ops" ops perf --backend cuda --seconds 0.3 "$@" > "$out/perf_$label.txt" 2>&1
  cat "$out/perf_$label.txt"
}
perf gemm4096 --op '^matmul$' --batch 1 --seq 4096 --dim 4096 --hidden 4096 --heads 32 --kv-heads 32
perf gemm8192 --op '^matmul$' --batch 1 --seq 8192 --dim 8192 --hidden 8192 --heads 64 --kv-heads 64
rate() {  # file pattern -> the rate column of the first line matching
  grep -E "$2" "$1" | head -1 | awk '{for (i = 1; i <= NF; ++i) if ($i ~ /F\/s$/) print $(i - 1), $i}'
}
row "bf16 GEMM 4096^3" "$(rate "$out/perf_gemm4096.txt" 'proj .*bf16 fwd')" "ops perf, o-proj shape"
row "bf16 GEMM 8192^3" "$(rate "$out/perf_gemm8192.txt" 'proj .*bf16 fwd')" "goal >= 700 TFLOP/s on an H200"
# GPT-2 124M's shapes (batch 8 x 1024, dim 768) and Llama-3-8B's (4 x 2048, 4096 / 14336, GQA
# 32/8), over the ops this backend has (docs/gpu.md lists the rest).
implemented='^(matmul|grouped_matmul|(rms|layer)norm_.*|swiglu_.*|gelu_.*|attention_(forward|backward)|embedding_.*|fused_classifier|adamw_update|sum_squares)$'
perf gpt2 --op "$implemented" --batch 8 --seq 1024 --dim 768 --heads 12 --kv-heads 12 --hidden 3072 --vocab 50257
perf llama8b --op 'matmul|attention' --batch 4 --seq 2048 --dim 4096 --heads 32 --kv-heads 8 --hidden 14336 --vocab 128256
path="cuDNN SDPA unless refused below, bf16"
[[ -z $cudnn_h || -z $cudnn_so ]] && path="reference kernel (cuDNN not found), bf16"
row "attention fwd (GPT-2 shape)" "$(rate "$out/perf_gpt2.txt" '^attention_forward .*bf16')" "$path"
row "attention bwd (GPT-2 shape)" "$(rate "$out/perf_gpt2.txt" '^attention_backward .*bf16')" "$path"
# Every shape cuDNN refused went to the reference kernels, told once on stderr (cuda_backend.cpp).
refusals=$(cat "$out"/ops_test.txt "$out"/perf_*.txt | grep "cuDNN's fused attention refused")
row "cuDNN SDPA refusals" "$(grep -c . <<< "$refusals")" "$(head -1 <<< "$refusals" | cut -c1-160)"

section "training runs (the engine's bundle)"
while IFS='|' read -r tag check result detail; do
  [[ $tag == ROW ]] && row "$check" "$result" "$detail"
done < <(bash scripts/gpu_train_check.sh "$out" cpu cuda)

verdict=PASS
for r in "${rows[@]}"; do [[ $r == *"| FAIL |"* ]] && verdict=FAIL; done
row "verdict" "$verdict" "$((SECONDS - started)) s in all"
{
  echo "# gpu_check $(date -u +%Y-%m-%dT%H:%MZ) on ${gpu}"
  echo
  echo "| check | result | detail |"
  echo "|---|---|---|"
  printf '%s\n' "${rows[@]}"
  echo
  echo "gpu_check: $verdict"
} > "$summary"
echo
cat "$summary"
[[ $verdict == PASS ]]
