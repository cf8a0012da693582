#!/usr/bin/env bash
# The README's main job: two-site collaborative training on one machine.
#  1. installs packages and builds isthmus (Ninja, build/);
#  2. fetches the Debian Reference corpus: site A gets English + French, site B German +
#     Spanish (different languages per site: the non-IID case);
#  3. pre-trains a small byte-level GPT base in full mode on all four languages (cached in
#     demo-out/base/ after the first run);
#  4. measures the references the report compares the rounds with, for each language: the
#     loss before round 1 (the pre-trained base with the job's starting adapter) and the
#     loss of centralised training (one process, all four languages, the same steps and
#     tokens as both sites together), cached in demo-out/reference/ (--no-reference skips);
#  5. runs deploy/two-site.sh: 2 sites x 2 shards x 2 CPU worker ranks, LoRA adapters,
#     compressed cross-site rounds over CURVE peer links on loopback, each site's model
#     evaluated on every language after every round, and prints per site the validation
#     loss on both sites' languages, rounds committed, WAN bytes sent, the compression
#     ratio and whether the sites' committed digests agree;
#  6. writes the run report (deploy/report.py: plots of validation loss per site and
#     language, WAN bytes per round, lag, bandwidth and codec) to demo-out/report/ and
#     prints the path of its index.html as the last line.
# Takes a few minutes on 2 cores after the build. Extra arguments go to two-site.sh
# (e.g. --rounds 12, --codec int8+zstd; --rounds, --steps-per-round and --ranks also size
# the centralised reference). For the shard/CLI walk-through see
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

# The references: the same model flags, schedule and data order as the sites' workers.
lora="--lora-rank 8 --lora-alpha 16"
schedule="--lr 2e-3 --min-lr 2e-4 --warmup-steps 10"
rounds=8 h=20 ranks=2 reference=true args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --no-reference) reference=false; shift ;;
    --rounds) rounds="$2"; args+=("$1" "$2"); shift 2 ;;
    --steps-per-round) h="$2"; args+=("$1" "$2"); shift 2 ;;
    --ranks) ranks="$2"; args+=("$1" "$2"); shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
# The sites run the server's defaults (docs/SYNC.md, "Defaults"): int2:256+zstd deltas,
# adaptive sizing, outer lr 1.25 with Nesterov momentum 0.6, one round in flight, and
# overlapped rounds in the workers.
ref_flags=()
if [ "$reference" = true ]; then
  steps=$((rounds * h)) batch=$((2 * ranks * 8))
  ref="$out/reference/T$steps-b$batch"
  if [ ! -f "$ref/reference.json" ] || [ "$base" -nt "$ref/reference.json" ]; then
    echo "== references: the loss before round 1, and centralised training ($steps steps of batch $batch)"
    deploy/reference.sh --base "$base" --data "$out/data/all" --steps "$steps" \
      --batch "$batch" --model "$model $lora" --train "$schedule" "${eval_sets[@]}" \
      --out "$ref" > /dev/null
  fi
  ref_flags=(--reference "$ref/reference.json")
fi

echo "== two-site LoRA training"
# two-site.sh prints the report's path (demo-out/report/index.html) as its last line.
deploy/two-site.sh --base "$base" --data-a "$out/data/A" --data-b "$out/data/B" \
  --model "$model $lora" --train "$schedule --batch-size 8 --val-batches 8" \
  "${eval_sets[@]}" --eval-every-rounds 1 --report "$out/report" "${ref_flags[@]}" \
  --out "$out/two-site" --summary "$out/two-site/summary.json" "${args[@]}"
