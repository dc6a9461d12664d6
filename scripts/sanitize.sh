#!/usr/bin/env bash
# Builds the project under a sanitizer, in a folder of its own, and runs the tests under it.
#   scripts/sanitize.sh MODE [ctest args...]     (docs/setup.md#sanitizers)
# MODE: address   AddressSanitizer + LeakSanitizer + UBSan, whole suite -> build-asan/
#       undefined UndefinedBehaviorSanitizer alone, whole suite        -> build-ubsan/
#       thread    ThreadSanitizer, the tests labelled `threads`        -> build-tsan/
#       unit      AddressSanitizer + UBSan, the tests labelled `unit`  -> build-unit-san/
#                 (the single-process GoogleTest executables: the CI subset)
# A finding ends its process with a report and a non-zero status, so the test fails.
# ctest args after MODE narrow the run (-R, -E, -L ...); MESHTRAIN_JOBS sets the build's -j (2).
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-}
case $mode in
  address) sanitize=address,undefined dir=build-asan target=all label= ;;
  undefined) sanitize=undefined dir=build-ubsan target=all label= ;;
  thread) sanitize=thread dir=build-tsan target=tests_threads label=threads ;;
  unit) sanitize=address,undefined dir=build-unit-san target=tests_unit label=unit ;;
  *) echo "usage: scripts/sanitize.sh address|undefined|thread|unit [ctest args...]" >&2; exit 2 ;;
esac
shift

# Needs scripts/setup.sh's packages (run it once); builds nothing of the plain build/.
# -O1 keeps the tests' run time bearable; -g and frame pointers give whole stacks.
# Every executable gets scripts/sanitize/keep_loaded.c: libraries stay loaded, so reports name them.
mkdir -p "$dir"
cc -c -fPIC -O1 scripts/sanitize/keep_loaded.c -o "$dir/keep_loaded.o"
cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g -DNDEBUG" -DMESHTRAIN_SANITIZE="$sanitize" \
  -DCMAKE_EXE_LINKER_FLAGS="$PWD/$dir/keep_loaded.o -Wl,--export-dynamic-symbol=dlclose" >/dev/null
ninja -C "$dir" -j "${MESHTRAIN_JOBS:-2}" "$target"

supp=$PWD/scripts/sanitize
symbolizer=$(command -v llvm-symbolizer || command -v llvm-symbolizer-14 || true)  # else the runtime's own
common="halt_on_error=1:print_suppressions=0${symbolizer:+:external_symbolizer_path=$symbolizer}"
export ASAN_OPTIONS="$common:detect_leaks=1:detect_stack_use_after_return=1:strict_init_order=1:check_initialization_order=1"
export LSAN_OPTIONS="suppressions=$supp/lsan.supp:print_suppressions=0"
export UBSAN_OPTIONS="$common:print_stacktrace=1"
export TSAN_OPTIONS="$common:suppressions=$supp/tsan.supp:second_deadlock_stack=1"
# Open MPI unloads its plugins at MPI_Finalize; kept loaded, their frames in a report have names
# (keep_loaded.o does the same for the components it unloads at MPI_Init).
export OMPI_MCA_mca_base_component_disable_dlclose=1 PMIX_MCA_mca_base_component_disable_dlclose=1
if [[ $mode == thread ]]; then
  # libgomp is not built with ThreadSanitizer: its barriers are invisible to it, so every
  # OpenMP loop would be reported as a race. One OpenMP thread (CpuContext clamps its count to
  # the limit); the project's own threads (communication, prefetch, checkpoint writer,
  # watchdog, read-ahead, prepare's workers) all still run.
  export OMP_NUM_THREADS=1 OMP_THREAD_LIMIT=1
fi
ctest --test-dir "$dir" --output-on-failure -j 2 --timeout 1800 ${label:+-L "^$label\$"} "$@"
