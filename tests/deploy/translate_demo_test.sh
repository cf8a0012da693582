#!/usr/bin/env bash
# deploy/translate-demo.sh on catalogues the test writes (English -> German at site A,
# English -> Spanish at site B, 80 messages each) and a random base: both sites build their
# task shards, the base is scored, two rounds of LoRA fine-tuning commit on both sites with
# equal digests, and each site's committed model is scored on both languages' held-out
# pairs. With --teacher (the base) and --teacher-rounds 1 it first fine-tunes the teacher's
# adapters across the sites (one round, exported by two-site.sh --export), writes each
# site's top-k cache of that fine-tuned teacher (isthmus-worker teach --trainable) and runs
# the CE-only students beside the distilled ones. --sites passes a two-site.sh flag
# (synchronous rounds, K = 0) to all three runs.
# Checks the summary (chrF before, and per site and language after CE-only and distilled
# fine-tuning, in [0, 100]), that the distilled workers read their own site's cache, and
# the printed table; and chrF by round in the run report (the workers' --translate-set after
# every round, deploy/report.py's chrf.png and its series for both sites and languages).
# Usage: translate_demo_test.sh BUILD_DIR
set -euo pipefail
build=$(cd "$1" && pwd)
root=$(cd "$(dirname "$0")/../.." && pwd)
for b in server/isthmus-server server/isthmusctl worker/isthmus-worker worker/data/isthmus-data; do
  [ -x "$build/$b" ] || { echo "FAIL: $build/$b is not built"; exit 1; }
done
/usr/bin/python3 -c "import nltk" 2>/dev/null ||
  { echo "FAIL: python3-nltk is missing (deploy/install-deps.sh installs it)"; exit 1; }
work=$(mktemp -d)
trap '[ -n "${KEEP:-}" ] || rm -rf "$work"' EXIT
for lang in de es; do
  mkdir -p "$work/locale/$lang/LC_MESSAGES"
  /usr/bin/python3 -c '
import json, sys
word = {"de": "Zeile", "es": "Fila"}[sys.argv[1]]
print(json.dumps({f"Row {i}": f"{word} {i}" for i in range(80)}))
' "$lang" | /usr/bin/python3 "$root/tests/data/write_mo.py" "$work/locale/$lang/LC_MESSAGES/t.mo"
done
model="--layers 1 --width 64 --heads 2 --context 48 --lora-rank 4 --lora-alpha 8"
# shellcheck disable=SC2086
"$build/worker/isthmus-worker" init $model --out "$work/unused.safetensors" \
  --write-base "$work/base.safetensors" >/dev/null 2>&1

set +e
ISTHMUS_BUILD_DIR="$build" "$root/deploy/translate-demo.sh" --base "$work/base.safetensors" \
  --locale-dir "$work/locale" --site-a de --site-b es --seq-len 48 --model "$model" \
  --rounds 2 --steps-per-round 5 --lines 6 --val-fraction 0.4 --train "--lr 1e-3 --batch-size 4" \
  --teacher "$work/base.safetensors" --teacher-rounds 1 --teacher-k 8 --eval-every-rounds 1 \
  --round-lines 3 --sites "--max-rounds-ahead 0" \
  --out "$work/out" > "$work/demo.txt" 2>&1
rc=$?
set -e
if [ "$rc" -ne 0 ]; then
  tail -40 "$work/demo.txt"
  tail -n 5 "$work"/out/run/logs/* 2>/dev/null | tail -60
  echo "FAIL: translate-demo.sh exited $rc"; exit 1
fi
/usr/bin/python3 - "$work/out/summary.json" <<'PY' || { tail -20 "$work/demo.txt"; exit 1; }
import json, sys
s = json.load(open(sys.argv[1]))
assert s["digests_agree"] and s["rounds_verified"] >= 2, s
assert set(s["chrf_before"]) == {"de", "es"}, s["chrf_before"]
for site in ("A", "B"):
    r = s["sites"][site]
    assert r["committed_round"] >= 2, r
    assert set(r["chrf"]) == {"de", "es"} and set(r["chrf_ce"]) == {"de", "es"}, r
    for v in list(r["chrf"].values()) + list(r["chrf_ce"].values()) + list(s["chrf_before"].values()):
        assert isinstance(v, float) and 0.0 <= v <= 100.0, v
assert set(s["chrf_teacher"]) == {"de", "es"}, s.get("chrf_teacher")
assert s["translate_lines"] == {"de": 6, "es": 6} or all(
    0 < n <= 6 for n in s["translate_lines"].values()), s["translate_lines"]
PY
# --sites reaches every two-site run's shards.
for run in run-teacher run-ce run; do
  grep -qx "max_rounds_ahead = 0" "$work/out/$run/A-0.toml" ||
    { echo "FAIL: --sites did not reach $run's shards"; exit 1; }
done
grep -E "^de +A " "$work/demo.txt" >/dev/null || { tail -8 "$work/demo.txt"; echo "FAIL: no row for de"; exit 1; }
grep -E "^es +B " "$work/demo.txt" >/dev/null || { tail -8 "$work/demo.txt"; echo "FAIL: no row for es"; exit 1; }
grep -q "^the teacher, fine-tuned across the sites first" "$work/demo.txt" ||
  { tail -8 "$work/demo.txt"; echo "FAIL: no teacher line"; exit 1; }
for site in A B; do
  # The cache records its teacher: the base with the tensors the teacher's run exported.
  head -c 4096 "$work/out/task-$site/train.topk" |
    grep -aq "trainable $work/out/run-teacher/trainable-A.safetensors" ||
    { echo "FAIL: site $site's cache is not of the fine-tuned teacher"; exit 1; }
  grep -q "distilling from $work/out/task-$site/train.topk (k 8, alpha 0.5" \
    "$work/out/run/logs/worker-$site-0.log" || { echo "FAIL: site $site did not distil"; exit 1; }
  if grep -q "distilling" "$work/out/run-ce/logs/worker-$site-0.log"; then
    echo "FAIL: the CE-only run at $site distilled"; exit 1
  fi
done
[ -s "$work/out/run/report/chrf.png" ] || { echo "FAIL: no chrF plot in the run report"; exit 1; }
/usr/bin/python3 - "$work/out/run/report/report.json" <<'PY' || exit 1
import json, sys
series = json.load(open(sys.argv[1]))["series"]["chrf"]
assert set(series) == {"A/de", "A/es", "B/de", "B/es"}, series.keys()
for name, pts in series.items():
    assert [p["round"] for p in pts] == [1, 2], (name, pts)
    assert all(0.0 <= p["chrf"] <= 100.0 for p in pts), (name, pts)
PY
grep -q "distilled A" "$work/demo.txt" || { tail -8 "$work/demo.txt"; echo "FAIL: no distilled column"; exit 1; }
tail -4 "$work/demo.txt"
echo "PASS: translation fine-tuning across two sites, CE-only and distilled, scored before and after"
