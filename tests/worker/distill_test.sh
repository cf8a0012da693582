#!/usr/bin/env bash
# Word-level distillation end to end on the CPU: a task shard (isthmus-data parallel on
# gettext catalogues this test writes), a teacher trained on it, `isthmus-worker teach`
# writing its top-k logits beside the shard, and students trained with --teacher-topk.
# Checks: the cache's size is what its positions and k need; a student with alpha 1 trains
# exactly as the cross-entropy-only student (same validation loss, to the last digit) while
# alpha 0.5 trains differently; grad-accum with a teacher runs; and the refusals: a cache of
# another shard (its digest), a teacher or student of another vocabulary (both named), a
# cache cut short, and a record with a repeated id (found at the step that reads it).
# Usage: distill_test.sh BUILD_DIR
set -euo pipefail
build=$(cd "$1" && pwd)
root=$(cd "$(dirname "$0")/../.." && pwd)
worker="$build/worker/isthmus-worker"
data="$build/worker/data/isthmus-data"
for b in "$worker" "$data"; do [ -x "$b" ] || { echo "FAIL: $b is not built"; exit 1; }; done
work=$(mktemp -d)
trap '[ -n "${KEEP:-}" ] || rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
fail() { echo "FAIL: $*"; exit 1; }

mkdir -p "$work/locale/de/LC_MESSAGES"
/usr/bin/python3 "$root/tests/data/write_mo.py" "$work/locale/de/LC_MESSAGES/test.mo" --german 120
for seed in 0 1; do
  "$data" parallel --locale-dir "$work/locale" --lang de --out "$work/task$seed" --seq-len 64 \
    --val-fraction 0.1 --seed $seed > "$work/parallel$seed.txt" ||
    { cat "$work/parallel$seed.txt"; fail "parallel"; }
done
task="$work/task0"

model="--layers 1 --width 64 --heads 2 --context 64 --mode full"
# shellcheck disable=SC2086
"$worker" train --standalone $model --data "$task" --max-steps 40 --batch-size 8 --lr 3e-3 \
  --warmup-steps 5 --save "$work/teacher.safetensors" > "$work/teacher.txt" 2>&1 ||
  { tail "$work/teacher.txt"; fail "training the teacher"; }

"$worker" teach --base "$work/teacher.safetensors" --data "$task" --k 16 --batch-size 4 \
  > "$work/teach.txt" 2>&1 || { cat "$work/teach.txt"; fail "teach"; }
grep -q "wrote $task/train.topk" "$work/teach.txt" || { cat "$work/teach.txt"; fail "teach summary"; }
/usr/bin/python3 - "$task/train.topk" <<'PY' || fail "the cache's layout"
import json, struct, sys
raw = open(sys.argv[1], "rb").read()
assert raw[:8] == b"ISTHTOPK", raw[:8]
n = struct.unpack("<I", raw[8:12])[0]
h = json.loads(raw[12:12 + n])
assert h["k"] == 16 and h["vocab_size"] == 256 and h["example_tokens"] == 64, h
assert h["positions"] > 0 and len(raw) == 12 + n + h["positions"] * 16 * 8, (h, len(raw))
ids = struct.unpack("<16i", raw[12 + n:12 + n + 64])
logits = struct.unpack("<16f", raw[12 + n + 64:12 + n + 128])
assert len(set(ids)) == 16 and all(0 <= i < 256 for i in ids), ids
assert list(logits) == sorted(logits, reverse=True), logits
PY

# shellcheck disable=SC2086
student() {  # NAME EXTRA-FLAGS...
  local name=$1
  shift
  "$worker" train --standalone $model --data "${shard:-$task}" --max-steps 12 --batch-size 4 --lr 3e-3 \
    --warmup-steps 2 --seed 9 --json-summary "$work/$name.json" "$@" > "$work/$name.txt" 2>&1
}
student ce || { tail "$work/ce.txt"; fail "the cross-entropy student"; }
student one --teacher-topk "$task/train.topk" --distill-alpha 1 ||
  { tail "$work/one.txt"; fail "the alpha 1 student"; }
grep -q "distilling from $task/train.topk (k 16, alpha 1" "$work/one.txt" ||
  { cat "$work/one.txt"; fail "no distillation reported"; }
student half --teacher-topk "$task/train.topk" --distill-alpha 0.5 --distill-temperature 2 ||
  { tail "$work/half.txt"; fail "the alpha 0.5 student"; }
student accum --teacher-topk "$task/train.topk" --grad-accum 2 ||
  { tail "$work/accum.txt"; fail "the grad-accum student"; }
