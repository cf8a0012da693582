#!/usr/bin/env bash
# Loss versus WAN bytes on the demo task (LoRA r8 on a 2x128 byte-level GPT; site A trains
# on en+fr, site B on de+es), every point at the same total compute: T steps per rank.
#   centralised  one process, all four languages, batch 16 per site (= 2 ranks x 8), T steps
#   two sites    deploy/two-site.sh (2 shards, 2 ranks per site), H steps per round,
#                T / H rounds, for each codec x H x outer optimiser in the grid below;
#                WAN shaped to 100mbit so the veth's kernel counters measure the bytes
#                (adaptive points: 200kbit, where adaptive sizing has something to do)
# Each point is evaluated on each language's validation set (--eval-batches 32) and
# appended as one JSON line to OUT/results.jsonl; points already there are skipped, so an
# interrupted study resumes where it stopped. bench/study/plot.py reads the file.
#
# Usage: bench/study/run.sh [--quick] [--steps T] [--out DIR] [--rounds-ahead K] [--seed S]
#                           [--overlap] [--no-overlap] [--merge-after-steps M] [--merge-wait]
#                           [--swap-sites]
#                           [--sites 2|3] [--points "C/H/O ..."]
#   --quick     smoke test: T = 40, H = 20 only, into demo-out/study-quick
#   --steps T   total steps per rank (default 800)
#   --out DIR   results folder (default demo-out/study)
#   --rounds-ahead K   sync.max_rounds_ahead of every shard (default: the server's default);
#               0 = synchronous rounds. Part of every point's key (".../kK").
#   --seed S    the data-order seed of every run, the centralised one included
#               (isthmus-worker train --data-seed; default 0). A seed other than 0 is part
#               of every key ("TT/sS/..."), and a point is compared with the centralised
#               run of its own seed.
#   --overlap, --no-overlap   the two-site workers overlap their rounds with compute
#               (isthmus-worker train --overlap, the worker's default) or not (--no-overlap);
#               overlapped points carry ".../kK/overlap" in their key.
#   --merge-after-steps M   overlapped workers merge each round's pulled state no earlier
#               than M steps into the next round, then as soon as it has arrived
#               (isthmus-worker train --merge-after-steps; default: a tenth of H, the
#               worker's default; 0: as soon as it arrives); overlapped points carry
#               ".../afterM" in their key (".../merge0" for 0).
#   --merge-wait  merge at exactly step M, waiting for the pulled state there
#               (isthmus-worker train --merge-wait); key ".../mergeM". Points recorded
#               before the default policy existed carry "merge0" (on arrival) or
#               "mergeM" (M with the wait), or nothing (on arrival).
#   --swap-sites  site A trains on de+es and site B on en+fr (the other way round): tells
#               a lean that follows a site's position from one that follows its languages;
#               part of every two-site key (".../swapped").
#   --sites 3   three sites: A on en+fr, B on de+es, C on all four languages (a general
#               site beside two specialised ones: the languages stay equally mixed, as in
#               the centralised run, which trains the same tokens at batch 48).
#               deploy/two-site.sh --data-c runs them on loopback, so the bytes are the
#               sites' own count of their wire bytes plus an estimate of TCP/IP headers,
#               not a veth's counters. Part of every key ("TT/3sites/...").
#   --points    run only these points after the baseline: CODEC/H/OUTER. CODEC a pipeline
#               (fixed: adaptive sizing off), "default" (topk:0.05+int2+zstd, the default
#               before int2:256+zstd), "adaptive" (adaptive from dense down to
#               topk:0.002+int2+zstd) or "defaults" (no codec settings: the server's
#               defaults). OUTER one of avg (lr 1, no momentum), nesterov (DiLoCo's lr 0.7,
#               momentum 0.9), lrX (lr X, no momentum), lrXmY (lr X, Nesterov momentum Y) or
#               defaults (the server's), e.g. int8+zstd/50/lr1.5 or defaults/80/defaults
# Needs root and tc (the WAN shaping); ISTHMUS_BUILD_DIR as in deploy/two-site.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."
export ISTHMUS_BUILD_DIR="${ISTHMUS_BUILD_DIR:-build}"
build="$ISTHMUS_BUILD_DIR"
steps="" out="" quick=false points="" rounds_ahead="" seed=0 overlap=true swap=false nsites=2 merge_after="" merge_wait=false
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) quick=true; shift ;;
    --steps) steps="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --points) points="$2"; shift 2 ;;
    --rounds-ahead) rounds_ahead="$2"; shift 2 ;;
    --seed) seed="$2"; shift 2 ;;
    --overlap) overlap=true; shift ;;
    --no-overlap) overlap=false; shift ;;
    --merge-after-steps) merge_after="$2"; shift 2 ;;
    --merge-wait) merge_wait=true; shift ;;
    --swap-sites) swap=true; shift ;;
    --sites) nsites="$2"; shift 2 ;;
    -h|--help) sed -n 2,54p "$0"; exit 0 ;;
    *) echo "run.sh: unknown option '$1' (try --help)" >&2; exit 2 ;;
  esac
