#!/usr/bin/env bash
# A run inside a cgroup v1 memory limit it would exceed: `meshtrain train`
# refuses at start, naming the cgroup's limit, the bytes by category and the
# levers; with train.memory_check = "off" the same run is killed by the limit
# (what the check saves a user from). Skipped (77) without the rights to
# create a memory cgroup. usage: cgroup_limit.sh MESHTRAIN WORK_DIR
set -euo pipefail
bin=$1 work=$2
fail() { echo "FAIL: $*"; exit 1; }
cg=/sys/fs/cgroup/memory/meshtrain-test-$$
mkdir "$cg" 2>/dev/null || { echo "SKIP: cannot create $cg"; exit 77; }
trap 'rmdir "$cg" 2>/dev/null || true' EXIT
echo $((192 * 1024 * 1024)) >"$cg/memory.limit_in_bytes" 2>/dev/null || { echo "SKIP: cannot set a limit"; exit 77; }
echo 0 >"$cg/memory.swappiness" 2>/dev/null || true
out=$work/cgroup_$$
mkdir -p "$out"
# About 25M parameters: 400 MB of model state, twice the limit.
cat >"$out/big.toml" <<TOML
[model]
family = "llama"
dim = 512
n_layers = 8
n_heads = 8
n_kv_heads = 8
hidden_dim = 1376
vocab_size = 256
max_seq_len = 64
tie_embeddings = false
[train]
steps = 1
batch_size = 2
seq_len = 32
threads = 1
eval_interval = 0
peak_flops = 1e11
checkpoint_interval = -1
out_dir = "$out/run"
[data]
train = "$work/train.bin"
tokenizer = "bytes"
TOML
in_cgroup() { bash -c 'echo $$ >"$1/cgroup.procs"; shift; exec "$@"' _ "$cg" "$@"; }
set +e
start=$(date +%s.%N)
in_cgroup "$bin" train --config "$out/big.toml" >"$out/refused.out" 2>"$out/refused.err"
rc=$?
end=$(date +%s.%N)
set -e
cat "$out/refused.err"
[ "$rc" = 1 ] || fail "exit $rc, want 1"
grep -q "^meshtrain: memory check: rank 0 needs .* (params .* optimizer .*), more than the .* available by cgroup v1 $cg/memory.limit_in_bytes (limit 192.00 MiB" "$out/refused.err" || fail "no refusal naming the cgroup"
grep -q "levers: .*train.micro_batch_size = 1 would need\|levers: .*parallel.offload = \"disk\"" "$out/refused.err" || fail "no levers"
python3 -c "import sys; assert float(sys.argv[2]) - float(sys.argv[1]) < 10" "$start" "$end" || fail "slow refusal"
# The same run without the check: the limit kills it (or it fails to allocate).
set +e
in_cgroup "$bin" train --config "$out/big.toml" --train.memory_check off >"$out/off.out" 2>"$out/off.err"
rc=$?
set -e
echo "memory_check off: exit $rc"
[ "$rc" != 0 ] || fail "a run twice the cgroup limit succeeded"
! grep -q "memory check" "$out/off.err" || fail "memory_check off still checked"
rm -rf "$out"
echo PASS