/usr/bin/python3 - "$work" <<'PY' || fail "the students' validation losses"
import json, sys
v = {n: json.load(open(f"{sys.argv[1]}/{n}.json"))["val_loss"] for n in ("ce", "one", "half", "accum")}
print("validation losses:", v)
assert v["one"] == v["ce"], v          # alpha 1 is the cross-entropy
assert v["half"] != v["ce"], v         # the teacher changed what was learned
assert all(x is not None and x < 5.6 for x in v.values()), v  # log 256 = 5.55 at the start
PY

# The memory plan counts the teacher's rows: 2 x N x k x 8 bytes more (device and host
# copies of k ids and k logits per row), 1 MiB at N = 64 x 64 rows and k 16.
# shellcheck disable=SC2086
plan_mib() {  # EXTRA-FLAGS...: the plan's "activations and batch" MiB
  "$worker" train --plan --standalone $model --batch-size 64 "$@" |
    awk '/activations and batch/ { print $4 }'
}
without=$(plan_mib) with=$(plan_mib --teacher-topk "$task/train.topk")
[ "$(awk -v a="$with" -v b="$without" 'BEGIN { print (a - b >= 0.9 && a - b <= 1.1) }')" = 1 ] ||
  fail "the plan does not count the teacher's rows ($without MiB without, $with with)"
# shellcheck disable=SC2086
if "$worker" train --plan --standalone $model --teacher-topk "$work/none.topk" > "$work/plan.txt" 2>&1; then
  fail "--plan with a missing cache"
fi
grep -q "none.topk: no such file" "$work/plan.txt" || { cat "$work/plan.txt"; fail "message: plan"; }

# Refusals.
if shard="$work/task1" student other --teacher-topk "$task/train.topk"; then
  fail "a cache of another shard was used"
fi
grep -q "computed on another shard" "$work/other.txt" || { cat "$work/other.txt"; fail "message: shard"; }
# A teacher (and a student) of 300 ids: the byte shard's tokenizer has 256.
/usr/bin/python3 - "$work/teacher.safetensors" "$work/wide.safetensors" <<'PY'
import json, struct, sys
raw = open(sys.argv[1], "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
h = json.loads(raw[8:8 + n])
body = raw[8 + n:]
out, blobs, off = {"__metadata__": h.get("__metadata__", {})}, [], 0
out["__metadata__"]["vocab_size"] = "300"
for name, e in h.items():
    if name == "__metadata__":
        continue
    b, end = e["data_offsets"]
    data, shape = body[b:end], list(e["shape"])
    if name.endswith("wte.weight"):
        data += bytes(4 * shape[1] * (300 - shape[0]))
        shape[0] = 300
    out[name] = {"dtype": e["dtype"], "shape": shape, "data_offsets": [off, off + len(data)]}
    blobs.append(data)
    off += len(data)
text = json.dumps(out).encode()
text += b" " * (-len(text) % 8)
open(sys.argv[2], "wb").write(struct.pack("<Q", len(text)) + text + b"".join(blobs))
PY
if "$worker" teach --base "$work/wide.safetensors" --data "$task" --out "$work/wide.topk" \
  > "$work/r1.txt" 2>&1; then fail "a teacher of another vocabulary taught"; fi
grep -q "the teacher's vocabulary (300 ids) is not that of the shard's tokenizer (byte, 256 ids)" \
  "$work/r1.txt" || { cat "$work/r1.txt"; fail "message: teacher vocabulary"; }
if "$worker" train --standalone --base "$work/wide.safetensors" --mode full --data "$task" \
  --max-steps 2 --batch-size 4 --teacher-topk "$task/train.topk" > "$work/r2.txt" 2>&1; then
  fail "a student of another vocabulary trained"
fi
grep -q "the teacher's vocabulary (256 ids, tokenizer byte) is not the student's (300 ids)" \
  "$work/r2.txt" || { cat "$work/r2.txt"; fail "message: student vocabulary"; }
head -c -8 "$task/train.topk" > "$work/cut.topk"
if student cut --teacher-topk "$work/cut.topk"; then fail "a cache cut short was read"; fi
grep -q "cut short or padded" "$work/cut.txt" || { cat "$work/cut.txt"; fail "message: cut"; }
# Every record's second id made equal to its first.
/usr/bin/python3 - "$task/train.topk" "$work/dup.topk" <<'PY'
import struct, sys
raw = bytearray(open(sys.argv[1], "rb").read())
n = struct.unpack("<I", raw[8:12])[0]
start = 12 + n
for r in range(start, len(raw), 16 * 8):
    raw[r + 4:r + 8] = raw[r:r + 4]
open(sys.argv[2], "wb").write(raw)
PY
if student dup --teacher-topk "$work/dup.topk"; then fail "a cache with repeated ids was read"; fi
grep -q "an id out of range or repeated" "$work/dup.txt" || { cat "$work/dup.txt"; fail "message: dup"; }
echo "PASS: teach, distilled students and the cache's refusals"
