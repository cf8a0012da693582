#!/usr/bin/env bash
# The translation task across sites against one place (issue 26): LoRA fine-tuning of the
# pre-trained base of the demo on English -> X message pairs (isthmus-data parallel, the
# machine's gettext catalogues), for every seed:
#   two sites    deploy/translate-demo.sh: site A trains on --site-a's languages, site B on
#                --site-b's, 2 CPU ranks each at --batch-size rows, --rounds rounds of
#                --steps-per-round steps, the default WAN codec over CURVE on loopback
#   centralised  one process on all the languages at once, batch 2 sites x 2 ranks x
#                --batch-size rows, the same steps: the same examples seen, the same
#                compute, with nothing crossing a WAN
# Each model is scored by chrF (deploy/chrf.py, NLTK) of greedy translations (generate
# --translate) of the first --lines held-out pairs of every language (the same pairs for
# all: the split is by English message). A two-site run's sites commit the same model (the
# summary says whether their digests agree): site A's is scored. One JSON line per run
# goes to OUT/results.jsonl (runs already there are skipped, so an interrupted study
# resumes), and the table at the end gives, per language, the mean and spread over the
# seeds and the two sites' chrF as a share of centralised chrF, and the validation loss of
# every model on the same 250 batches of all the languages' held-out examples
# (isthmus-worker eval --batches 250: 2,000 examples in one shuffled order), a measure
# with far less noise than chrF at this scale.
#
# Usage: bench/study/translate.sh [--quick] [options]
#   --base FILE        the model to fine-tune (default demo-out/base/base-2x128-1000.safetensors,
#                      which deploy/demo-prepare.sh pre-trains)
#   --site-a LANGS     site A's languages (default de,fr); --site-b LANGS (default es,it)
#   --rounds N         rounds (default 8); --steps-per-round H (default 20)
#   --batch-size B     rows per rank (default 8); --lr X (default 1e-3)
#   --seeds "S ..."    seeds of the adapters' init and the data order (default "1 2 3")
#   --lines N          held-out lines translated per language (default 200)
#   --sites "FLAGS"    extra deploy/two-site.sh flags for the two-site runs (e.g.
#                      "--max-rounds-ahead 0"); --site-train "FLAGS" extra isthmus-worker train
#                      flags for them (e.g. "--no-overlap"); both name the runs' key, so
#                      variants sit side by side in one results file
#   --out DIR          results folder (default demo-out/study-translate)
#   --quick            smoke test: 2 rounds of 5 steps, 20 lines, one seed
# Environment: ISTHMUS_BUILD_DIR (default build).
set -euo pipefail
cd "$(dirname "$0")/../.."
build="${ISTHMUS_BUILD_DIR:-build}"
worker="$build/worker/isthmus-worker"
data="$build/worker/data/isthmus-data"
base=demo-out/base/base-2x128-1000.safetensors site_a=de,fr site_b=es,it rounds=8 steps=20
batch=8 lr=1e-3 seeds="1 2 3" lines=200 out=demo-out/study-translate quick=false
sites="" site_train="" val_batches=250
while [ $# -gt 0 ]; do
  case "$1" in
    --base) base="$2"; shift 2 ;;
    --site-a) site_a="$2"; shift 2 ;;
    --site-b) site_b="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --steps-per-round) steps="$2"; shift 2 ;;
    --batch-size) batch="$2"; shift 2 ;;
    --lr) lr="$2"; shift 2 ;;
    --seeds) seeds="$2"; shift 2 ;;
    --lines) lines="$2"; shift 2 ;;
    --sites) sites="$2"; shift 2 ;;
    --site-train) site_train="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --quick) quick=true; shift ;;
    -h|--help) sed -n 2,36p "$0"; exit 0 ;;
    *) echo "translate.sh: unknown option '$1' (try --help)" >&2; exit 2 ;;
  esac
done
if [ "$quick" = true ]; then
  rounds=2 steps=5 lines=20 seeds=1 out=demo-out/study-translate-quick
fi
[ -r "$base" ] ||
  { echo "translate.sh: --base $base is not readable (deploy/demo-prepare.sh writes it)" >&2; exit 2; }
for b in "$worker" "$data"; do
  [ -x "$b" ] || { echo "translate.sh: $b is not built (cmake --build $build)" >&2; exit 2; }
done
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
mkdir -p "$out"
results="$out/results.jsonl"
touch "$results"
all_langs="$site_a,$site_b"
model=(--lora-rank 8 --lora-alpha 16)
if [ ! -f "$out/task-all/manifest.json" ]; then
  "$data" parallel --lang "$all_langs" --out "$out/task-all" --seq-len 128 \
    --val-fraction 0.05 > "$out/parallel-all.txt"
fi

# chrf NAME GENERATE-FLAGS...: {"de": chrF, ...} of the model the flags name.
# shellcheck source=bench/study/chrf.sh
. bench/study/chrf.sh
chrf() {
  local name=$1
  shift
  chrf_json "$out/task-all" "$all_langs" "$lines" "$out/$name" "${model[@]}" --base "$base" "$@"
}

# val_loss TRAINABLE: validation loss of the base with these tensors on the first
# $val_batches batches of all the languages' held-out examples.
val_loss() {
  "$worker" eval "${model[@]}" --base "$base" --trainable "$1" --data "$out/task-all" \
    --batches "$val_batches" --json 2> /dev/null |
    /usr/bin/python3 -c 'import json, sys; print(json.load(sys.stdin)["val_loss"])'
}

