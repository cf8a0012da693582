#!/usr/bin/env bash
# The run report from a real run: deploy/two-site.sh trains a tiny GPT (LoRA) for a few
# rounds over two sites (2 shards x 2 CPU ranks each, CURVE peer links on loopback) on real
# text, a few of the repository's own docs/*.md (two per site), with each document's
# validation split evaluated by the workers after every round; --report writes the report.
# deploy/reference.sh measures the references the report compares the rounds with (each
# set before round 1, and centralised training for the same tokens).
# check_report.py then holds the PNGs, the page and report.json to the run's own files.
# Also checks that two-site.sh prints the report's path last and leaves no process behind.
# Usage: report_test.sh BUILD_DIR (KEEP_WORK=1 keeps its scratch folder). Exit 77 (skipped)
# without python3-matplotlib.
set -euo pipefail
build=$(cd "$1" && pwd)
root=$(cd "$(dirname "$0")/../.." && pwd)
if ! /usr/bin/python3 -c "import matplotlib" 2>/dev/null; then
  echo "SKIP: /usr/bin/python3 has no matplotlib (apt-get install python3-matplotlib, or deploy/install-deps.sh)"
  exit 77
fi
for b in server/isthmus-server server/isthmusctl worker/isthmus-worker worker/data/isthmus-data; do
  [ -x "$build/$b" ] || { echo "FAIL: $build/$b is not built"; exit 1; }
done
work=$(mktemp -d)
trap '[ -n "${KEEP_WORK:-}" ] || rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE

# Two documents per site; each document alone is one "language" (--eval-set), split with
# the same seed and fraction as the site's data, so its validation paragraphs are the
# ones in the site's val.bin.
data="$build/worker/data/isthmus-data"
declare -A docs=([A]="ARCHITECTURE SYNC" [B]="WORKER CLI")
eval_sets=()
for s in A B; do
  files=()
  for d in ${docs[$s]}; do
    files+=("$root/docs/$d.md")
    "$data" build --out "$work/doc-$d" --val-fraction 0.2 "$root/docs/$d.md" >/dev/null
    eval_sets+=(--eval-set "${d,,}=$work/doc-$d")
  done
  "$data" build --out "$work/$s" --val-fraction 0.2 "${files[@]}" >/dev/null
done
"$data" build --out "$work/all" --val-fraction 0.2 "$root"/docs/{ARCHITECTURE,SYNC,WORKER,CLI}.md >/dev/null
model="--layers 2 --width 64 --heads 2 --context 64"
# shellcheck disable=SC2086
"$build/worker/isthmus-worker" init $model --lora-rank 8 --lora-alpha 16 \
  --out "$work/unused-init.safetensors" --write-base "$work/base.safetensors" >/dev/null 2>&1

rounds=5
# The references the report draws: each set before round 1, and centralised training on all
# four documents for the sites' tokens (5 rounds x 8 steps, batch 2 sites x 2 ranks x 4).
ISTHMUS_BUILD_DIR="$build" "$root/deploy/reference.sh" --base "$work/base.safetensors" \
  --data "$work/all" --steps $((rounds * 8)) --batch 16 --model "$model --lora-rank 8 --lora-alpha 16" \
  --train "--lr 3e-3 --min-lr 3e-4 --warmup-steps 2" --eval-batches 4 "${eval_sets[@]}" \
  --out "$work/reference" > "$work/reference.out" 2>&1 ||
  { cat "$work/reference.out"; echo "FAIL: reference.sh failed"; exit 1; }
# Dense deltas (64 KiB a round): large enough for the links to measure their bandwidth (the
# default pipeline's few hundred bytes a round would give them nothing to measure), and the
# same size every round, so check_report.py can tell a misattributed round. (--no-adaptive:
# its choice of codec after the first measurement depends on the machine's speed.)
t0=$(date +%s)
ISTHMUS_BUILD_DIR="$build" "$root/deploy/two-site.sh" --base "$work/base.safetensors" \
  --data-a "$work/A" --data-b "$work/B" --model "$model --lora-rank 8 --lora-alpha 16" \
  --train "--lr 3e-3 --min-lr 3e-4 --warmup-steps 2 --batch-size 4 --val-batches 2" \
  --codec dense --no-adaptive \
  --rounds "$rounds" --steps-per-round 8 "${eval_sets[@]}" --eval-every-rounds 1 \
  --eval-batches 4 --top-interval 0.2 --out "$work/run" --report "$work/report" \
  --reference "$work/reference/reference.json" \
  > "$work/two-site.out" 2>&1 || { cat "$work/two-site.out"; echo "FAIL: two-site.sh failed"; exit 1; }
cat "$work/two-site.out"
echo "two-site run and report: $(( $(date +%s) - t0 )) s"

if grep -q "isthmusctl top .* ended with exit" "$work/two-site.out"; then
  echo "FAIL: an isthmusctl top of the run did not end cleanly (its log: run/logs/top-<site>.log)"; exit 1
fi
last=$(tail -n 1 "$work/two-site.out")
if [ "$last" != "report: $work/report/index.html" ]; then
  echo "FAIL: two-site.sh's last line is '$last', not the report's path"; exit 1
fi
# Every server, worker and isthmusctl top of the run named a file under $work.
if left=$(pgrep -a -f -- "$work/"); then
  echo "FAIL: processes left behind by two-site.sh:"; echo "$left"; exit 1
fi
/usr/bin/python3 "$root/tests/report/check_report.py" "$work/run" "$work/report" "$rounds" \
  site architecture sync worker cli
