#!/usr/bin/env bash
# The translation task of the study (issue 26): does a student distilled from a larger
# teacher translate better than the same student trained on the references alone?
#   data     isthmus-data parallel --lang LANGS (the machine's gettext catalogues), one
#            example per --seq-len window, the held-out pairs by message id
#   teacher  a larger model (--teacher-model, full mode) trained on the pairs for
#            --teacher-steps, or --teacher FILE; isthmus-worker teach writes its top --k
#            logits beside the training shard once
#   students the smaller --student-model in full mode, --steps steps each, for every seed:
#            "ce" (cross-entropy on the references) and "kd" (--distill-alpha A
#            --distill-temperature T with the teacher's cache); same data order, same init
# Each run is scored on the validation shard (cross-entropy, isthmus-worker eval) and by
# chrF (deploy/chrf.py, NLTK) of greedy translations (generate --translate) of the first
# --lines held-out pairs of each language. One JSON line per run goes to OUT/results.jsonl
# (runs already there are skipped, so an interrupted study resumes), and a table of the
# mean and spread over the seeds is printed at the end.
#
# Usage: bench/study/distill.sh [--quick] [options]
#   --langs L          languages (default de)
#   --seq-len T        example length and context (default 128)
#   --teacher-model M  "LAYERSxWIDTH" (default 4x256); --teacher-steps N (default 1500)
#   --teacher FILE     use this trained teacher instead (a base file of the same vocabulary)
#   --student-model M  "LAYERSxWIDTH" (default 2x128); --steps N (default 800)
#   --seeds "S ..."    model and data seeds of the students (default "1 2 3")
#   --k K              teacher logits kept per position (default 16)
#   --alpha A          --distill-alpha (default 0.5); --temperature T (default 2)
#   --lr X             students' and teacher's peak learning rate (default 1e-3)
#   --lines N          held-out lines translated per language (default 200)
#   --out DIR          results folder (default demo-out/study-distill)
#   --quick            smoke test: 60 teacher steps, 40 student steps, 20 lines, one seed
# Environment: ISTHMUS_BUILD_DIR (default build); OMP_NUM_THREADS as you like.
set -euo pipefail
cd "$(dirname "$0")/../.."
build="${ISTHMUS_BUILD_DIR:-build}"
worker="$build/worker/isthmus-worker"
data="$build/worker/data/isthmus-data"
langs=de seq_len=128 teacher_model=4x256 teacher_steps=1500 teacher="" student_model=2x128
steps=800 seeds="1 2 3" k=16 alpha=0.5 temperature=2 lr=1e-3 lines=200 out=demo-out/study-distill
quick=false
while [ $# -gt 0 ]; do
  case "$1" in
    --langs) langs="$2"; shift 2 ;;
    --seq-len) seq_len="$2"; shift 2 ;;
    --teacher-model) teacher_model="$2"; shift 2 ;;
    --teacher-steps) teacher_steps="$2"; shift 2 ;;
    --teacher) teacher="$2"; shift 2 ;;
    --student-model) student_model="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    --seeds) seeds="$2"; shift 2 ;;
    --k) k="$2"; shift 2 ;;
    --alpha) alpha="$2"; shift 2 ;;
    --temperature) temperature="$2"; shift 2 ;;
    --lr) lr="$2"; shift 2 ;;
    --lines) lines="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --quick) quick=true; shift ;;
    -h|--help) sed -n 2,31p "$0"; exit 0 ;;
    *) echo "distill.sh: unknown option '$1' (try --help)" >&2; exit 2 ;;
  esac
done
if [ "$quick" = true ]; then
  teacher_steps=60 steps=40 lines=20 seeds=1 out=demo-out/study-distill-quick
fi
for b in "$worker" "$data"; do
  [ -x "$b" ] || { echo "distill.sh: $b is not built (cmake --build $build)" >&2; exit 2; }
