#!/usr/bin/env bash
# WAN bytes per round and final validation loss of one fixed two-site training
# configuration (deploy/two-site.sh: 2 sites x 2 shards x 2 ranks, LoRA r8 on a 2x128
# byte-level GPT, en+fr at site A, de+es at site B) under
#   (a) dense fp32 deltas every round      sync.codec = dense
#   (b) int8 deltas                          sync.codec = int8+zstd
#   (c) the sparse pipeline                  sync.codec = topk:0.05+int2+zstd (the
#       default until 2026-11-26; (a)-(c) with sync.adaptive = false)
#   (d) adaptive mode                        sync.adaptive = true, starting at dense fp32
#       (sync.codec, the finest used) and free to go down to the sparse pipeline (the floor),
#       over a WAN shaped to --wan-rate (default 200kbit; site B in its own network
#       namespace behind tc tbf, see deploy/two-site.sh) when run as root with tc,
#       otherwise on loopback (where every link is fast and adaptive picks the ceiling)
# and (e) the same total compute trained at one site on all the data (one process,
# 4x the batch, the same number of steps), all in the same run. Prints a table and the
# issue's target check: (c) sends >= 50x fewer WAN bytes than (a) at a validation loss
# within 2% of (a), on payload bytes; the table leads with wire bytes (every message with
# its framing, encryption and handshakes) and, as root, the kernel's count of the WAN veth.
# Validation loss = mean of the loss on site A's and site B's
# validation data.
#
# Usage: bench/sync/run.sh [--rounds N] [--steps-per-round H] [--wan-rate RATE] [--json FILE]
set -euo pipefail
cd "$(dirname "$0")/../.."
build="${ISTHMUS_BUILD_DIR:-build}"
rounds=12 steps=20 json_out="" wan_rate=200kbit
while [ $# -gt 0 ]; do
  case "$1" in
    --rounds) rounds="$2"; shift 2 ;;
    --steps-per-round) steps="$2"; shift 2 ;;
    --json) json_out="$2"; shift 2 ;;
    --wan-rate) wan_rate="$2"; shift 2 ;;
    -h|--help) sed -n 2,19p "$0"; exit 0 ;;
    *) echo "run.sh: unknown option '$1' (try --help)" >&2; exit 2 ;;
  esac
done
export OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
base=$(deploy/demo-prepare.sh | tail -1)
out=demo-out/bench-sync
rm -rf "$out" && mkdir -p "$out"
model="--layers 2 --width 128 --heads 4 --context 128 --lora-rank 8 --lora-alpha 16"
train="--lr 2e-3 --min-lr 2e-4 --warmup-steps 10 --batch-size 8"
echo "bench/sync: $rounds rounds x $steps steps, machine: cores=$(getconf _NPROCESSORS_ONLN), load $(cut -d' ' -f1-3 /proc/loadavg)"

run_case() {  # name, extra two-site flags...
  local name="$1"; shift
  echo "== ($name) $*"
  deploy/two-site.sh --base "$base" --data-a demo-out/data/A --data-b demo-out/data/B \
    --model "$model" --train "$train" --rounds "$rounds" --steps-per-round "$steps" \
    --out "$out/$name" --summary "$out/$name.json" "$@" | tail -5
}
default="topk:0.05+int2+zstd"  # the default pipeline until 2026-11-26 (docs/SYNC.md, "Defaults")
# As root, (a)-(c) also run with site B behind a fast shaped veth (100 Mbit/s, no
# bottleneck) so the kernel counts their WAN bytes.
fast=()
if [ "$(id -u)" -eq 0 ] && command -v tc >/dev/null; then fast=(--wan-rate 100mbit); fi
run_case a-dense --codec dense --no-adaptive "${fast[@]}"
run_case b-int8 --codec int8+zstd --no-adaptive "${fast[@]}"
run_case c-default --codec "$default" --no-adaptive "${fast[@]}"
if [ "$(id -u)" -eq 0 ] && command -v tc >/dev/null; then
  run_case d-adaptive --adaptive --codec dense --adaptive-floor "$default" --wan-rate "$wan_rate"
else
  echo "(d) runs on loopback: shaping the WAN needs root and tc"
  run_case d-adaptive --adaptive --codec dense --adaptive-floor "$default"
fi