done
if [ "$quick" = true ]; then
  out="${out:-demo-out/study-quick}" steps="${steps:-40}"
else
  out="${out:-demo-out/study}" steps="${steps:-800}"
fi
export OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
# A [sync] setting's default, read from the server's settings table.
server_default() {
  "$build/server/isthmus-server" --print-config-doc |
    awk -F'|' -v k="\`sync.$1\`" '$2 ~ k {gsub(/[ `]/, "", $6); print $6}'
}
# K for every shard of every point: given, or the server's own default (so a point's key
# always names the K it ran with).
[ -n "$rounds_ahead" ] || rounds_ahead=$(server_default max_rounds_ahead)
case "$rounds_ahead" in ''|*[!0-9]*) echo "run.sh: --rounds-ahead takes a whole number" >&2; exit 2 ;; esac
case "$seed" in ''|*[!0-9]*) echo "run.sh: --seed takes a whole number" >&2; exit 2 ;; esac
case "${merge_after:-0}" in ''|*[!0-9]*) echo "run.sh: --merge-after-steps takes a whole number" >&2; exit 2 ;; esac
if [ "$merge_wait" = true ] && [ "${merge_after:-1}" -eq 0 ]; then
  echo "run.sh: --merge-wait needs a merge step (--merge-after-steps M > 0, or none for H / 10)" >&2; exit 2
fi
case "$nsites" in 2|3) ;; *) echo "run.sh: --sites takes 2 or 3" >&2; exit 2 ;; esac
if [ "$nsites" -eq 3 ] && [ "$swap" = true ]; then
  echo "run.sh: --swap-sites is for two sites" >&2; exit 2
fi
# The prefix of every key: T steps, and the seed when it is not the default.
tkey="T$steps"
[ "$seed" -ne 0 ] && tkey="T$steps/s$seed"
[ "$nsites" -eq 3 ] && tkey="$tkey/3sites"
export ISTHMUS_SYNC_MAX_ROUNDS_AHEAD="$rounds_ahead"
base=demo-out/base/base-2x128-1000.safetensors
[ -f "$base" ] || base=$(deploy/demo-prepare.sh | tail -1)
worker="$build/worker/isthmus-worker"
model="--layers 2 --width 128 --heads 4 --context 128 --lora-rank 8 --lora-alpha 16"
# --max-steps T makes the cosine schedule T steps long in every run (two-site workers
# would get T from --max-rounds x --steps-per-round anyway; this says it once).
train="--lr 2e-3 --min-lr 2e-4 --warmup-steps 10 --max-steps $steps --data-seed $seed"
results="$out/results.jsonl"
mkdir -p "$out/runs"
touch "$results"

