#!/usr/bin/env bash
# Real sites, real workers: the share of wall time a site's worker spends computing with
# the round boundary serial (--no-overlap) and overlapped (--overlap), both measured in
# the same run. Each case is deploy/two-site.sh: two sites on this machine, real shards
# (RocksDB), real CURVE peer links on loopback (no WAN shaping: bench/wan/run.sh does that
# with synthetic sites), real isthmus-worker processes training the given model on the
# given device (auto: a GPU when one is visible). Per site it reads rank 0's events for
# rounds 3..N:
#   computing = sum of the rounds' step time / (time of round N's end - time of round 2's)
# so the push, the WAN wait, the pull, the merge and the checkpoint all count against it,
# whichever of them the worker waited for. Prints one row per run and case, then the mean
# and spread per case and the ratios to the first case (serial, unless --cases says).
#
# Usage: bench/overlap/run.sh --base BASE.safetensors --data-a DIR --data-b DIR [options]
#   --model "FLAGS"      model flags of every worker (default: the demo's 2x128 LoRA r8;
#                        add --mode full for full mode)
#   --train "FLAGS"      more isthmus-worker train flags (e.g. "--device cuda --batch-size 8")
#   --rounds N           rounds per case (default 8; at least 4)
#   --steps-per-round H  inner steps per round (default 20)
#   --runs R             runs of each case (default 3)
#   --codec PIPELINE     sync.codec (default: the server's default pipeline)
#   --variant "FLAGS"    a third case, "variant": overlapped with these worker flags added
#                        (e.g. "--checkpoint-state-every 4")
#   --cases LIST         the cases to run, in turn within each run, of off (serial), on
#                        (overlapped) and variant (default: "off on", and variant when
#                        --variant is given)
#   --json FILE          write the rows (JSON lines, as each run ends) to FILE, not to
#                        demo-out/bench-overlap/rows.jsonl
# Environment: ISTHMUS_BUILD_DIR (default build), passed to deploy/two-site.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."
model="--layers 2 --width 128 --heads 4 --context 128 --lora-rank 8 --lora-alpha 16"
train="" rounds=8 steps=20 runs=3 codec="" json_out="" base="" data_a="" data_b=""
variant="" cases=""
while [ $# -gt 0 ]; do
  case "$1" in
    --base) base="$2"; shift 2 ;;
    --data-a) data_a="$2"; shift 2 ;;
    --data-b) data_b="$2"; shift 2 ;;
    --model) model="$2"; shift 2 ;;
    --train) train="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --steps-per-round) steps="$2"; shift 2 ;;
    --runs) runs="$2"; shift 2 ;;
    --codec) codec="$2"; shift 2 ;;
    --json) json_out="$2"; shift 2 ;;
    --variant) variant="$2"; shift 2 ;;
    --cases) cases="$2"; shift 2 ;;
    -h|--help) sed -n 2,29p "$0"; exit 0 ;;
    *) echo "overlap/run.sh: unknown option '$1' (try --help)" >&2; exit 2 ;;
  esac
done
for v in base data_a data_b; do
  if [ -z "${!v}" ]; then echo "overlap/run.sh: --${v//_/-} is required (try --help)" >&2; exit 2; fi
done
[ "$rounds" -ge 4 ] || { echo "overlap/run.sh: --rounds must be at least 4 (rounds 3..N are measured)" >&2; exit 2; }
if [ -z "$cases" ]; then
  cases="off on"
  [ -n "$variant" ] && cases="off on variant"
fi
for c in $cases; do
  case "$c" in
    off|on) ;;
    variant) [ -n "$variant" ] || { echo "overlap/run.sh: case 'variant' needs --variant FLAGS" >&2; exit 2; } ;;
    *) echo "overlap/run.sh: unknown case '$c' in --cases (off, on, variant)" >&2; exit 2 ;;
  esac
done
out=demo-out/bench-overlap
mkdir -p "$out"
rows="${json_out:-$out/rows.jsonl}"  # written row by row: a run cut short keeps its rows
: > "$rows"
codec_args=()
[ -n "$codec" ] && codec_args=(--codec "$codec")
for ((run = 1; run <= runs; run++)); do
  for overlap in $cases; do
    flag=--no-overlap
    [ "$overlap" = on ] && flag=--overlap
    [ "$overlap" = variant ] && flag="--overlap $variant"
    dir="$out/run$run-$overlap"
    echo "overlap/run.sh: run $run, overlap $overlap" >&2
    deploy/two-site.sh --out "$dir" --base "$base" --data-a "$data_a" --data-b "$data_b" \
      --model "$model" --train "$train $flag" --rounds "$rounds" --steps-per-round "$steps" \
      --shards 1 --ranks 1 --eval-batches 2 "${codec_args[@]}" > "$dir.log" 2>&1 || {
      echo "overlap/run.sh: deploy/two-site.sh failed; the end of its output:" >&2
      tail -n 30 "$dir.log" >&2
      exit 1
    }
    /usr/bin/python3 - "$dir" "$run" "$overlap" >> "$rows" <<'PY'
import json, sys
folder, run, overlap = sys.argv[1], int(sys.argv[2]), sys.argv[3]
row = {"run": run, "overlap": overlap}
for site in ("A", "B"):
    rounds = [e for e in map(json.loads, open(f"{folder}/events-{site}.jsonl"))
              if e.get("event") == "round"]
    rounds.sort(key=lambda e: e["round"])
    if len(rounds) < 4:
        sys.exit(f"site {site}: {len(rounds)} rounds in its events, need at least 4")
    measured = rounds[2:]
    wall = measured[-1]["time"] - rounds[1]["time"]
    compute = sum(e["compute_s"] for e in measured)
    row[site] = {"computing": compute / wall, "round_wall_s": wall / len(measured),
                 "round_compute_s": compute / len(measured),
                 "blocked_s": sum(e["blocked_s"] for e in measured)}
print(json.dumps(row))
PY
  done
done

/usr/bin/python3 - "$rows" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print("| run | overlap | site | round wall (s) | steps per round (s) | blocked (s) | computing |")
print("|---:|---|---|---:|---:|---:|---:|")
for r in rows:
    for s in ("A", "B"):
        x = r[s]
        print(f"| {r['run']} | {r['overlap']} | {s} | {x['round_wall_s']:.2f} | "
              f"{x['round_compute_s']:.2f} | {x['blocked_s']:.2f} | {100 * x['computing']:.1f}% |")
cases = list(dict.fromkeys(r["overlap"] for r in rows))
by = {o: [r[s]["computing"] for r in rows if r["overlap"] == o for s in ("A", "B")]
      for o in cases}
for o, v in by.items():
    print(f"case {o}: computing mean {100 * statistics.mean(v):.1f}% "
          f"(min {100 * min(v):.1f}%, max {100 * max(v):.1f}%, {len(v)} site-runs)")
for o in cases[1:]:
    print(f"ratio {o} / {cases[0]}: {statistics.mean(by[o]) / statistics.mean(by[cases[0]]):.3f}")
PY