echo "== (e) one site, all the data, same total compute"
w="$build/worker/isthmus-worker"
# shellcheck disable=SC2086
"$w" init $model --base "$base" --out "$out/e-init.safetensors" >/dev/null 2>&1
# shellcheck disable=SC2086
"$w" train --standalone $model --base "$base" --init "$out/e-init.safetensors" \
  --data demo-out/data/all --lr 2e-3 --min-lr 2e-4 --warmup-steps 10 --batch-size 32 \
  --max-steps $((rounds * steps)) --no-progress --log-every 100 \
  --save "$out/e-final.safetensors" > "$out/e-train.log" 2>&1
for d in A B; do
  # shellcheck disable=SC2086
  "$w" eval $model --base "$base" --trainable "$out/e-final.safetensors" \
    --data "demo-out/data/$d" --json > "$out/e-eval-$d.json" 2>/dev/null
done

/usr/bin/python3 - "$out" "$rounds" "${json_out:-}" <<'PY'
import json, sys
out, rounds, json_out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rows = {}
for name in ["a-dense", "b-int8", "c-default", "d-adaptive"]:
    s = json.load(open(f"{out}/{name}.json"))
    sites = s["sites"]
    sent = sum(v["wan_bytes_sent"] for v in sites.values())
    wire = sum(v["wire_bytes_sent"] for v in sites.values())
    kernel = s.get("kernel_wan_bytes")
    loss = sum(sites["A"]["val_loss"].values()) / 2
    rows[name] = {"wan_bytes_per_round": sent / rounds, "wire_bytes_per_round": wire / rounds,
                  "kernel_bytes_per_round": kernel / rounds if kernel else None,
                  "val_loss": loss,
                  "val_loss_A": sites["A"]["val_loss"]["A"], "val_loss_B": sites["A"]["val_loss"]["B"],
                  "digests_agree": s["digests_agree"], "train_seconds": s["train_seconds"]}
e = {d: json.load(open(f"{out}/e-eval-{d}.json"))["val_loss"] for d in "AB"}
rows["e-one-site"] = {"wan_bytes_per_round": 0, "wire_bytes_per_round": 0,
                      "kernel_bytes_per_round": None, "val_loss": (e["A"] + e["B"]) / 2,
                      "val_loss_A": e["A"], "val_loss_B": e["B"], "digests_agree": None, "train_seconds": None}
dense = rows["a-dense"]
print()
# The wire (every message, framing, CURVE, handshakes; the sites' count) is the headline;
# the kernel's count of the WAN veth where it was shaped; the delta payload last.
print(f"{'case':<12}{'wire B/round':>14}{'vs dense':>10}{'kernel B/round':>16}{'payload B/round':>17}"
      f"{'vs dense':>10}{'val loss':>10}{'A (en,fr)':>11}{'B (de,es)':>11}{'vs dense':>10}  digests")
x = lambda a, b: f"{a / b:>9.1f}x" if b else f"{'-':>10}"
for k, r in rows.items():
    rel = (r["val_loss"] / dense["val_loss"] - 1) * 100
    agree = {True: "agree", False: "DIFFER", None: "-"}[r["digests_agree"]]
    kernel = f"{r['kernel_bytes_per_round']:>16,.0f}" if r["kernel_bytes_per_round"] else f"{'-':>16}"
    print(f"{k:<12}{r['wire_bytes_per_round']:>14,.0f}{x(dense['wire_bytes_per_round'], r['wire_bytes_per_round'])}"
          f"{kernel}{r['wan_bytes_per_round']:>17,.0f}{x(dense['wan_bytes_per_round'], r['wan_bytes_per_round'])}"
          f"{r['val_loss']:>10.4f}{r['val_loss_A']:>11.4f}{r['val_loss_B']:>11.4f}{rel:>+9.2f}%  {agree}")
c = rows["c-default"]
wire_ratio = dense["wire_bytes_per_round"] / c["wire_bytes_per_round"]
ratio = dense["wan_bytes_per_round"] / c["wan_bytes_per_round"]
rel = abs(c["val_loss"] / dense["val_loss"] - 1) * 100
met = ratio >= 50 and rel <= 2
print(f"\ndefault pipeline vs dense: {wire_ratio:.1f}x fewer wire bytes, {ratio:.1f}x fewer payload "
      f"bytes, val loss within {rel:.2f}%")
print(f"target (payload): >= 50x fewer payload bytes than dense at val loss within 2% -> "
      f"{'MET' if met else 'NOT MET'}")
if json_out:
    json.dump(rows, open(json_out, "w"), indent=2)
PY
