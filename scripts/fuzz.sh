#!/usr/bin/env bash
# Runs the libFuzzer harnesses (fuzz/, docs/fuzzing.md), one after another on
# one core: `scripts/fuzz.sh SECONDS [HARNESS...]` (default: every harness).
# Builds build-fuzz/ first (clang 14, every library with ASan + UBSan and the
# fuzzer's coverage hooks). New corpus inputs go to build-fuzz/corpus/<harness>/
# (the committed seeds in fuzz/corpus/ are only read); a crash, leak, timeout,
# out-of-memory or sanitizer report leaves its input in
# build-fuzz/findings/<harness>/. Prints per harness: executions per second,
# edges covered (cov), CPU-seconds and findings; exits 1 when any was found.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ] || ! [[ $1 =~ ^[0-9]+$ ]]; then
  echo "usage: scripts/fuzz.sh SECONDS [HARNESS...]" >&2
  exit 2
fi
seconds=$1
shift
all=$(sed -n 's/^meshtrain_fuzz(\([a-z0-9_]*\) .*/\1/p' fuzz/CMakeLists.txt)
harnesses=("$@")
[ ${#harnesses[@]} -gt 0 ] || read -r -a harnesses <<<"$(echo $all)"
for h in "${harnesses[@]}"; do
  grep -qxF "$h" <<<"$all" || { echo "fuzz.sh: unknown harness '$h' (known: $(echo $all))" >&2; exit 2; }
done

build=build-fuzz
if [ ! -f $build/build.ninja ]; then
  launcher=()
  command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  cmake -S . -B $build -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER=clang++-14 \
    -DMESHTRAIN_FUZZ=ON "${launcher[@]}" >/dev/null
fi
ninja -C $build "${harnesses[@]/#/fuzz_}" >/dev/null

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
# A reader must reject a length field its file cannot back before allocating
# it: inputs are a few KiB, so an allocation past 256 MiB is a finding.
flags=(-max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=256
       -print_final_stats=1)
printf '%-18s %10s %8s %10s %9s\n' harness execs/s cov cpu_s findings
status=0
for h in "${harnesses[@]}"; do
  corpus=$build/corpus/$h findings=$build/findings/$h log=$build/logs/$h.log
  mkdir -p "$corpus" "$findings" "$(dirname "$log")"
  inputs=(fuzz/corpus/$h)
  [ -d fuzz/regressions/$h ] && inputs+=(fuzz/regressions/$h)
  # The harness's scratch files, removed even when it crashed.
  scratch=$(mktemp -d "$( [ -d /dev/shm ] && echo /dev/shm || echo /tmp )/meshtrain_fuzz.XXXXXX")
  TIMEFORMAT='%U %S'
  cpu=$( { time MESHTRAIN_FUZZ_SCRATCH=$scratch "./$build/fuzz/fuzz_$h" "${flags[@]}" \
             -artifact_prefix="$findings/" "$corpus" "${inputs[@]}" >"$log" 2>&1 || true; } 2>&1 )
  rm -rf "$scratch"
  cpu_s=$(awk '{printf "%.0f", $1 + $2}' <<<"$cpu")
  execs=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | cut -d' ' -f2)
  # Counted from the log, not the folder: the same input found again keeps its name, and a
  # finding that exhausts file descriptors cannot write its input at all.
  found=$(grep -c '^SUMMARY: ' "$log" || true)
  [ "$found" -eq 0 ] || status=1
  printf '%-18s %10s %8s %10s %9s\n' "$h" "${execs:-?}" "${cov:-?}" "$cpu_s" "$found"
done
[ $status -eq 0 ] || echo "fuzz.sh: findings in $build/findings/ (logs in $build/logs/)" >&2
exit $status
