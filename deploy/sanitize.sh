#!/usr/bin/env bash
# Builds isthmus with a sanitizer and runs the unit and integration suites under it (CI
# runs both after deploy/check.sh). CUDA, the benchmarks and the Python module are left
# out: the first two have no CPU tests here, and a sanitized extension module would need
# the runtime preloaded into the interpreter.
#   deploy/sanitize.sh asan    AddressSanitizer + UndefinedBehaviorSanitizer (build-asan)
#   deploy/sanitize.sh tsan    ThreadSanitizer (build-tsan)
# Any report fails the test that triggered it. Suppressions: deploy/sanitizers/*.supp,
# each entry with the reason it is there.
# Environment: ISTHMUS_JOBS (default: nproc), ISTHMUS_SANITIZE_LABELS (default
# "unit|integration").
set -euo pipefail
cd "$(dirname "$0")/.."
kind="${1:-}"
case "$kind" in
  asan) option=ISTHMUS_ASAN ;;
  tsan) option=ISTHMUS_TSAN ;;
  -h|--help) sed -n 2,11p "$0"; exit 0 ;;
  *) echo "sanitize.sh: say asan or tsan (try --help)" >&2; exit 2 ;;
esac
build="build-$kind"
jobs="${ISTHMUS_JOBS:-$(getconf _NPROCESSORS_ONLN)}"
labels="${ISTHMUS_SANITIZE_LABELS:-unit|integration}"
supp="$PWD/deploy/sanitizers"

cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -D"$option"=ON \
  -DISTHMUS_CUDA=OFF -DISTHMUS_BUILD_BENCH=OFF -DISTHMUS_PYTHON=OFF
cmake --build "$build" -j"$jobs"
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
# halt_on_error: the first report ends the process with a failure, so no test passes
# over one. detect_leaks: LeakSanitizer too (ASan).
export ASAN_OPTIONS="halt_on_error=1:abort_on_error=0:detect_leaks=1:strict_string_checks=1:detect_stack_use_after_return=1:suppressions=$supp/asan.supp"
export LSAN_OPTIONS="suppressions=$supp/lsan.supp:print_suppressions=0"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:suppressions=$supp/ubsan.supp"
export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$supp/tsan.supp"
# Left out: WanWireBytes holds the WAN's bytes to 1.5x the payload, a limit set for the
# timing of an unsanitized build (a process several times slower sends more lone acks and
# keep-alives: 1.55x under TSan). The same two-site code runs sanitized in the
# SyncProcessTest and worker suites.
ctest --test-dir "$build" -L "$labels" -E '^WanWireBytes\.' --output-on-failure -j"$jobs" \
  --timeout 900
