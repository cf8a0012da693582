#!/usr/bin/env bash
# The second training phase across two sites: translation fine-tuning (LoRA) of a base
# model on English -> X message pairs from the machine's gettext catalogues, site A holding
# some target languages and site B others (disjoint, like the pre-training demo). Builds
# each site's task shards (isthmus-data parallel), scores the base alone on every
# language's held-out pairs (chrF, deploy/chrf.py), trains with deploy/two-site.sh and
# scores each site's committed model again, printing a table per language: before, after
# at site A, after at site B. Only the adapters' round deltas cross the WAN, as in any job.
#
# Usage: deploy/translate-demo.sh --base BASE.safetensors [options]
#   --base FILE        the model to fine-tune: the pre-trained base of deploy/demo.sh, or any
#                      isthmus base (isthmus-worker init --write-base gives a random one)
#   --site-a LANGS     site A's target languages (default de,fr)
#   --site-b LANGS     site B's target languages (default es,it)
#   --seq-len T        tokens per example; the model's context (default 128)
#   --model "FLAGS"    model flags (default: 2x128, 4 heads, LoRA r8, context T); with a
#                      base file the shape comes from it
#   --rounds N         rounds (default 8); --steps-per-round H (default 20)
#   --lines N          held-out lines translated per language, before and after (default 200)
#   --before-lines N   lines translated by the base alone, before (default: --lines; 0: the
#                      base is not scored, as bench/study/translate.sh runs it every seed)
#   --eval-every-rounds N   the workers also translate the first --round-lines (default 50)
#                      held-out pairs of every language after every Nth round (default 2; 0:
#                      off), and the run report (OUT/run/report/index.html, deploy/report.py)
#                      plots chrF by round
#   --val-fraction F   share of messages held out (default 0.05); the validation shard
#                      needs at least a batch per rank
#   --train "FLAGS"    extra isthmus-worker train flags (default "--lr 1e-3 --batch-size 8")
#   --sites "FLAGS"    extra deploy/two-site.sh flags for every run (e.g. "--max-rounds-ahead 0
#                      --codec dense"; default none: the server's settings)
#   --out DIR          work folder, removed first (default demo-out/translate)
#   --locale-dir DIR   where the catalogues are (default /usr/share/locale)
#   --teacher FILE     also distil: a teacher base (the pre-trained base itself, or a larger
#                      model fine-tuned on the pairs) runs once over each site's training
#                      shard (isthmus-worker teach, top --teacher-k logits, default 32; its
#                      fine-tuned tensors with --teacher-trainable FILE), and a second run
#                      trains the same students with word-level distillation (--distill
#                      "FLAGS", default "--distill-alpha 0.5 --distill-temperature 2"); the
#                      table then shows chrF after CE-only and after distilled fine-tuning
#   --teacher-rounds N with --teacher: first fine-tune the teacher's adapters across the two
#                      sites (N rounds of the same settings, CE only, OUT/run-teacher,
#                      two-site.sh --export), then distil from that fine-tuned teacher (site
#                      A's committed tensors: both sites commit the same)
# Writes OUT/summary.json (two-site.sh's, with "chrf" per site and "chrf_before"; with
# --teacher the distilled run's, plus "chrf_ce" per site from OUT/run-ce; with --teacher-rounds
# "chrf_teacher", the fine-tuned teacher's).
# Environment: ISTHMUS_BUILD_DIR (default build).
set -euo pipefail
cd "$(dirname "$0")/.."
build="${ISTHMUS_BUILD_DIR:-build}"
worker="$build/worker/isthmus-worker"
data="$build/worker/data/isthmus-data"
base="" site_a=de,fr site_b=es,it seq_len=128 model="" rounds=8 steps=20 lines=200 eval_every=2 round_lines=50
before_lines=""
teacher="" teacher_trainable="" teacher_k=32 teacher_rounds=0 distill="--distill-alpha 0.5 --distill-temperature 2"
train="--lr 1e-3 --batch-size 8" sites="" out=demo-out/translate locale=/usr/share/locale val_fraction=0.05
while [ $# -gt 0 ]; do
  case "$1" in
    --base) base="$2"; shift 2 ;;
    --site-a) site_a="$2"; shift 2 ;;
    --site-b) site_b="$2"; shift 2 ;;
    --seq-len) seq_len="$2"; shift 2 ;;
    --model) model="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --steps-per-round) steps="$2"; shift 2 ;;
    --lines) lines="$2"; shift 2 ;;
    --before-lines) before_lines="$2"; shift 2 ;;
    --eval-every-rounds) eval_every="$2"; shift 2 ;;
    --round-lines) round_lines="$2"; shift 2 ;;
    --val-fraction) val_fraction="$2"; shift 2 ;;
    --train) train="$2"; shift 2 ;;
    --sites) sites="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --locale-dir) locale="$2"; shift 2 ;;
    --teacher) teacher="$2"; shift 2 ;;
    --teacher-trainable) teacher_trainable="$2"; shift 2 ;;
    --teacher-k) teacher_k="$2"; shift 2 ;;
    --teacher-rounds) teacher_rounds="$2"; shift 2 ;;
    --distill) distill="$2"; shift 2 ;;
    -h|--help) sed -n 2,47p "$0"; exit 0 ;;
    *) echo "translate-demo.sh: unknown option '$1' (try --help)" >&2; exit 2 ;;
  esac