# Per-language data (isthmus-data's default seed and val fraction, as deploy/demo-prepare.sh
# uses, so each language's validation documents are the ones in data/A and data/B).
langs=(en fr de es)
eval_sets=()
for l in "${langs[@]}"; do
  d="demo-out/data/lang-$l"
  [ -f "$d/val.bin" ] || "$build/worker/data/isthmus-data" build --out "$d" "demo-out/corpus/$l.txt" >/dev/null
  eval_sets+=(--eval-set "$l=$d")
done

done_already() { grep -qF "\"key\": \"$1\"" "$results"; }
# Appends one point to results.jsonl: the config, per-language validation loss, WAN bytes
# and the comparisons with dense per-step sync and with the centralised point.
record() {  # key, wall seconds, config json, source (two-site summary, or centralised folder)
  local line
  line=$(/usr/bin/python3 - "$results" "$steps" "$@" <<'PY'
import json, os, re, struct, sys
results, steps, key, wall, config, src = sys.argv[1:]
steps, config, langs = int(steps), json.loads(config), ["en", "fr", "de", "es"]

def numel(path):  # elements of the trainable tensors, from the safetensors header
    with open(path, "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    total = 0
    for name, t in header.items():
        if name != "__metadata__":
            n = 1
            for d in t["shape"]:
                n *= d
            total += n
    return total

row = {"key": key, "steps": steps, **config}
if config["kind"] == "centralised":
    loss = {l: json.load(open(f"{src}/eval-{l}.json"))["val_loss"] for l in langs}
    row.update(kernel_wan_bytes=0, payload_bytes=0, digests_agree=None)
    init = f"{src}/init.safetensors"
else:
    s = json.load(open(src))
    loss = s["sites"]["A"]["val_loss_sets"]
    init = os.path.join(os.path.dirname(src), "init.safetensors")
    sync = json.load(open(os.path.join(os.path.dirname(src), "sync-A.json")))
    codecs = sorted({m.group(1) for r in sync for j in r.get("jobs", [])
                     for m in [re.search(r"codec (\S+)", j.get("detail", ""))] if m})
    # Two sites: the WAN veth's kernel counters; three (on loopback): the sites' own count.
    counted = "kernel_wan_bytes" not in s
    row.update(kernel_wan_bytes=s["counted_wan_bytes"] if counted else s["kernel_wan_bytes"],
               bytes_counted_by="sites" if counted else "kernel", payload_bytes=s["payload_bytes"],
               digests_agree=s["digests_agree"], train_seconds=s["train_seconds"],
               last_round_codecs=codecs)
numel_trainable = numel(init)
# Synchronous data parallelism over the WAN: each site sends every other its fp32 gradient
# of every trainable tensor every step (payload only: a lower bound, it favours that
# baseline).
n = config.get("sites", 2)
dense = n * (n - 1) * numel_trainable * 4 * steps
row.update(val_loss=loss, mean_val_loss=sum(loss.values()) / len(loss),
           numel_trainable=numel_trainable, dense_per_step_bytes=dense,
           x_fewer_than_dense_per_step=dense / row["kernel_wan_bytes"] if row["kernel_wan_bytes"] else None)
central = [json.loads(l) for l in open(results) if l.strip()]
central = [r for r in central if r["kind"] == "centralised" and r["steps"] == steps
           and r.get("data_seed", 0) == config.get("data_seed", 0)
           and r.get("sites", 2) == config.get("sites", 2)]
if central or config["kind"] == "centralised":
    c = central[-1]["val_loss"] if central else loss
    rel = {l: (loss[l] / c[l] - 1) * 100 for l in langs}
    row.update(rel_loss_vs_centralised_pct=rel, worst_rel_gap_pct=max(rel.values()))
row["wall_seconds"] = int(wall)
print(json.dumps(row))
x = row["x_fewer_than_dense_per_step"]
print(f"study: {key}: mean val loss {row['mean_val_loss']:.4f}, worst gap vs centralised "
      f"{row.get('worst_rel_gap_pct', float('nan')):+.2f}%, {row['kernel_wan_bytes']:,} wire bytes"
      + (f" ({x:,.0f}x fewer than dense per-step)" if x else "") + f", {wall} s", file=sys.stderr)
PY
) && echo "$line" >> "$results"
}

# The centralised baseline.
key="$tkey/centralised"
if done_already "$key"; then
  echo "study: skip $key (in $results)"
else
  echo "study: $key: one process, batch $((16 * nsites)), $steps steps ($(date +%T))"
  c="$out/runs/centralised"
  [ "$seed" -ne 0 ] && c="$c-s$seed"
  mkdir -p "$c"
  t0=$(date +%s)
  # shellcheck disable=SC2086
  "$worker" init $model --base "$base" --out "$c/init.safetensors" >/dev/null 2>&1
  # shellcheck disable=SC2086
  "$worker" train --standalone $model $train --batch-size $((16 * nsites)) --base "$base" \
    --init "$c/init.safetensors" --data demo-out/data/all --no-progress --log-every 100 \
    --save "$c/final.safetensors" > "$c/train.log" 2>&1
  for l in "${langs[@]}"; do
    # shellcheck disable=SC2086
    "$worker" eval $model --base "$base" --trainable "$c/final.safetensors" \
      --data "demo-out/data/lang-$l" --batches 32 --json > "$c/eval-$l.json" 2>/dev/null
  done
  record "$key" $(( $(date +%s) - t0 )) "{\"kind\": \"centralised\", \"data_seed\": $seed, \"sites\": $nsites}" "$c"
fi

# One two-site point: codec (a fixed pipeline; "default": topk:0.05+int2+zstd, the default
# before int2:256+zstd; "adaptive": from dense down to a sparse pipeline; "defaults": the
# server's codec settings), H, outer (see --points).
n=0 total=0
run_point() {
  local codec="$1" h="$2" outer="$3" key="$tkey/$1/H$2/$3/k$rounds_ahead" rate=100mbit flags=() olr omom t0
  local wtrain="$train --batch-size 8"
  local data_a=demo-out/data/A data_b=demo-out/data/B
  local merge=${merge_after:-$(( h / 10 > 0 ? h / 10 : 1 ))} policy=after wait_flag=""
  if [ "$merge_wait" = true ] || [ "$merge" -eq 0 ]; then policy=merge; fi
  [ "$merge_wait" = true ] && wait_flag=" --merge-wait"
  if [ "$overlap" = true ]; then
    key="$key/overlap/$policy$merge" wtrain="$wtrain --overlap --merge-after-steps $merge$wait_flag"
  else
    wtrain="$wtrain --no-overlap"
  fi
  if [ "$swap" = true ]; then key="$key/swapped" data_a=demo-out/data/B data_b=demo-out/data/A; fi
  n=$((n + 1))
  if [ $((steps % h)) -ne 0 ]; then echo "study: [$n/$total] skip $key: H does not divide T"; return; fi
  if done_already "$key"; then echo "study: [$n/$total] skip $key"; return; fi
  case "$codec" in
    defaults) ;;
    default) flags=(--codec topk:0.05+int2+zstd --no-adaptive) ;;
    adaptive) rate=200kbit flags=(--adaptive --adaptive-ceiling dense --adaptive-floor topk:0.002+int2+zstd) ;;
    *) flags=(--codec "$codec" --no-adaptive) ;;
  esac
  local outer_args=()
  case "$outer" in
    defaults) olr=$(server_default outer_lr) omom=$(server_default outer_momentum) ;;
    avg) olr=1.0 omom=0.0 ;;
    nesterov) olr=0.7 omom=0.9 ;;
    lr*m*) olr=${outer#lr} omom=${olr#*m} olr=${olr%m*} ;;
    lr*) olr=${outer#lr} omom=0.0 ;;
    *) echo "study: $key: unknown outer optimiser '$outer' (avg, nesterov, lrX, lrXmY, defaults)"; return ;;
  esac
  [ "$outer" = defaults ] || outer_args=(--outer-lr "$olr" --outer-momentum "$omom")
  local third=() rate_args=(--wan-rate "$rate")
  if [ "$nsites" -eq 3 ]; then third=(--data-c demo-out/data/all) rate_args=() rate=loopback; fi
  local name="${key//[\/:+]/_}"
  echo "study: [$n/$total] $key: $((steps / h)) rounds, ${flags[*]} WAN $rate ($(date +%T))"
  t0=$(date +%s)
  if ! deploy/two-site.sh --base "$base" --data-a "$data_a" --data-b "$data_b" \
      --model "$model" --train "$wtrain" --rounds $((steps / h)) \
      --steps-per-round "$h" "${outer_args[@]}" "${flags[@]}" \
      "${third[@]}" "${rate_args[@]}" "${eval_sets[@]}" --eval-batches 32 --out "$out/current" \
      --summary "$out/current/summary.json" > "$out/runs/$name.log" 2>&1; then
    echo "study: $key: two-site.sh failed (log: $out/runs/$name.log)"
  fi
  if [ ! -f "$out/current/summary.json" ]; then echo "study: $key: no summary, not recorded"; return; fi
  cp "$out/current/summary.json" "$out/runs/$name.json"
  record "$key" $(( $(date +%s) - t0 )) "$(printf '{"kind": "two-site", "codec": "%s", "H": %d, "rounds": %d, "outer": "%s", "outer_lr": %s, "outer_momentum": %s, "max_rounds_ahead": %d, "wan_rate": "%s", "flags": "%s", "data_seed": %d, "overlap": %s, "merge_after_steps": %d, "merge_wait": %s, "swapped": %s, "sites": %d}' \
    "$codec" "$h" $((steps / h)) "$outer" "$olr" "$omom" "$rounds_ahead" "$rate" "${flags[*]}" "$seed" "$overlap" "$merge" "$merge_wait" "$swap" "$nsites")" "$out/current/summary.json"
}

