#!/usr/bin/env bash
# `meshtrain plan` end to end. usage: cli_plan.sh MESHTRAIN_BINARY SOURCE_DIR
set -euo pipefail
bin=$1 src=$2
python=/usr/bin/python3
fail() { echo "FAIL: $*"; exit 1; }
done_means=(plan --model llama3-70b --gpus 1024 --gpu h100-sxm --seq 8192
            --global-batch-tokens 16M --tokens 15T)

out=$("$bin" "${done_means[@]}")
head -20 <<<"$out"  # not a pipe: head closing it early would SIGPIPE echo under pipefail
grep -q "^model    llama3-70b: 70.6B params" <<<"$out" || fail "model line"
grep -q "global batch 2,048 sequences = 16,777,216 tokens" <<<"$out" || fail "batch line"
rows=$(grep -cE "^ ?[0-9]+ +[0-9]+ +[0-9]+ +[0-9]+ +[0-9]+ +[0-9]+ +[0-3] " <<<"$out")
[ "$rows" -eq 10 ] || fail "expected 10 ranked rows, got $rows"
grep -q "^#1 memory on the" <<<"$out" || fail "memory breakdown of #1"
grep -qE "^  DP \(ZeRO-0/1/2\) +rejected: none of [0-9]+ fits" <<<"$out" || fail "rejected DP family"
grep -q "best overall" <<<"$out" || fail "the winning family"

json=$("$bin" "${done_means[@]}" --json --top 3)
"$python" - "$json" <<'PY' || fail "json"
import json, sys
j = json.loads(sys.argv[1])
assert len(j["ranked"]) == 3, j["ranked"]
r = j["ranked"][0]
for k in ["params", "grads", "optimizer", "activations", "workspace", "comm", "offloaded"]:
    assert k in r["memory_bytes"], k
assert r["memory_bytes"]["device_total"] <= j["cluster"]["hbm_bytes"]
assert r["layout"]["tp"] * r["layout"]["pp"] * r["layout"]["dp"] == 1024
assert abs(sum(v for k, v in r["time_seconds"].items() if k not in ("step", "dp_raw", "cp_raw"))
           - r["time_seconds"]["step"]) < 1e-9 * r["time_seconds"]["step"]
assert j["job"]["global_batch"] == 2048
assert r["layout"]["cp"] == 1
assert sum(r["pipeline"]["layers_per_chunk"]) == 80
assert len(r["pipeline"]["stage_seconds"]) == r["layout"]["pp"]
f = r["failures"]
assert 0 < f["goodput"] < 1 and f["wall_seconds"] > 0 and f["checkpoint_interval_seconds"] > 0
assert j["job"]["gemm_efficiency"] > 0
PY

long=$("$bin" plan --model llama3-405b --gpus 16384 --seq 131072 --global-batch-tokens 16M \
       --tp 8 --pp 16 --json --top 1)
"$python" - "$long" <<'PY' || fail "cp in the search and the json"
import json, sys
r = json.loads(sys.argv[1])["ranked"][0]
assert r["layout"]["cp"] > 1, r["layout"]
assert r["time_seconds"]["cp_raw"] > 0
PY

qlora=$("$bin" plan --model llama1-65b --gpus 1 --gpu a100-80gb --hbm-gib 44.7 --seq 512 \
        --global-batch 16 --tokens 100M --finetune qlora --lora-rank 64 --recompute full \
        --offload optimizer)
grep -q "fine-tune qlora rank 64 on all linears" <<<"$qlora" || fail "qlora job line"
grep -q "^#1 failures: MTBF" <<<"$qlora" || fail "failures line"

explain=$("$bin" "${done_means[@]}" --explain)
for want in "Model states (ZeRO" "Activations (Korthikanti" "pipeline = m x max(t)" "MFU (PaLM)" "Compute (roofline per op" \
            "TP: m "; do
  grep -qF "$want" <<<"$explain" || fail "--explain lacks '$want'"
done

cfg=$("$bin" plan --config "$src/configs/llama-tiny-bytes.toml")
grep -q "^predicted memory per rank for" <<<"$cfg" || fail "--config header"
grep -qE "^  activations .*\(exact\)" <<<"$cfg" || fail "--config activations"
# The run's [parallel] layout, every rank class, units that fit, JSON on request.
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
sed -e 's/^micro_batch_size = 32 .*/micro_batch_size = 8/' "$src/configs/llama-tiny-bytes.toml" >"$work/run.toml"
printf '\n[parallel]\ntp = 2\npp = 2\nzero = 3\nsequence_parallel = true\n' >>"$work/run.toml"
layout=$("$bin" plan --config "$work/run.toml" --dp 2)
head -12 <<<"$layout"
grep -q "8 ranks: dp 2 x tp 2 x pp 2, ZeRO-3, sequence parallel" <<<"$layout" || fail "--config layout line"
grep -qF "ranks 5,7 (pp stage 1 (layers 1, head), tp 1 of 2):" <<<"$layout" || fail "--config rank classes"
! grep -q "0.00 GiB" <<<"$layout" || fail "--config prints 0.00 GiB"
grep -qE "^  params +[0-9.]+ KiB  \(bound\)" <<<"$layout" || fail "--config ZeRO-3 params in KiB"
"$bin" plan --config "$work/run.toml" --dp 2 --json >"$work/plan.json"
$python - "$work/plan.json" <<'PY' || fail "--config --json"
import json, sys
plan = json.load(open(sys.argv[1]))
ranks = plan["ranks"]
assert len(ranks) == 8, len(ranks)
for r in ranks:
    for c in ("params", "grads", "optimizer", "activations", "workspace", "comm", "offloaded", "total"):
        assert isinstance(r["bytes"][c], int), (r["rank"], c)
    assert r["bytes"]["params"] > 0 and r["basis"]["activations"] == "exact"
# dp ranks alike, pipeline stages differ.
assert ranks[0]["bytes"] == ranks[2]["bytes"] and ranks[0]["bytes"] != ranks[4]["bytes"]
PY
# With --gpus too: one JSON object, the engine's ranks and the GPU search.
"$bin" plan --config "$work/run.toml" --dp 2 --json --gpus 8 --gpu a100-80gb >"$work/both.json" || true
$python -c "import json, sys; j = json.load(open(sys.argv[1])); assert len(j['engine']['ranks']) == 8 and 'search' in j" \
  "$work/both.json" || fail "--config --json --gpus"

many=$("$bin" plan --model llama3-8b --gpus 64..256 --global-batch-tokens 4M --seq 8192 \
       --rank-by cost --max-days 3000 --top 5)
grep -q "gpus" <<<"$many" || fail "a gpus column when several counts are compared"

# A dense model of a family: the recipe decides grouped-query heads and tying.
dense=(plan --layers 4 --hidden 256 --heads 8 --vocab 1000 --gpus 8 --global-batch 16)
llama=$("$bin" "${dense[@]}" --family llama --kv-heads 2)
grep -q "8 heads / 2 kv, .*untied output" <<<"$llama" || fail "--family llama --kv-heads 2"
if err=$("$bin" "${dense[@]}" --family gpt2 --kv-heads 2 2>&1); then fail "gpt2 with --kv-heads 2"; fi
grep -q "kv-heads needs a family with grouped-query attention (gpt2 has none)" <<<"$err" \
  || fail "the --kv-heads refusal: $err"
echo PASS
