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
# Prints the base model's path last; everything else it prints goes to stderr.
base=$(deploy/demo-prepare.sh | tail -1)
model="--layers 2 --width 128 --heads 4 --context 128"

echo "== two-site LoRA training"
deploy/two-site.sh --base "$base" --data-a "$out/data/A" --data-b "$out/data/B" \
  --model "$model --lora-rank 8 --lora-alpha 16" --train "--lr 2e-3 --min-lr 2e-4 --warmup-steps 10 --batch-size 8" \
  --out "$out/two-site" --summary "$out/two-site/summary.json" "$@"
