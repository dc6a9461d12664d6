#!/usr/bin/env bash
# `meshtrain report` on real runs of the CLI tests' byte corpus: one rank (resumed once), and
# dp 2 x pp 2 on 4 ranks (checkpoints and validation inside the window). The
# report.json has every rank's memory, both stages' bubble, every rank's
# communication; the report.html passes the browser check (headless Chromium,
# network off) and the check fails on broken copies of it.
# usage: runs.sh MPIRUN_PREFIX... -- MESHTRAIN WORK_DIR
set -euo pipefail
source "$(dirname "$0")/../support/cli_common.sh" "$@"
here=$(cd "$(dirname "$0")" && pwd)
out=$work/report
rm -rf "$out"
mkdir -p "$out"
args=(train --config "$work/good.toml" --train.steps 6 --train.checkpoint_interval 3
      --train.eval_interval 3 --train.log_interval 1 --train.threads 1)
"$bin" "${args[@]}" --train.out_dir "$out/single" >"$out/single.log" 2>&1 || { cat "$out/single.log"; fail "single run"; }
# Resumed from step 3: steps 4-6 written twice; the report keeps the later records.
"$bin" "${args[@]}" --train.out_dir "$out/single" --resume "$out/single/step_3" >"$out/resumed.log" 2>&1 ||
  { cat "$out/resumed.log"; fail "resumed run"; }
"${mpirun[@]}" 4 "$bin" "${args[@]}" --parallel.pp 2 --train.out_dir "$out/dp2pp2" >"$out/dp2pp2.log" 2>&1 ||
  { cat "$out/dp2pp2.log"; fail "dp 2 x pp 2 run"; }
for run in single dp2pp2; do
  "$bin" report "$out/$run" || fail "report of $run"
done
# A report written elsewhere (--out) puts report.json beside it.
"$bin" report "$out/single" --out "$out/elsewhere.html" >/dev/null
[[ -s $out/elsewhere.html && -s $out/report.json ]] || fail "--out"
"$bin" report "$out/nothing" 2>"$out/nothing.err" && fail "a directory without metrics was reported"
grep -q "^meshtrain: report: '.*nothing' has no metrics.jsonl" "$out/nothing.err" || { cat "$out/nothing.err"; fail "error line"; }

python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
single = json.load(open(f"{out}/single/report.json"))
pp = json.load(open(f"{out}/dp2pp2/report.json"))
for s in (single, pp):
    assert s["steps"]["step"] == [1, 2, 3, 4, 5, 6], s["steps"]["step"]
    assert all(isinstance(x, float) for x in s["steps"]["loss"]), s["steps"]["loss"]
    assert s["validation"]["step"] == [3, 6], s["validation"]
    assert [c["step"] for c in s["checkpoints"]] == [3, 6] and all(c["bytes"] > 0 for c in s["checkpoints"])
    assert s["config"] and "[model]" in s["config"]
# The metrics' own numbers, unchanged: rank 0's losses.
rows = [json.loads(l) for l in open(f"{out}/dp2pp2/metrics.jsonl")]
assert pp["steps"]["loss"] == [r["loss"] for r in rows if "loss" in r]
assert [e["step"] for e in single["events"]["resume"]] == [3], single["events"]
rows = [json.loads(l) for l in open(f"{out}/single/metrics.jsonl")]
later = {r["step"]: r["loss"] for r in rows if "loss" in r}
assert sum("loss" in r for r in rows) == 9 and single["steps"]["loss"] == [later[s] for s in range(1, 7)]
assert single["pipeline"] is None and single["comm"] is None and single["ranks"] == 1
assert pp["ranks"] == 4 and pp["layout"]["describe"].startswith("dp 2 x tp 1 x pp 2")
# Both stages' bubble (measured > 0, theory (p - 1) / m = 1 at one micro-batch per rank).
stages = pp["pipeline"]["stages"]
assert [s["stage"] for s in stages] == [0, 1], stages
assert [s["ranks"] for s in stages] == [[0, 1], [2, 3]], stages
assert all(s["bubble"] > 0 and s["bubble_theory"] == 1.0 for s in stages), stages
# Every rank's memory, measured and predicted; each rank's measured peak equals its own metrics.
assert [m["rank"] for m in pp["memory"]] == [0, 1, 2, 3]
for m in pp["memory"]:
    name = "metrics.jsonl" if m["rank"] == 0 else f"metrics.rank{m['rank']}.jsonl"
    end = [json.loads(l) for l in open(f"{out}/dp2pp2/{name}") if '"memory"' in l][-1]
    assert m["measured_peak"]["total"] == end["bytes"]["total_peak"] > 0, (m, end["bytes"])
    assert m["predicted"]["total"] == end["predicted"]["total"] > 0
    assert m["measured_peak"]["params"] > 0 and m["predicted"]["params"] > 0
assert all(c["comm_ms"] > 0 for c in pp["comm"]), pp["comm"]
assert len(pp["step_time"]["ranks"]) == 4
print("report.json: both stages' bubble, every rank's memory and communication")
PY
grep -q 'id="plot-bubble"' "$out/dp2pp2/report.html" || fail "no bubble plot"
grep -q "not a pipeline run" "$out/single/report.html" || fail "single run: no 'not a pipeline run'"

# The browser: both pages, every plot present and non-empty, no console errors.
rc=0
python3 "$here/browser_check.py" "$out/single/report.html" "$out/single.png" \
  --expect-plots loss,lr,grad-norm,tokens-per-s,mfu,memory-rank0 || rc=$?
(( rc == 77 )) && exit 77
(( rc == 0 )) || fail "browser check of the single run"
python3 "$here/browser_check.py" "$out/dp2pp2/report.html" "$out/dp2pp2.png" \
  --expect-plots loss,lr,grad-norm,tokens-per-s,mfu,memory-rank0,memory-rank1,memory-rank2,memory-rank3,comm,bubble ||
  fail "browser check of the dp 2 x pp 2 run"
python3 "$here/browser_check.py" --self-test "$out/dp2pp2/report.html" || fail "the browser check cannot fail"
echo "report: PASS"
