#!/usr/bin/env bash
# Checks the sources' format (deploy/format.sh), builds isthmus and runs its test suite: the
# quick-start "test" command and what CI runs.
#   deploy/check.sh           unit + integration + gpu tests (the default suite; the gpu
#                             ones skip, each saying why, where no GPU is visible)
#   deploy/check.sh --long    also the long campaigns (crash loops, soak; label "long")
# Environment: ISTHMUS_BUILD_DIR (default build), ISTHMUS_JOBS (default: nproc).
set -euo pipefail
cd "$(dirname "$0")/.."
labels='unit|integration|gpu'
case "${1:-}" in
  --long) labels='unit|integration|gpu|long' ;;
  "") ;;
  -h|--help) sed -n 2,7p "$0"; exit 0 ;;
  *) echo "check.sh: unknown option '$1' (try --help)" >&2; exit 2 ;;
esac
build="${ISTHMUS_BUILD_DIR:-build}"
jobs="${ISTHMUS_JOBS:-$(getconf _NPROCESSORS_ONLN)}"

deploy/install-deps.sh
deploy/format.sh
# Line tables only (-g1): backtraces need no more, and the build takes a quarter less time
# than with full debug information. The test programs' own sources (not the numeric
# suites') at -O0: half their compile time (tests/CMakeLists.txt).
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DISTHMUS_TESTS_UNOPTIMIZED=ON \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO='-O2 -g1 -DNDEBUG' -DCMAKE_C_FLAGS_RELWITHDEBINFO='-O2 -g1 -DNDEBUG'
cmake --build "$build" -j"$jobs"
# One BLAS/OpenMP thread per test process, and no OpenMP spin-waiting: tests run side by
# side on few cores (see docs/BENCHMARKS.md on spin contention).
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
# A failure is summed up again at the end (deploy/ctest-failures.sh): CI keeps the tail.
ctest --test-dir "$build" -L "$labels" --output-on-failure -j"$jobs" --timeout 300 ||
  { deploy/ctest-failures.sh "$build"; exit 8; }