# The centralised runs depend on the steps in all, not on how they are cut into rounds: every
# two-site variant of the same steps, batch, lr and base shares them.
key_base="$site_a+$site_b/S$((rounds * steps))/b$batch/lr$lr/$(basename "$base" .safetensors)"
key_sites="$site_a+$site_b/R${rounds}xH$steps/b$batch/lr$lr/$(basename "$base" .safetensors)"
[ -z "$sites" ] || key_sites+="/sites:$sites"
[ -z "$site_train" ] || key_sites+="/site-train:$site_train"
for seed in $seeds; do
  key="$key_base/centralised/seed$seed"
  if ! grep -qF "\"key\": \"$key\"" "$results"; then
    start=$(date +%s)
    "$worker" train --standalone "${model[@]}" --base "$base" --data "$out/task-all" \
      --max-steps $((rounds * steps)) --batch-size $((4 * batch)) --lr "$lr" --seed "$seed" \
      --data-seed "$seed" --no-progress --log-every 20 --save "$out/central-seed$seed.safetensors" \
      > "$out/central-seed$seed.log" 2>&1
    seconds=$(($(date +%s) - start))
    s=$(chrf "central-seed$seed" --trainable "$out/central-seed$seed.safetensors")
    v=$(val_loss "$out/central-seed$seed.safetensors")
    echo "{\"key\": \"$key\", \"seed\": $seed, \"train_s\": $seconds, \"chrf\": $s, \"val_loss\": $v}" >> "$results"
    echo "translate.sh: $key $s"
  fi
  key="$key_sites/two-sites/seed$seed"
  run="$out/sites-$(printf '%s' "$key_sites" | sha256sum | cut -c1-8)-seed$seed"
  if ! grep -qF "\"key\": \"$key\"" "$results"; then
    start=$(date +%s)
    deploy/translate-demo.sh --base "$base" --site-a "$site_a" --site-b "$site_b" \
      --rounds "$rounds" --steps-per-round "$steps" --lines "$lines" --before-lines 0 \
      --eval-every-rounds 0 \
      --sites "--translate-sites A --export $sites" \
      --train "--lr $lr --batch-size $batch --seed $seed --data-seed $seed $site_train" \
      --out "$run" > "$run.log" 2>&1 ||
      { tail -20 "$run.log"; echo "translate.sh: the two-site run failed" >&2; exit 1; }
    seconds=$(($(date +%s) - start))
    v=$(val_loss "$run/run/trainable-A.safetensors")
    s=$(/usr/bin/python3 - "$run/summary.json" "$v" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
print(json.dumps({site: s["sites"][site]["chrf"] for site in ("A",)} |
                 {"val_loss": float(sys.argv[2])} |
                 {"wan_bytes": sum(s["sites"][site].get("wan_bytes_sent") or 0 for site in ("A", "B")),
                  "digests_agree": s.get("digests_agree")}))
PY
)
    echo "{\"key\": \"$key\", \"seed\": $seed, \"train_s\": $seconds, \"chrf\": $s}" >> "$results"
    echo "translate.sh: $key $s"
  fi
done

/usr/bin/python3 - "$results" "$key_sites" "$all_langs" "$key_base" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
langs = sys.argv[3].split(",")
central_rows = {r["seed"]: r for r in rows if r["key"].startswith(sys.argv[4] + "/centralised/")}
central = {seed: r["chrf"] for seed, r in central_rows.items()}
sites = {r["seed"]: r["chrf"] for r in rows if r["key"].startswith(sys.argv[2] + "/two-sites/")}
seeds = sorted(set(central) & set(sites))
def stat(xs, f="{:.2f}"):
    return (f.format(statistics.mean(xs)) + f" ({f.format(min(xs))}-{f.format(max(xs))})"
            if xs else "n/a")
print(f"\n{sys.argv[2]}: seeds {seeds}; chrF mean (min-max); two sites: site A's committed model "
      "(site B's is the same when the digests agree); ratio = two sites / centralised, per seed")
print(f"{'en->':<6}{'centralised':>24}{'two sites':>24}{'ratio':>24}")
for l in langs:
    c = [central[s][l] for s in seeds]
    a = [sites[s]["A"][l] for s in seeds]
    r = [x / y for x, y in zip(a, c)]
    print(f"{l:<6}{stat(c):>24}{stat(a):>24}{stat(r, '{:.3f}'):>24}")
if seeds:
    cm = statistics.mean(statistics.mean(central[s][l] for l in langs) for s in seeds)
    am = statistics.mean(statistics.mean(sites[s]["A"][l] for l in langs) for s in seeds)
    print(f"{'mean':<6}{cm:>24.2f}{am:>24.2f}{am / cm:>24.3f}")
    cv = [central_rows[s]["val_loss"] for s in seeds if "val_loss" in central_rows[s]]
    sv = [sites[s]["val_loss"] for s in seeds if "val_loss" in sites[s]]
    print(f"{'val loss':<10}{stat(cv, '{:.4f}'):>20}{stat(sv, '{:.4f}'):>24}"
          f"{(statistics.mean(sv) / statistics.mean(cv)) if cv and sv else float('nan'):>24.4f}")
    print("WAN bytes per two-site run:", [sites[s].get("wan_bytes") for s in seeds],
          "digests agree:", [sites[s].get("digests_agree") for s in seeds])
PY