done
[ -n "$base" ] || { echo "translate-demo.sh: --base is required (try --help)" >&2; exit 2; }
[ -r "$base" ] || { echo "translate-demo.sh: --base $base is not readable" >&2; exit 2; }
if [ -z "$teacher" ] && { [ -n "$teacher_trainable" ] || [ "$teacher_rounds" -gt 0 ]; }; then
  echo "translate-demo.sh: --teacher-trainable and --teacher-rounds need --teacher (its base)" >&2
  exit 2
fi
if [ -n "$teacher_trainable" ] && [ "$teacher_rounds" -gt 0 ]; then
  echo "translate-demo.sh: --teacher-trainable or --teacher-rounds, not both" >&2; exit 2
fi
[ -z "$teacher" ] || [ -r "$teacher" ] ||
  { echo "translate-demo.sh: --teacher $teacher is not readable" >&2; exit 2; }
for b in "$worker" "$data"; do
  [ -x "$b" ] || { echo "translate-demo.sh: $b is not built (cmake --build $build)" >&2; exit 2; }
done
model="${model:---layers 2 --width 128 --heads 4 --context $seq_len --lora-rank 8 --lora-alpha 16}"
# shellcheck disable=SC2206
model_flags=($model)
# shellcheck disable=SC2206
site_flags=($sites)
rm -rf "$out"
mkdir -p "$out"
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE

# The task shards of each site, and every language's held-out pairs.
translate_sets=()
langs=()
for site in A B; do
  list=$site_a
  [ "$site" = B ] && list=$site_b
  "$data" parallel --locale-dir "$locale" --lang "$list" --out "$out/task-$site" \
    --seq-len "$seq_len" --val-fraction "$val_fraction" | tee "$out/parallel-$site.txt"
  IFS=, read -r -a site_langs <<< "$list"
  for l in "${site_langs[@]}"; do
    langs+=("$l")
    translate_sets+=(--translate-set "$l=$out/task-$site/heldout-$l.jsonl")
  done
done

# Before: the base alone (no adapters) on each language's first held-out lines.
echo "{" > "$out/chrf-before.json"
sep=""
before_lines="${before_lines:-$lines}"
for l in "${langs[@]}"; do
  [ "$before_lines" -gt 0 ] || break
  for site in A B; do
    f="$out/task-$site/heldout-$l.jsonl"
    [ -r "$f" ] || continue
    head -n "$before_lines" "$f" > "$out/before-input-$l.jsonl"
    "$worker" generate "${model_flags[@]}" --base "$base" --translate "$l" \
      --input "$out/before-input-$l.jsonl" --output "$out/before-$l.jsonl" 2> "$out/before-$l.log"
    score=$(/usr/bin/python3 deploy/chrf.py --json "$out/before-$l.jsonl" |
      /usr/bin/python3 -c 'import json, sys; print(json.load(sys.stdin)["chrf"])')
    printf '%s"%s": %s' "$sep" "$l" "$score" >> "$out/chrf-before.json"
    sep=", "
  done
done
echo "}" >> "$out/chrf-before.json"

# chrF by round in the run report.
report_flags=()
if [ "$eval_every" -gt 0 ]; then
  report_flags=(--eval-every-rounds "$eval_every" --round-translate-lines "$round_lines")
fi

