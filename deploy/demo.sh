#!/usr/bin/env bash
# The README's main job: two-site collaborative training on one machine.
#  1. installs packages and builds isthmus (Ninja, build/);
#  2. fetches the Debian Reference corpus: site A gets English + French, site B German +
#     Spanish (different languages per site: the non-IID case);
#  3. pre-trains a small byte-level GPT base in full mode on all four languages (cached in
#     demo-out/base/ after the first run);
#  4. runs deploy/two-site.sh: 2 sites x 2 shards x 2 CPU worker ranks, LoRA adapters,
#     compressed cross-site rounds over CURVE peer links on loopback, and prints per site
#     the validation loss on both sites' languages, rounds committed, WAN bytes sent, the
#     compression ratio and whether the sites' committed digests agree.
# Takes a few minutes on 2 cores after the build. Extra arguments go to two-site.sh
# (e.g. --rounds 12, --codec int8+zstd). For the shard/CLI walk-through see
# deploy/demo-shard.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
build="${ISTHMUS_BUILD_DIR:-build}"
out=demo-out
export OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1

deploy/install-deps.sh
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$build" --target isthmus-server isthmusctl isthmus-worker isthmus-data -j"$(nproc)"

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

echo "== two-site LoRA training"
deploy/two-site.sh --base "$base" --data-a "$out/data/A" --data-b "$out/data/B" \
  --model "$model --lora-rank 8 --lora-alpha 16" --train "--lr 2e-3 --min-lr 2e-4 --warmup-steps 10 --batch-size 8" \
  --out "$out/two-site" --summary "$out/two-site/summary.json" "$@"
