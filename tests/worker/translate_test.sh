#!/usr/bin/env bash
# The translation task end to end on the CPU: gettext catalogues this test writes (German,
# 120 messages), `isthmus-data parallel`, a tiny model trained on it (standalone, full
# mode), `isthmus-worker generate --translate` of one line and of the held-out file,
# deploy/chrf.py's scores (NLTK), and sequence-level distillation (the model's translations
# of the training pairs as a student's targets, isthmus-data parallel --teacher-targets). Checks the output's shape (one line per held-out pair,
# the source and reference carried, no translation running past its end), that chrF is
# 100 for the references themselves and below for the model, and the refusals of
# --input without --translate, of a file that is not JSON lines and of chrf.py on bad input.
# Usage: translate_test.sh BUILD_DIR
set -euo pipefail
build=$(cd "$1" && pwd)
root=$(cd "$(dirname "$0")/../.." && pwd)
worker="$build/worker/isthmus-worker"
data="$build/worker/data/isthmus-data"
for b in "$worker" "$data"; do [ -x "$b" ] || { echo "FAIL: $b is not built"; exit 1; }; done
/usr/bin/python3 -c "import nltk" 2>/dev/null ||
  { echo "FAIL: python3-nltk is missing (deploy/install-deps.sh installs it)"; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
fail() { echo "FAIL: $*"; exit 1; }

# 120 numbered German messages (tests/data/write_mo.py --german writes the .mo).
mkdir -p "$work/locale/de/LC_MESSAGES"
/usr/bin/python3 "$root/tests/data/write_mo.py" "$work/locale/de/LC_MESSAGES/test.mo" --german 120
"$data" parallel --locale-dir "$work/locale" --lang de --out "$work/task" --seq-len 64 \
  --val-fraction 0.1 > "$work/parallel.txt" || { cat "$work/parallel.txt"; fail "parallel"; }
heldout=$(wc -l < "$work/task/heldout-de.jsonl")
[ "$heldout" -ge 3 ] || fail "only $heldout held-out pairs"

model="--layers 1 --width 64 --heads 2 --context 64 --mode full"
# shellcheck disable=SC2086
"$worker" train --standalone $model --data "$work/task" --max-steps 60 --batch-size 8 \
  --lr 3e-3 --warmup-steps 5 --save "$work/model.safetensors" > "$work/train.txt" 2>&1 ||
  { tail "$work/train.txt"; fail "training on the translation shards"; }

one=$("$worker" generate --base "$work/model.safetensors" --translate de --prompt "Open key 5" \
  --tokens 40 2>/dev/null) || fail "generate --translate of one line"
case "$one" in *$'\n\n'*) fail "the translation runs past its end: '$one'" ;; esac

"$worker" generate --base "$work/model.safetensors" --translate de --tokens 40 \
  --input "$work/task/heldout-de.jsonl" --output "$work/out.jsonl" 2> "$work/gen.txt" ||
  { cat "$work/gen.txt"; fail "generate --translate --input"; }
grep -q "translated $heldout lines into de" "$work/gen.txt" || { cat "$work/gen.txt"; fail "summary"; }
/usr/bin/python3 - "$work/task/heldout-de.jsonl" "$work/out.jsonl" <<'PY' || fail "output lines"
import json, sys
given = [json.loads(l) for l in open(sys.argv[1])]
out = [json.loads(l) for l in open(sys.argv[2])]
assert len(given) == len(out), (len(given), len(out))
for g, o in zip(given, out):
    assert o["source"] == g["source"] and o["reference"] == g["target"], o
    assert isinstance(o["translation"], str) and "\n\n" not in o["translation"], o
PY

score=$(/usr/bin/python3 "$root/deploy/chrf.py" --json "$work/out.jsonl")
/usr/bin/python3 - "$work/out.jsonl" "$work/perfect.jsonl" <<'PY'
import json, sys
with open(sys.argv[2], "w") as f:
    for line in open(sys.argv[1]):
        row = json.loads(line)
        row["translation"] = row["reference"]
        f.write(json.dumps(row) + "\n")