# With a teacher: its top-k logits beside each site's training shard (they stay there: only
# the students' round deltas cross the WAN), and first the CE-only run to compare with.
run_flags=()
ce_rc=0
if [ -n "$teacher" ]; then
  if [ "$teacher_rounds" -gt 0 ]; then
    deploy/two-site.sh "${site_flags[@]}" --base "$teacher" --data-a "$out/task-A" --data-b "$out/task-B" \
      --model "$model" --rounds "$teacher_rounds" --steps-per-round "$steps" --train "$train" \
      --out "$out/run-teacher" --translate-lines "$lines" "${translate_sets[@]}" --export ||
      { echo "translate-demo.sh: the teacher's run failed (exit $?; its logs: $out/run-teacher/logs)" >&2
        exit 1; }
    teacher_trainable="$out/run-teacher/trainable-A.safetensors"
    [ -r "$teacher_trainable" ] ||
      { echo "translate-demo.sh: the teacher's run exported no tensors" >&2; exit 1; }
  fi
  for site in A B; do
    "$worker" teach --base "$teacher" ${teacher_trainable:+--trainable "$teacher_trainable"} \
      --data "$out/task-$site" --k "$teacher_k" 2>&1 | tail -1
  done
  set +e
  deploy/two-site.sh "${site_flags[@]}" --base "$base" --data-a "$out/task-A" --data-b "$out/task-B" \
    --model "$model" --rounds "$rounds" --steps-per-round "$steps" --train "$train" \
    --out "$out/run-ce" --translate-lines "$lines" "${translate_sets[@]}" "${report_flags[@]}" \
    --report "$out/run-ce/report"
  ce_rc=$?
  set -e
  run_flags=(--distill "$distill")
fi
set +e
deploy/two-site.sh "${site_flags[@]}" --base "$base" --data-a "$out/task-A" --data-b "$out/task-B" \
  --model "$model" --rounds "$rounds" --steps-per-round "$steps" --train "$train" \
  --out "$out/run" --translate-lines "$lines" "${translate_sets[@]}" "${run_flags[@]}" \
  "${report_flags[@]}" --report "$out/run/report"
rc=$?
set -e
[ "$rc" -ne 0 ] || rc=$ce_rc
/usr/bin/python3 - "$out" "$site_a" "$site_b" "${teacher:+distilled}" <<'PY'
import json, os, sys
out, site_a, site_b = sys.argv[1], sys.argv[2].split(","), sys.argv[3].split(",")
distilled = sys.argv[4] == "distilled"
before = json.load(open(f"{out}/chrf-before.json"))
summary = json.load(open(f"{out}/run/summary.json"))
summary["chrf_before"] = before
if distilled and os.path.exists(f"{out}/run-ce/summary.json"):
    ce = json.load(open(f"{out}/run-ce/summary.json"))
    for s in ("A", "B"):
        summary["sites"][s]["chrf_ce"] = ce["sites"][s].get("chrf", {})
if os.path.exists(f"{out}/run-teacher/summary.json"):
    summary["chrf_teacher"] = json.load(open(f"{out}/run-teacher/summary.json"))["sites"]["A"].get("chrf", {})
json.dump(summary, open(f"{out}/summary.json", "w"), indent=2)
fmt = lambda v: f"{v:.2f}" if isinstance(v, (int, float)) else "n/a"
print()
if distilled:
    print(f"{'en->':<6}{'trained at':>11}{'chrF before':>13}{'CE A':>8}{'CE B':>8}"
          f"{'distilled A':>13}{'distilled B':>13}")
else:
    print(f"{'en->':<6}{'trained at':>11}{'chrF before':>13}{'site A':>9}{'site B':>9}")
for lang in site_a + site_b:
    home = "A" if lang in site_a else "B"
    after = {s: summary["sites"][s]["chrf"].get(lang) for s in ("A", "B")}
    row = f"{lang:<6}{home:>11}{fmt(before.get(lang)):>13}"
    if distilled:
        ce = {s: summary["sites"][s].get("chrf_ce", {}).get(lang) for s in ("A", "B")}
        print(row + f"{fmt(ce['A']):>8}{fmt(ce['B']):>8}{fmt(after['A']):>13}{fmt(after['B']):>13}")
    else:
        print(row + f"{fmt(after['A']):>9}{fmt(after['B']):>9}")
if "chrf_teacher" in summary:
    print("the teacher, fine-tuned across the sites first (OUT/run-teacher): " +
          ", ".join(f"{l} {fmt(summary['chrf_teacher'].get(l))}" for l in site_a + site_b))
PY
exit "$rc"
