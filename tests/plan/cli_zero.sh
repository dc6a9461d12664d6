#!/usr/bin/env bash
# ZeRO model states through the CLI (Rajbhandari et al. 2020, table 1 / section 5):
# with --tp 1 --pp 1 --dp N --zero k fixed, params + grads + optimizer per GPU
# are 2+2+12 bytes x Psi sharded as the paper's formulas say, for every stage
# and N. Also: --zero 3 alone means full sharding, --shard dp and --shard N = dp
# are accepted as full sharding, --shard g < dp is hybrid.
# usage: cli_zero.sh MESHTRAIN_BINARY
set -euo pipefail
bin=$1
python=/usr/bin/python3
fail() { echo "FAIL: $*"; exit 1; }
plan() {
  "$bin" plan --model llama3-8b --seq 2048 --global-batch 1024 --hbm-gib 100000 --tp 1 --pp 1 \
         --micro-batch 1 --ckpt-every-min 0 --json --top 1 "$@"
}
for n in 1 4 16 64 256 1024; do
  for zero in 0 1 2 3; do
    [ "$n" -eq 1 ] && [ "$zero" -gt 0 ] && continue
    json=$(plan --gpus "$n" --dp "$n" --zero "$zero")
    "$python" - "$json" "$n" "$zero" <<'PY' || fail "zero $zero dp $n"
import json, sys
j, n, zero = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
psi = j["model"]["params"]
want = {0: 2 * psi + 2 * psi + 12 * psi,
        1: 2 * psi + 2 * psi + 12 * psi / n,
        2: 2 * psi + (2 + 12) * psi / n,
        3: (2 + 2 + 12) * psi / n}[zero]
r = j["ranked"][0]
m = r["memory_bytes"]
got = m["params"] + m["grads"] + m["optimizer"]
assert r["layout"]["zero"] == zero and r["layout"]["dp"] == n, r["layout"]
assert r["layout"]["zero_shard_group"] == n, r["layout"]  # --zero 3 alone: full sharding
assert abs(got - want) <= 1e-9 * want, (zero, n, got, want)
print(f"zero {zero} dp {n:5d}: {got / 1e9:8.2f} GB = formula {want / 1e9:8.2f} GB")
PY
  done
done
for shard in dp 64; do
  json=$(plan --gpus 64 --dp 64 --zero 3 --shard "$shard")
  "$python" - "$json" <<'PY' || fail "--shard $shard"
import json, sys
r = json.loads(sys.argv[1])["ranked"][0]
assert r["layout"]["zero_shard_group"] == 64, r["layout"]
PY
done
json=$(plan --gpus 64 --dp 64 --zero 3 --shard 8)
"$python" - "$json" <<'PY' || fail "--shard 8 is hybrid"
import json, sys
r = json.loads(sys.argv[1])["ranked"][0]
psi = json.loads(sys.argv[1])["model"]["params"]
assert r["layout"]["zero_shard_group"] == 8, r["layout"]
m = r["memory_bytes"]
assert abs(m["params"] + m["grads"] + m["optimizer"] - 16 * psi / 8) < 1e-6 * psi
PY
echo PASS
