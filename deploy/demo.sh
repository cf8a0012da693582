#!/usr/bin/env bash
# The README's main job: two-site collaborative training on one machine.
#  1. installs packages and builds isthmus (Ninja, build/);
#  2. fetches the Debian Reference corpus: site A gets English + French, site B German +
#     Spanish (different languages per site: the non-IID case);
#  3. pre-trains a small byte-level GPT base in full mode on all four languages (cached in
#     demo-out/base/ after the first run);
#  4. runs deploy/two-site.sh: 2 sites x 2 shards x 2 CPU worker ranks, LoRA adapters,
#     compressed cross-site rounds over CURVE peer links on loopback, each site's model
#     evaluated on every language after every round, and prints per site the validation
#     loss on both sites' languages, rounds committed, WAN bytes sent, the compression
#     ratio and whether the sites' committed digests agree;
#  5. writes the run report (deploy/report.py: plots of validation loss per site and
#     language, WAN bytes per round, lag, bandwidth and codec) to demo-out/report/ and
#     prints the path of its index.html as the last line.
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

# One validation set per language (isthmus-data's default seed and fraction, as
# demo-prepare.sh uses, so each language's validation paragraphs are those in data/A and
# data/B), evaluated by the workers after every round for the report's per-language curves.
eval_sets=()
for l in en fr de es; do
  d="$out/data/lang-$l"
  [ "$d/val.bin" -nt "$out/corpus/$l.txt" ] || "$build/worker/data/isthmus-data" build --out "$d" "$out/corpus/$l.txt" >/dev/null
  eval_sets+=(--eval-set "$l=$d")
done

echo "== two-site LoRA training"
# two-site.sh prints the report's path (demo-out/report/index.html) as its last line.
deploy/two-site.sh --base "$base" --data-a "$out/data/A" --data-b "$out/data/B" \
  --model "$model --lora-rank 8 --lora-alpha 16" \
  --train "--lr 2e-3 --min-lr 2e-4 --warmup-steps 10 --batch-size 8 --val-batches 4" \
  "${eval_sets[@]}" --eval-every-rounds 1 --report "$out/report" \
  --out "$out/two-site" --summary "$out/two-site/summary.json" "$@"
