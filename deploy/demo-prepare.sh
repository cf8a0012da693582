#!/usr/bin/env bash
# Prepares the inputs of the two-site demo and of bench/sync/run.sh: installs packages,
# builds the binaries, fetches the Debian Reference corpus (en fr -> site A, de es ->
# site B), builds token shards (demo-out/data/{A,B,all}) and pre-trains a small
# byte-level GPT base in full mode on all four languages (cached in demo-out/base/).
# Progress goes to stderr; the last line on stdout is the base model's path.
set -euo pipefail
cd "$(dirname "$0")/.."
build="${ISTHMUS_BUILD_DIR:-build}"
out=demo-out
export OMP_WAIT_POLICY=PASSIVE
{
deploy/install-deps.sh
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$build" --target isthmus-server isthmusctl isthmus-worker isthmus-data -j"$(getconf _NPROCESSORS_ONLN)"

echo "== corpus: Debian Reference (en fr -> site A, de es -> site B)"
deploy/fetch-corpus.sh --out "$out/corpus" en fr de es
data="$build/worker/data/isthmus-data"
"$data" build --out "$out/data/A" "$out/corpus/en.txt" "$out/corpus/fr.txt" >/dev/null
"$data" build --out "$out/data/B" "$out/corpus/de.txt" "$out/corpus/es.txt" >/dev/null
"$data" build --out "$out/data/all" "$out/corpus/en.txt" "$out/corpus/fr.txt" \
  "$out/corpus/de.txt" "$out/corpus/es.txt" >/dev/null

model="--layers 2 --width 128 --heads 4 --context 128"
base="$out/base/base-2x128-1000.safetensors"
if [ ! -f "$base" ]; then
  echo "== base model: 2 layers x 128, byte-level, full-mode pre-training on all four languages"
  mkdir -p "$out/base"
  # shellcheck disable=SC2086
  OMP_NUM_THREADS=2 "$build/worker/isthmus-worker" train --standalone --mode full $model \
    --data "$out/data/all" --batch-size 8 --lr 2e-3 --min-lr 2e-4 --warmup-steps 20 \
    --max-steps 1000 --val-every 500 --log-every 50 --no-progress --save "$base.tmp" \
    2>&1 | grep -E "validation|done"
  mv "$base.tmp" "$base"
else
  echo "== base model: reusing $base"
fi

} >&2
echo "$base"
