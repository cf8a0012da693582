#!/usr/bin/env bash
# Builds isthmus with a sanitizer and runs the unit and integration suites under it (CI
# runs both after deploy/check.sh). CUDA, the benchmarks and the Python module are left
# out: the first two have no CPU tests here, and a sanitized extension module would need
# the runtime preloaded into the interpreter. Only the programs those suites run are built
# (not the gpu, long-campaign or seed-writing ones), at -O1 with line tables only (-g1):
# what the sanitizers' reports need, and about half the compile time of -O2 -g. The test
# programs' own sources, except the numeric suites', at -O0 (tests/CMakeLists.txt).
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
  -h|--help) sed -n 2,14p "$0"; exit 0 ;;
  *) echo "sanitize.sh: say asan or tsan (try --help)" >&2; exit 2 ;;
esac
build="build-$kind"
jobs="${ISTHMUS_JOBS:-$(getconf _NPROCESSORS_ONLN)}"
labels="${ISTHMUS_SANITIZE_LABELS:-unit|integration}"
supp="$PWD/deploy/sanitizers"

flags='-O1 -g1 -DNDEBUG'
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -D"$option"=ON \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="$flags" -DCMAKE_C_FLAGS_RELWITHDEBINFO="$flags" \
  -DISTHMUS_CUDA=OFF -DISTHMUS_BUILD_BENCH=OFF -DISTHMUS_PYTHON=OFF -DISTHMUS_TESTS_UNOPTIMIZED=ON
# Every program and library except those no test of these labels runs: the gpu tests and
# nccl_comm_test (label gpu), the nemesis campaign (label long) and fuzz_make_seeds. Under
# TSan also the test programs that run one thread (OMP_NUM_THREADS=1 below), so that
# ThreadSanitizer has nothing to check in them: the model, CUDA-emulator, kernel, data,
# tokenizer, translation-corpus and safetensors tests, its slowest suites; ASan runs them.
# Under ASan also sync_process_test (see "Left out" below).
# ctest lists a gtest program left unbuilt as "<name>_NOT_BUILT" without labels: not run.
# The targets are the build's named ones (ninja's phony names) less CMake's own.
skip='gpu_backend_test|gpu_training_test|gpu_worker_test|nccl_comm_test|nemesis_test|fuzz_make_seeds'
[[ "$kind" == asan ]] && skip="$skip|sync_process_test"
# streamed_push_test is left out of TSan: its pushes stream megabytes of parts back to back
# through libzmq, whose hand-over TSan cannot see (common/sanitizer.h), and the test
# process's own reports stall it; the same shard code runs under TSan in server_unit_test
# and in the worker overlap suites (parts of 256 bytes).
[[ "$kind" == tsan ]] &&
  skip="$skip|model_test|cuda_emu_test|isthmus_cuda_emu|ops_test|data_test|bpe_tokenizer_test|parallel_corpus_test|safetensors_test|streamed_push_test"
cmake_own='all|clean|help|install|package|package_source|test|edit_cache|rebuild_cache|list_install_components'
mapfile -t targets < <(ninja -C "$build" -t targets depth 1 | sed -n 's/^\([^/:.]*\): phony$/\1/p' |
  grep -v -x -E "$skip|$cmake_own")
cmake --build "$build" -j"$jobs" --target "${targets[@]}"
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
# halt_on_error: the first report ends the process with a failure, so no test passes
# over one. detect_leaks: LeakSanitizer too (ASan).
export ASAN_OPTIONS="halt_on_error=1:abort_on_error=0:detect_leaks=1:strict_string_checks=1:detect_stack_use_after_return=1:suppressions=$supp/asan.supp"
export LSAN_OPTIONS="suppressions=$supp/lsan.supp:print_suppressions=0"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:suppressions=$supp/ubsan.supp"
export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$supp/tsan.supp"
# Left out:
# - WanWireBytes holds the WAN's bytes to 1.5x the payload, a limit set for the timing of
#   an unsanitized build (a process several times slower sends more lone acks and
#   keep-alives: 1.55x under TSan). The same two-site code runs sanitized in the worker
#   suites (both sanitizers) and SyncProcessTest (TSan).
# - The packaging and unit-file tests (DeployPackage, DeployInstall, DeploySandbox): they
#   check the .deb and systemd units, not the programs' memory or threads.
# - The translation demo and the run report's two-site run (DeployTranslate, RunReport):
#   scripts over the same worker and shard code that WorkerTranslate and the worker's
#   two-site suites run sanitized; deploy/check.sh runs them unsanitized.
# - Under ASan, the multi-site process tests (SyncProcessTest, half of its suite's time):
#   TSan runs them, where their threads and timing are what is tested; ASan runs the same
#   membership and link code in process (SyncEngineTest, PeerLink, the fuzz replays).
# --timeout bounds a test with no limit of its own; the slowest here takes under a minute.
skip_tests='^(WanWireBytes|DeployPackage|DeployInstall|DeploySandbox|DeployTranslate)\.|^RunReport\.TwoSite'
[[ "$kind" == tsan ]] && skip_tests="$skip_tests|^StreamedPushTest\."  # not built there (above)
ctest --test-dir "$build" -L "$labels" -E "$skip_tests" --output-on-failure -j"$jobs" \
  --timeout 300 || { deploy/ctest-failures.sh "$build"; exit 8; }