PY
perfect=$(/usr/bin/python3 "$root/deploy/chrf.py" --json "$work/perfect.jsonl")
echo "model: $score"
echo "references: $perfect"
/usr/bin/python3 -c "
import json, sys
m, p = json.loads(sys.argv[1]), json.loads(sys.argv[2])
assert p['chrf'] == 100.0, p
assert 0 <= m['chrf'] < 100.0 and m['lines'] == int(sys.argv[3]), m
" "$score" "$perfect" "$heldout" || fail "chrF scores"

# Sequence-level distillation: the model above as the teacher of its own training pairs,
# its translations as a student's targets.
"$worker" generate --base "$work/model.safetensors" --translate de --tokens 24 \
  --input "$work/task/train-de.jsonl" --output "$work/teacher.jsonl" 2>/dev/null ||
  fail "the teacher's translations"
"$data" parallel --locale-dir "$work/locale" --lang de --out "$work/taught" --seq-len 64 \
  --val-fraction 0.1 --teacher-targets "de=$work/teacher.jsonl" > "$work/taught.txt" ||
  { cat "$work/taught.txt"; fail "parallel --teacher-targets"; }
grep -q "training targets are the teacher's translations" "$work/taught.txt" ||
  { cat "$work/taught.txt"; fail "no teacher targets reported"; }
cmp -s "$work/task/val.bin" "$work/taught/val.bin" || fail "the held-out shard changed"
# shellcheck disable=SC2086
"$worker" train --standalone $model --data "$work/taught" --max-steps 10 --batch-size 8 \
  > "$work/student.txt" 2>&1 || { tail "$work/student.txt"; fail "training the student"; }

# Refusals.
if "$worker" generate --base "$work/model.safetensors" --input "$work/task/heldout-de.jsonl" \
  > "$work/r1.txt" 2>&1; then fail "--input without --translate ran"; fi
grep -q "give --translate LANGUAGE too" "$work/r1.txt" || { cat "$work/r1.txt"; fail "message 1"; }
echo "not json" > "$work/bad.jsonl"
if "$worker" generate --base "$work/model.safetensors" --translate de --input "$work/bad.jsonl" \
  > "$work/r2.txt" 2>&1; then fail "a file that is not JSON lines was translated"; fi
grep -q "bad.jsonl line 1: not a JSON object" "$work/r2.txt" || { cat "$work/r2.txt"; fail "message 2"; }
if /usr/bin/python3 "$root/deploy/chrf.py" "$work/bad.jsonl" > "$work/r3.txt" 2>&1; then
  fail "chrf.py scored a file that is not JSON lines"
fi
grep -q "bad.jsonl" "$work/r3.txt" || { cat "$work/r3.txt"; fail "message 3"; }
# shellcheck disable=SC2086
if "$worker" train --standalone $model --data "$work/task" --max-steps 2 --batch-size 8 \
  --translate-set "de=$work/task/heldout-de.jsonl" > "$work/r4.txt" 2>&1; then
  fail "--translate-set without --events and --eval-every-rounds ran"
fi
grep -q "translate-set needs --eval-every-rounds N (N >= 1) and --events FILE" "$work/r4.txt" ||
  { cat "$work/r4.txt"; fail "message 4"; }
# shellcheck disable=SC2086
if "$worker" train --standalone $model --data "$work/task" --max-steps 2 --batch-size 8 \
  --eval-every-rounds 1 --events "$work/ev.jsonl" --translate-set "de=$work/missing.jsonl" \
  > "$work/r5.txt" 2>&1; then fail "a missing --translate-set file was accepted"; fi
grep -q "translate-set: .*missing.jsonl: cannot open" "$work/r5.txt" || { cat "$work/r5.txt"; fail "message 5"; }
echo "PASS: translation task, generate --translate and chrF"
