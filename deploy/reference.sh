#!/usr/bin/env bash
# The references a two-site run is compared with (deploy/two-site.sh --reference, shown by
# deploy/report.py), for each --eval-set: the loss before round 1 (the base with the job's
# starting adapter, which is the base itself: a fresh LoRA adapter adds nothing) and the
# loss of centralised training: one process on DATA (every site's data together) for STEPS
# steps of batch BATCH, as many tokens as the sites' ranks train together, with the same
# model, schedule and data order. Writes OUT/reference.json:
#   {"before": {set: loss}, "centralised": {set: loss}, "centralised_steps": T,
#    "centralised_batch": B}
# and keeps the adapters, the training log and each evaluation in OUT.
#
# Usage: deploy/reference.sh --base BASE.safetensors --data DIR --steps T --batch B
#          --out DIR [--model "FLAGS"] [--train "FLAGS"] [--eval-batches N]
#          --eval-set NAME=DIR [--eval-set ...]
#   --model   model flags, LoRA rank and alpha included, as the sites' workers have them
#   --train   schedule flags (--lr, --min-lr, --warmup-steps, --data-seed); --max-steps T
#             and --batch-size B are added
#   --eval-batches N   batches per evaluation (default 16, isthmus-worker eval's, as
#             two-site.sh's final evaluations)
# Environment: ISTHMUS_BUILD_DIR (default build).
set -euo pipefail
cd "$(dirname "$0")/.."
build="${ISTHMUS_BUILD_DIR:-build}"
worker="$build/worker/isthmus-worker"
base="" data="" steps="" batch="" out="" model="" train="" eval_batches=16 eval_sets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --base) base="$2"; shift 2 ;;
    --data) data="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    --batch) batch="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --model) model="$2"; shift 2 ;;
    --train) train="$2"; shift 2 ;;
    --eval-batches) eval_batches="$2"; shift 2 ;;
    --eval-set) eval_sets+=("$2"); shift 2 ;;
    -h|--help) sed -n 2,20p "$0"; exit 0 ;;
    *) echo "reference.sh: unknown option '$1' (try --help)" >&2; exit 2 ;;
  esac
done
for v in base data steps batch out; do
  if [ -z "${!v}" ]; then echo "reference.sh: --$v is required (try --help)" >&2; exit 2; fi
done
if [ "${#eval_sets[@]}" -eq 0 ]; then echo "reference.sh: give at least one --eval-set NAME=DIR" >&2; exit 2; fi
[ -x "$worker" ] || { echo "reference.sh: $worker is not built (cmake --build $build)" >&2; exit 2; }
mkdir -p "$out"
# shellcheck disable=SC2086
"$worker" init $model --base "$base" --out "$out/init.safetensors" > "$out/init.log" 2>&1
# shellcheck disable=SC2086
if ! "$worker" train --standalone $model $train --max-steps "$steps" --batch-size "$batch" \
    --base "$base" --init "$out/init.safetensors" --data "$data" --no-progress \
    --log-every 50 --save "$out/centralised.safetensors" > "$out/train.log" 2>&1; then
  echo "reference.sh: centralised training failed (log: $out/train.log)" >&2; exit 1
fi
names=()
for e in "${eval_sets[@]}"; do
  n="${e%%=*}" names+=("$n")
  for which in init centralised; do
    # shellcheck disable=SC2086
    "$worker" eval $model --base "$base" --trainable "$out/$which.safetensors" --data "${e#*=}" \
      --batches "$eval_batches" --json > "$out/eval-$which-$n.json" 2> "$out/eval-$which-$n.log" ||
      { echo "reference.sh: evaluating $which on $n failed (log: $out/eval-$which-$n.log)" >&2; exit 1; }
  done
done
/usr/bin/python3 - "$out" "$steps" "$batch" "${names[@]}" > "$out/reference.json.tmp" <<'PY'
import json, sys
out, steps, batch, names = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
loss = lambda which, n: json.load(open(f"{out}/eval-{which}-{n}.json"))["val_loss"]
print(json.dumps({"before": {n: loss("init", n) for n in names},
                  "centralised": {n: loss("centralised", n) for n in names},
                  "centralised_steps": steps, "centralised_batch": batch}, indent=2))
PY
mv "$out/reference.json.tmp" "$out/reference.json"
echo "$out/reference.json"