# Every codec x H with plain averaging, then Nesterov (DiLoCo's 0.7 / 0.9) for every H with
# the default pipeline and with the sparse pipeline whose averaging points came closer to
# the centralised loss (the smaller mean over H of the worst per-language gap).
if [ -n "$points" ]; then
  read -ra pts <<< "$points"
  total=${#pts[@]}
  for p in "${pts[@]}"; do
    IFS=/ read -r c h o <<< "$p"
    run_point "$c" "$h" "$o"
  done
  echo "study: done; $(wc -l < "$results") points in $results"
  exit 0
fi
hs=(10 20 50 100) codecs=(dense int8+zstd default topk:0.01+int2+zstd topk:0.002+int2+zstd adaptive)
[ "$quick" = true ] && hs=(20)
total=$(( ${#hs[@]} * (${#codecs[@]} + 2) ))
for h in "${hs[@]}"; do
  for c in "${codecs[@]}"; do run_point "$c" "$h" avg; done
done
sparse=$(/usr/bin/python3 - "$results" "$steps" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
gap = {}
for c in ["topk:0.01+int2+zstd", "topk:0.002+int2+zstd"]:
    g = [r["worst_rel_gap_pct"] for r in rows if r.get("codec") == c and r.get("outer") == "avg"
         and r["steps"] == int(sys.argv[2]) and "worst_rel_gap_pct" in r]
    gap[c] = sum(g) / len(g) if g else float("inf")
print(min(gap, key=gap.get))
PY
)
echo "study: Nesterov runs with default and $sparse"
for h in "${hs[@]}"; do
  for c in default "$sparse"; do run_point "$c" "$h" nesterov; done
done
echo "study: done; $(wc -l < "$results") points in $results (plot: bench/study/plot.py --results $results)"
