#!/usr/bin/env bash
# deploy/two-site.sh --data-c: three sites on loopback (one shard and one CPU rank each,
# CURVE peer links between every pair) train a tiny GPT (LoRA) on real text, three of the
# repository's own docs/*.md, one per site, for 3 rounds. Checks that every site committed
# every round, that `isthmusctl sync verify` found the three sites' digests equal, that
# each site's committed model was evaluated on every site's data (the printed table and
# summary.json), that the sites sent WAN bytes to each other, and that --wan-rate (a link
# between two sites) refuses --data-c with exit 2.
# Usage: three_sites_test.sh BUILD_DIR
set -euo pipefail
build=$(cd "$1" && pwd)
root=$(cd "$(dirname "$0")/../.." && pwd)
for b in server/isthmus-server server/isthmusctl worker/isthmus-worker worker/data/isthmus-data; do
  [ -x "$build/$b" ] || { echo "FAIL: $build/$b is not built"; exit 1; }
done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
data="$build/worker/data/isthmus-data"
declare -A doc=([A]=ARCHITECTURE [B]=SYNC [C]=WORKER)
for s in A B C; do
  "$data" build --out "$work/$s" --val-fraction 0.2 "$root/docs/${doc[$s]}.md" >/dev/null
done
model="--layers 2 --width 64 --heads 2 --context 64 --lora-rank 4 --lora-alpha 8"
# shellcheck disable=SC2086
"$build/worker/isthmus-worker" init $model --out "$work/unused.safetensors" \
  --write-base "$work/base.safetensors" >/dev/null 2>&1

set +e
ISTHMUS_BUILD_DIR="$build" "$root/deploy/two-site.sh" --base "$work/base.safetensors" \
  --data-a "$work/A" --data-b "$work/B" --data-c "$work/C" --model "$model" \
  --train "--batch-size 2 --lr 3e-3" --rounds 3 --steps-per-round 4 --shards 1 --ranks 1 \
  --eval-batches 2 --out "$work/run" > "$work/out.txt" 2>&1
rc=$?
set -e
cat "$work/out.txt"
[ "$rc" -eq 0 ] || { echo "FAIL: two-site.sh --data-c exited $rc"; exit 1; }
grep -q "^two-site: sites A B C," "$work/out.txt" || { echo "FAIL: not three sites"; exit 1; }
grep -q "committed digests agree across sites: yes" "$work/out.txt" ||
  { echo "FAIL: the three sites' digests were not found equal"; exit 1; }
/usr/bin/python3 - "$work/run/summary.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
sites = s["sites"]
assert sorted(sites) == ["A", "B", "C"], sorted(sites)
assert s["digests_agree"] and s["rounds_verified"] >= 3, (s["digests_agree"], s["rounds_verified"])
for name, r in sites.items():
    assert r["committed_round"] >= 3, (name, r["committed_round"])
    assert sorted(r["val_loss"]) == ["A", "B", "C"], (name, r["val_loss"])
    assert all(isinstance(v, float) and 0 < v < 10 for v in r["val_loss"].values()), r["val_loss"]
    # each site sent its rounds to its two peers
    assert r["wan_bytes_sent"] > 0 and r["wire_bytes_sent"] >= r["wan_bytes_sent"], r
# one committed model: every site's evaluation of it on the same data agrees
for d in "ABC":
    v = {round(sites[s]["val_loss"][d], 5) for s in "ABC"}
    assert len(v) == 1, (d, v)
assert s["counted_wan_bytes"] > 0 and s["payload_bytes"] > 0 and "kernel_wan_bytes" not in s
print("three sites: ok")
PY

set +e
ISTHMUS_BUILD_DIR="$build" "$root/deploy/two-site.sh" --base "$work/base.safetensors" \
  --data-a "$work/A" --data-b "$work/B" --data-c "$work/C" --wan-rate 1mbit \
  --out "$work/run2" > "$work/out2.txt" 2>&1
rc=$?
set -e
[ "$rc" -eq 2 ] || { cat "$work/out2.txt"; echo "FAIL: --wan-rate with --data-c exited $rc, not 2"; exit 1; }
grep -q "does not take --data-c" "$work/out2.txt" || { cat "$work/out2.txt"; echo "FAIL: no reason given"; exit 1; }
echo "PASS"