done
shape() {  # "LxW" -> model flags
  local l=${1%x*} w=${1#*x}
  echo "--layers $l --width $w --heads 4 --context $seq_len --mode full"
}
mkdir -p "$out"
results="$out/results.jsonl"
touch "$results"

if [ ! -f "$out/task/manifest.json" ]; then
  "$data" parallel --lang "$langs" --out "$out/task" --seq-len "$seq_len" --val-fraction 0.05 |
    tee "$out/parallel.txt"
fi
if [ -z "$teacher" ]; then
  teacher="$out/teacher-$teacher_model-$teacher_steps.safetensors"
  if [ ! -f "$teacher" ]; then
    echo "distill.sh: training the teacher ($teacher_model, $teacher_steps steps)"
    # shellcheck disable=SC2046
    "$worker" train --standalone $(shape "$teacher_model") --data "$out/task" \
      --max-steps "$teacher_steps" --batch-size 16 --lr "$lr" --warmup-steps 50 --seed 7 \
      --no-progress --log-every 100 --save "$teacher" > "$out/teacher.log" 2>&1
  fi
fi
teacher_id=$(basename "$teacher" .safetensors)
cache="$out/task/train.topk"
if [ ! -f "$out/teach-$teacher_id-k$k.done" ]; then
  "$worker" teach --base "$teacher" --data "$out/task" --k "$k" --batch-size 16 2>&1 | tail -1
  touch "$out/teach-$teacher_id-k$k.done"
fi

# score NAME MODEL_FILE: validation loss and chrF per language, as a JSON object.
# shellcheck source=bench/study/chrf.sh
. bench/study/chrf.sh
score() {
  local name=$1 model=$2 val
  val=$("$worker" eval --base "$model" --data "$out/task" --batches 64 --batch-size 16 --json 2>/dev/null |
    /usr/bin/python3 -c 'import json, sys; print(json.load(sys.stdin)["val_loss"])')
  echo "{\"val_loss\": $val, \"chrf\": $(chrf_json "$out/task" "$langs" "$lines" "$out/$name" --base "$model")}"
}

key_base="$langs/T$seq_len/$teacher_id/k$k/s$student_model/$steps"
for seed in $seeds; do
  for variant in ce kd; do
    suffix=""
    [ "$variant" = ce ] || suffix="-a$alpha-t$temperature"
    key="$key_base/$variant$suffix/seed$seed"
    if grep -qF "\"key\": \"$key\"" "$results"; then continue; fi
    name="student-$variant-seed$seed"
    flags=()
    if [ "$variant" = kd ]; then
      flags=(--teacher-topk "$cache" --distill-alpha "$alpha" --distill-temperature "$temperature")
    fi
    start=$(date +%s)
    # shellcheck disable=SC2046
    "$worker" train --standalone $(shape "$student_model") --data "$out/task" \
      --max-steps "$steps" --batch-size 16 --lr "$lr" --warmup-steps 50 --seed "$seed" \
      --data-seed "$seed" --no-progress --log-every 100 --save "$out/$name.safetensors" \
      "${flags[@]}" > "$out/$name.log" 2>&1
    seconds=$(($(date +%s) - start))
    s=$(score "$name" "$out/$name.safetensors")
    echo "{\"key\": \"$key\", \"variant\": \"$variant\", \"seed\": $seed, \"train_s\": $seconds, \"score\": $s}" >> "$results"
    echo "distill.sh: $key $s"
  done
done

/usr/bin/python3 - "$results" "$key_base" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
rows = [r for r in rows if r["key"].startswith(sys.argv[2] + "/")]
by = {}
for r in rows:
    by.setdefault(r["key"].split("/")[-2], []).append(r)
def stat(xs):
    m = statistics.mean(xs)
    return f"{m:.3f} (n={len(xs)}, {min(xs):.3f}-{max(xs):.3f})"
print(f"\n{sys.argv[2]}")
for variant, rs in sorted(by.items()):
    print(f"  {variant:<16} val loss {stat([r['score']['val_loss'] for r in rs])}")
    for lang in rs[0]["score"]["chrf"]:
        print(f"  {'':<16} chrF {lang}  {stat([r['score']['chrf'][lang] for r in rs])}")
PY
