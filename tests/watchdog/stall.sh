#!/usr/bin/env bash
# A rank stalls (SIGSTOP) or dies (SIGKILL) in the middle of a multi-rank
# training run; the job must end, every rank of it, within comm.timeout_s + 10 s.
#   stop: the watchdog's line names the collective, its seq and the stopped
#         rank, the exit code is timeout's (7), and `meshtrain debug hang` on
#         the dumps finds the same call and rank.
#   kill: MPI itself notices the dead rank (no deadline needed); measured.
# No process of the run may be left behind (pgrep on its out_dir).
# usage: stall.sh MPIRUN_PREFIX... -- MESHTRAIN WORK_DIR NP MODE SIGNAL [VICTIM]
#   MODE: ddp | zero3 | pipeline | moe_ep (a mixture of experts at ep = NP: the
#   stopped rank leaves its peers in an expert all-to-all or a dp collective);
#   SIGNAL: stop | kill; VICTIM: world rank (default NP-1)
set -uo pipefail
mpirun=()
while [[ $1 != "--" ]]; do mpirun+=("$1"); shift; done
shift
bin=$1 work=$2 np=$3 mode=$4 signal=$5 victim=${6:-$(($3 - 1))}
fail() { echo "FAIL: $*"; exit 1; }
timeout_s=${WATCHDOG_TIMEOUT_S:-2}
out=$work/stall_${mode}_np${np}_${signal}
rm -rf "$out" "$out.log"
args=(train --config "$work/good.toml" --train.steps 100000 --train.checkpoint_interval -1
      --train.eval_interval 0 --train.log_interval 1000 --train.threads 1 --train.batch_size 8
      --train.micro_batch_size 2 --train.seq_len 32 --train.out_dir "$out"
      --comm.timeout_s "$timeout_s" --comm.long_timeout_s 60)
case $mode in
  ddp) ;;
  zero3) args+=(--parallel.zero 3) ;;
  pipeline) args+=(--parallel.pp 2 --parallel.schedule 1f1b) ;;
  moe_ep) args+=(--moe.experts 4 --moe.top_k 2 --moe.hidden_dim 32 --parallel.ep "$np") ;;
  *) fail "unknown mode $mode" ;;
esac

"${mpirun[@]}" "$np" "$bin" "${args[@]}" >"$out.log" 2>&1 &
launcher=$!
cleanup() {
  local left
  left=$(pgrep -f -- "--train.out_dir $out" || true)
  [[ -n $left ]] && kill -9 $left 2>/dev/null
  kill -9 "$launcher" 2>/dev/null
}
trap cleanup EXIT
trap 'exit 1' TERM INT  # ctest's timeout: the EXIT trap still removes the run's processes

# Past the first step (which has the long deadline): a few steps in rank 0's metrics.
steps_done() { local n; n=$(grep -c '"loss"' "$out/metrics.jsonl" 2>/dev/null); echo "${n:-0}"; }
for _ in $(seq 600); do
  [[ $(steps_done) -ge 3 ]] && break
  kill -0 "$launcher" 2>/dev/null || { cat "$out.log"; fail "the run ended before the fault"; }
  sleep 0.1
done
[[ $(steps_done) -ge 3 ]] || { cat "$out.log"; fail "no steps after 60 s"; }

# The victim: the run's process whose environment says it is world rank $victim.
pid=""
for p in $(pgrep -f -- "--train.out_dir $out"); do
  [[ $p == "$launcher" ]] && continue
  if tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$victim"; then
    pid=$p
  fi
done
[[ -n $pid ]] || fail "rank $victim's process not found"
start=$(date +%s%N)
if [[ $signal == stop ]]; then kill -STOP "$pid"; else kill -KILL "$pid"; fi
wait "$launcher"
rc=$?
elapsed_ms=$((($(date +%s%N) - start) / 1000000))
trap - EXIT
cat "$out.log"
echo "exit $rc ${elapsed_ms} ms after SIG${signal^^} of rank $victim (pid $pid)"

sleep 0.5
left=$(pgrep -f -- "--train.out_dir $out" || true)
if [[ -n $left ]]; then
  ps -o pid,stat,args -p $left
  kill -9 $left 2>/dev/null
  fail "processes left behind: $left"
fi
[[ $rc -ne 0 ]] || fail "exit code 0 after a fault"
limit_ms=$(((timeout_s + 10) * 1000))
((elapsed_ms <= limit_ms)) || fail "took ${elapsed_ms} ms, more than timeout_s + 10 s"
echo "DETECT $mode np$np $signal ${elapsed_ms} ms"
[[ $signal == kill ]] && exit 0

# The watchdog's lines (each timed-out rank reports its own call): the call,
# its sequence number and the stopped rank.
re="^rank [0-9]+: timeout: comm ([a-z]+) ([a-z_]+) seq ([0-9]+) \(.*\) not finished after .* s \(comm.timeout_s = $timeout_s\); ranks not arrived: (.*, )?$victim \((no flight record|stalled)"
grep -qE -- "$re" "$out.log" || fail "no timeout line naming rank $victim"
[[ $rc -eq 7 ]] || fail "exit code $rc, expected timeout's 7"

report=$("$bin" debug hang "$out") || fail "debug hang failed"
echo "$report"
grep -qE "^diagnosis: .*waiting for rank\(s\) $victim$" <<<"$report" ||
  fail "debug hang does not name rank $victim"
# The stopped rank may dump when mpirun's SIGCONT (before its SIGKILL) wakes it: then as late.
if ls "$out"/flight/*/rank_${victim}.json >/dev/null 2>&1; then
  grep -qE "late: (.*,)?$victim(,|\)|$)" <<<"$report" || fail "rank $victim's dump is not marked late"
fi
# debug hang finds the call a rank's watchdog named: as the first disagreement,
# or as the call of ranks ahead of it (a collective the victim was stopped
# inside can complete on some ranks, which then time out in the next one).
agreed=""
while IFS= read -r line; do
  [[ $line =~ $re ]] || continue
  comm=${BASH_REMATCH[1]} op=${BASH_REMATCH[2]} seq=${BASH_REMATCH[3]}
  if grep -qE "^comm $comm \[.*\]: (ranks disagree at seq $seq \($op |.*; ahead: .*\(at seq $seq\))" <<<"$report"; then
    agreed="comm $comm $op seq $seq"
  fi
done < <(grep -E -- "$re" "$out.log")
[[ -n $agreed ]] || fail "debug hang finds none of the calls the watchdog named"
echo "watchdog and debug hang agree: $agreed, rank $victim"
