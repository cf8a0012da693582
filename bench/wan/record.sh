#!/usr/bin/env bash
# Records real round deltas for the WAN benchmark (bench/wan/run.sh): a GPT-2-small-shaped
# model (12 layers x 768, 12 heads; byte-level, context 128) trained on CPU on the demo's
# Debian Reference data, site A on en+fr and site B on de+es, in rounds of H steps with
# the optimizer state carried across rounds (each round resumes the previous one's
# checkpoint). Writes the trainable tensors after every round:
#   OUT/full/SITE/round-R.safetensors   full mode, from a random init (round-0 = init)
#   OUT/lora/SITE/round-R.safetensors   LoRA r16 on all four projections (2,359,296
#                                       values), on the base that site A's full run ends
#                                       with (round-0 = the adapters' init)
# The benchmark replays round R's delta as round-R minus round-(R-1). Slow on CPU (about
# 1.2-1.7 s per step on 2 cores): the defaults take roughly 15 minutes.
# Usage: bench/wan/record.sh [--out DIR] [--rounds R] [--steps-per-round H]
set -euo pipefail
cd "$(dirname "$0")/../.."
build="${ISTHMUS_BUILD_DIR:-build}"
out=demo-out/wan-deltas rounds=3 steps=50
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --steps-per-round) steps="$2"; shift 2 ;;
    -h|--help) sed -n 2,15p "$0"; exit 0 ;;
    *) echo "record.sh: unknown option '$1' (try --help)" >&2; exit 2 ;;
  esac
done
worker="$build/worker/isthmus-worker"
[ -x "$worker" ] || { echo "record.sh: $worker is not built" >&2; exit 2; }
if [ ! -d demo-out/data/A ] || [ ! -d demo-out/data/B ]; then deploy/demo-prepare.sh >/dev/null; fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(getconf _NPROCESSORS_ONLN)}" OMP_WAIT_POLICY=PASSIVE
model=(--layers 12 --width 768 --heads 12 --context 128)
train=(--batch-size 4 --lr 3e-4 --min-lr 3e-5 --warmup-steps 20 --no-progress --log-every 25)

# run MODE SITE INIT BASE: rounds of training, a save after each
run() {
  local mode=$1 site=$2 init=$3 base=$4 dir="$out/$1/$2"
  rm -rf "$dir" && mkdir -p "$dir"
  cp "$init" "$dir/round-0.safetensors"
  local extra=()
  [ "$mode" = lora ] && extra=(--lora-rank 16 --lora-alpha 32)
  for ((r = 1; r <= rounds; r++)); do
    echo "record: $mode site $site round $r/$rounds ($steps steps)" >&2
    "$worker" train --standalone --mode "$mode" "${model[@]}" "${extra[@]}" --base "$base" \
      --init "$dir/round-0.safetensors" --data "demo-out/data/$site" "${train[@]}" \
      --max-steps $((r * steps)) --checkpoint-dir "$dir/checkpoint" \
      --save "$dir/round-$r.safetensors" 2>&1 | grep -E "done|validation" >&2
  done
  rm -rf "$dir/checkpoint"
}

mkdir -p "$out"
"$worker" init --mode full "${model[@]}" --write-base "$out/random-base.safetensors" \
  --out "$out/full-init.safetensors" >/dev/null
for site in A B; do run full "$site" "$out/full-init.safetensors" "$out/random-base.safetensors"; done
base="$out/full/A/round-$rounds.safetensors"
"$worker" init --mode lora "${model[@]}" --lora-rank 16 --lora-alpha 32 --base "$base" \
  --out "$out/lora-init.safetensors" >/dev/null
for site in A B; do run lora "$site" "$out/lora-init.safetensors" "$base"; done
echo "record: done; deltas under $out" >&2
