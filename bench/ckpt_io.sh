#!/usr/bin/env bash
# Distributed checkpoint I/O next to the disk's own sequential write speed,
# in one run (docs/benchmarks.md, "Distributed checkpoints"):
#   - dd of 1 GiB with oflag=direct and with conv=fsync (buffered, then fsync:
#     what the checkpoint writer does);
#   - llama-60M on 1 rank (sync and async save) and on dp 2 (sync), each
#     printing write throughput, the training stall per save in steps, the
#     peak memory above the resident state during the save;
#   - load = reshard: the dp 2 checkpoint loaded on 1 rank and on tp 2 x pp 2;
#   - a ~530M-parameter Llama on 1 rank (6.4 GB of checkpoint), sync and async.
# usage: bench/ckpt_io.sh [BIG=0 to skip the 530M model]
set -euo pipefail
source "$(dirname "$0")/common.sh"
BENCH=${BENCH_CKPT:-build/bench/bench_ckpt}
echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; disk: $(df -h "$work" | tail -1 | awk '{print $1, $2}')"

dd_rate() {  # dd_rate FLAGS...: GB/s of writing 1 GiB
  local out
  out=$(dd if=/dev/zero of="$work/dd.bin" bs=4M count=256 "$@" 2>&1 | tail -1)
  rm -f "$work/dd.bin"
  awk '{for (i = 1; i <= NF; ++i) if ($i == "s,") s = $(i - 1)} END {printf "%.3f", 1.073741824 / s}' <<<"$out"
}
echo "{\"disk\": \"dd 1 GiB\", \"direct_gb_per_s\": $(dd_rate oflag=direct), \"fsync_gb_per_s\": $(dd_rate conv=fsync)}"

random_tokens 2000000
write_run_config <<'TOML'
steps = 100
batch_size = 2
micro_batch_size = 2
[ckpt]
buffer_mb = 64
TOML
run() {  # run RANKS OUT_DIR [bench args...]
  local ranks=$1 out=$2; shift 2
  "${MPIRUN[@]}" -np "$ranks" "$BENCH" --config "$work/run.toml" --set "train.out_dir=$work/$out" "$@" |
    sed "s/^{/{\"case\": \"$out\", /"
}
run 1 r1_sync
run 1 r1_async --set ckpt.async=true
run 2 dp2_sync
run 1 dp2_to_single --resume "$work/dp2_sync/step_2"
run 4 dp2_to_tp2pp2 --resume "$work/dp2_sync/step_2" --set parallel.tp=2 --set parallel.pp=2
rm -rf "$work"/r1_* "$work"/dp2_*

if [ "${BIG:-1}" = 1 ]; then
  # dim 1536, 16 layers, GPT-2 vocabulary: 530M parameters, 8.5 GB of fp32
  # weights + gradients + AdamW state.
  cat >"$work/big.toml" <<TOML
[model]
family = "llama"
dim = 1536
n_layers = 16
n_heads = 12
n_kv_heads = 12
hidden_dim = 4096
vocab_size = 50257
max_seq_len = 64
tie_embeddings = true
[train]
seq_len = 64
batch_size = 1
threads = 2
steps = 100
eval_interval = 0
peak_flops = 1e11
checkpoint_interval = -1
[ckpt]
buffer_mb = 64
[data]
train = "$work/train.bin"
TOML
  for mode in false true; do
    "${MPIRUN[@]}" -x OMP_NUM_THREADS=2 -np 1 "$BENCH" --config "$work/big.toml" --steps 1 \
      --set "train.out_dir=$work/big_$mode" --set "ckpt.async=$mode" | sed "s/^{/{\"case\": \"530M\", /"
    rm -rf "$work/big_$mode"
  done
fi
