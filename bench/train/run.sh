#!/bin/sh
# Training throughput, isthmus vs PyTorch, same configs, same run.
#
# --device cpu (default): 4x256 and 6x384 GPT-2 with LoRA r16 on attn.c_attn/attn.c_proj/
# mlp.c_fc/mlp.c_proj, then a Llama-shaped 4x256 (4 heads, 2 kv heads, SwiGLU width 688,
# untied head) with LoRA r16 on all seven linears and in full mode; context 256, batch B
# (default 8), CPU with THREADS threads (default 1). Prints each JSON line and the ratio
# isthmus/torch.
#
# --device cuda: on this machine's GPU, 4x256 (4 heads) context 256 and 12x768 (12 heads)
# context 1024, batch B, LoRA (r16, alpha 32) and full training; isthmus bf16 and fp32
# against torch eager fp32 (manual attention), torch bf16 + sdpa and torch bf16 + sdpa +
# torch.compile. Prints each JSON line, then a markdown table of tokens/s (MFU, peak memory)
# and the ratios isthmus bf16 / torch. A torch variant that fails reads "n/a (reason)" in its
# cell and the run goes on; a failing isthmus run stops the script with status 1.
#
# Usage: bench/train/run.sh [--device cpu|cuda] [BUILD_DIR]    (BUILD_DIR default: build)
# env: THREADS   CPU threads of both programs (default 1)
#      BATCH     sequences per step (default 8)
#      STEPS     timed steps (default 10 on cpu, 20 on cuda)
#      WARMUP    untimed steps first, which absorb torch.compile (default 2 on cpu, 5 on cuda)
#      PEAK_TFLOPS  device peak for MFU, cuda only (default 989, H100 SXM dense bf16)
#      PYTHON    interpreter for torch_gpt.py and the helpers (default /usr/bin/python3; on a
#                GPU machine whose CUDA torch is in the python3 on PATH: PYTHON=python3)
# shellcheck disable=SC2086  # $size and $common are split into arguments on purpose
set -eu
here=$(cd "$(dirname "$0")" && pwd)
usage() {
  echo "usage: $0 [--device cpu|cuda] [BUILD_DIR]" >&2
  exit 2
}
device=cpu
build=
while [ $# -gt 0 ]; do
  case $1 in
    --device) [ $# -ge 2 ] || usage; device=$2; shift 2 ;;
    --device=*) device=${1#--device=}; shift ;;
    -*) usage ;;
    *) [ -z "$build" ] || usage; build=$1; shift ;;
  esac
done
case $device in cpu | cuda) ;; *) echo "run.sh: --device must be cpu or cuda, not '$device'" >&2; exit 2 ;; esac
build=${build:-build}
bin="$build/bench/train/bench_train"
[ -x "$bin" ] || { echo "run.sh: $bin not found; cmake --build $build --target bench_train" >&2; exit 2; }
py=${PYTHON:-/usr/bin/python3}
threads=${THREADS:-1}
batch=${BATCH:-8}
cores=$(nproc --all)
# Spinning OpenMP/OpenBLAS workers steal cores from each other and from other processes.
export OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS="$threads" OPENBLAS_NUM_THREADS="$threads" MKL_NUM_THREADS="$threads"
cpu_line="# cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $cores cores, load average $(cut -d' ' -f1-3 /proc/loadavg)"

if [ "$device" = cpu ]; then
  steps=${STEPS:-10}
  warmup=${WARMUP:-2}
  echo "# threads=$threads batch=$batch ctx=256 lora_rank=16 steps=$steps warmup=$warmup OMP_WAIT_POLICY=PASSIVE"
  echo "$cpu_line"
  # compare LABEL ARGS...: both programs on ARGS, their JSON lines and the ratio.
  compare() {
    label=$1
    shift
    ours=$("$bin" "$@")
    theirs=$("$py" "$here/torch_gpt.py" "$@")
    echo "isthmus $label: $ours"
    echo "torch   $label: $theirs"
    "$py" -c "
import json, sys
a = json.loads(sys.argv[1]); b = json.loads(sys.argv[2])
print('ratio %s B=%s T=256 threads=%s: isthmus %.0f tok/s / torch %.0f tok/s = %.2f' % (
    sys.argv[3], a['batch'], a['threads'], a['tokens_per_s'], b['tokens_per_s'],
    a['tokens_per_s'] / b['tokens_per_s']))" "$ours" "$theirs" "$label"
  }
  for size in "4 256 4" "6 384 6"; do
    set -- $size
    compare "$1x$2 lora r16" --layers $1 --width $2 --heads $3 --ctx 256 --batch $batch --rank 16 \
      --steps $steps --warmup $warmup --threads $threads
  done
  llama="--family llama --layers 4 --width 256 --heads 4 --kv-heads 2 --inner 688 --ctx 256 --batch $batch --rank 16 --steps $steps --warmup $warmup --threads $threads"
  compare "llama 4x256 kv2 i688 lora r16" $llama --mode lora
  compare "llama 4x256 kv2 i688 full" $llama --mode full
  exit 0
fi

# --device cuda
steps=${STEPS:-20}
warmup=${WARMUP:-5}
peak=${PEAK_TFLOPS:-989}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
results="$tmp/results" # one line per run: shape TAB mode TAB impl TAB ok|na TAB JSON or reason
: >"$results"
if command -v nvidia-smi >/dev/null 2>&1; then
  gpu=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | paste -s -d ';' -)
else
  gpu="nvidia-smi not found"
fi
if tv=$("$py" -c 'import torch; print("%s (CUDA %s, cuDNN %s)" % (torch.__version__, torch.version.cuda, torch.backends.cudnn.version()))' 2>&1); then :; else
  tv="not importable by $py: $(printf '%s\n' "$tv" | tail -n 1)"
fi
echo "# device=cuda batch=$batch steps=$steps warmup=$warmup lora_rank=16 lora_alpha=32 threads=$threads peak_tflops=$peak OMP_WAIT_POLICY=PASSIVE"
echo "# gpu (name, driver): $gpu"
echo "# torch: $tv, python: $py"
echo "$cpu_line"

# run_case SHAPE MODE IMPL isthmus|torch COMMAND...: runs COMMAND, prints its JSON line (or
# why there is none) and appends the outcome to $results. An isthmus failure ends the script.
run_case() {
  rc_shape=$1 rc_mode=$2 rc_impl=$3 rc_kind=$4
  shift 4
  rc=0
  "$@" >"$tmp/out" 2>"$tmp/err" </dev/null || rc=$?
  json=$(grep -v '^[[:space:]]*$' "$tmp/out" | tail -n 1 || true)
  if [ "$rc" -eq 0 ] && "$py" -c 'import json, sys; d = json.loads(sys.argv[1]); sys.exit(not (isinstance(d, dict) and "tokens_per_s" in d))' "$json" 2>/dev/null; then
    printf '%-24s %-13s %-4s: %s\n' "$rc_impl" "$rc_shape" "$rc_mode" "$json"
    printf '%s\t%s\t%s\tok\t%s\n' "$rc_shape" "$rc_mode" "$rc_impl" "$json" >>"$results"
    return 0
  fi
  if [ "$rc_kind" = isthmus ]; then
    if [ "$rc" -ne 0 ]; then what="failed with exit status $rc"; else what="printed no JSON line"; fi
    echo "$rc_impl $rc_shape $rc_mode: $what; its output:"
    cat "$tmp/out"
    cat "$tmp/err" >&2
    echo "run.sh: $* failed" >&2
    exit 1
  fi
  why=$(grep -v '^[[:space:]]*$' "$tmp/err" | tail -n 1 || true)
  [ -n "$why" ] || why=$(grep -v '^[[:space:]]*$' "$tmp/out" | tail -n 1 || true)
  case $why in
    "torch_gpt.py: error: "*) why=${why#torch_gpt.py: error: } ;;
    "") why="exit status $rc, no output" ;;
    *) [ "$rc" -eq 0 ] && why="no JSON line: $why" || why="exit status $rc: $why" ;;
  esac
  why=$(printf '%s' "$why" | tr '\t|' ' /' | cut -c 1-200)
  printf '%-24s %-13s %-4s: n/a (%s)\n' "$rc_impl" "$rc_shape" "$rc_mode" "$why"
  # The end of its stderr, for a traceback (torch.compile failures are long).
  if [ -s "$tmp/err" ] && [ "$(wc -l <"$tmp/err")" -gt 1 ]; then tail -n 15 "$tmp/err" | sed 's/^/#   /'; fi
  printf '%s\t%s\t%s\tna\t%s\n' "$rc_shape" "$rc_mode" "$rc_impl" "$why" >>"$results"
}

for size in "4 256 4 256" "12 768 12 1024"; do
  set -- $size
  shape="$1x$2 T=$4"
  for mode in lora full; do
    common="--layers $1 --width $2 --heads $3 --ctx $4 --batch $batch --rank 16 --alpha 32 --mode $mode --steps $steps --warmup $warmup --threads $threads --peak-tflops $peak --device cuda"
    torch_gpt="$here/torch_gpt.py"
    run_case "$shape" $mode "isthmus bf16" isthmus "$bin" $common --precision bf16
    run_case "$shape" $mode "isthmus fp32" isthmus "$bin" $common --precision fp32
    run_case "$shape" $mode "torch fp32" torch "$py" "$torch_gpt" $common --precision fp32 --attention manual
    run_case "$shape" $mode "torch bf16+sdpa" torch "$py" "$torch_gpt" $common --precision bf16 --attention sdpa
    run_case "$shape" $mode "torch bf16+sdpa+compile" torch "$py" "$torch_gpt" $common --precision bf16 --attention sdpa --compile
  done
done

echo
"$py" - "$results" <<'EOF'
import json, sys

IMPLS = ["isthmus bf16", "isthmus fp32", "torch fp32", "torch bf16+sdpa", "torch bf16+sdpa+compile"]
rows, cells, warnings = [], {}, []
for line in open(sys.argv[1]):
    shape, mode, impl, status, payload = line.rstrip("\n").split("\t", 4)
    if (shape, mode) not in rows:
        rows.append((shape, mode))
    cells[shape, mode, impl] = json.loads(payload) if status == "ok" else payload
    if status == "ok":
        d = cells[shape, mode, impl]
        got = "%sx%s T=%s" % (d.get("layers"), d.get("width"), d.get("ctx"))
        if got != shape or d.get("mode") != mode:
            warnings.append("%s %s %s: its JSON says %s %s" % (impl, shape, mode, got, d.get("mode")))


def cell(c):
    if isinstance(c, str):
        return "n/a (%s)" % c
    mfu = "%.1f%%" % (100 * c["mfu"]) if c.get("mfu") is not None else "MFU ?"
    mem = "%.2f GiB" % (c["peak_mem_bytes"] / 2**30) if c.get("peak_mem_bytes") is not None else "mem ?"
    return "%.0f (%s, %s)" % (c["tokens_per_s"], mfu, mem)


def ratio(a, b, name):
    if isinstance(a, str):
        return "n/a (isthmus bf16 n/a)"
    if isinstance(b, str):
        return "n/a (%s n/a)" % name
    return "%.2f" % (a["tokens_per_s"] / b["tokens_per_s"])


print("tokens/s (MFU, peak GiB); ratios are isthmus bf16 tokens/s over torch's")
print()
head = ["shape", "mode"] + IMPLS + ["isthmus bf16 / torch bf16+sdpa", "isthmus bf16 / torch compile"]
print("| " + " | ".join(head) + " |")
print("|" + "---|" * len(head))
for shape, mode in rows:
    c = [cells.get((shape, mode, i), "not run") for i in IMPLS]
    print("| " + " | ".join([shape, mode] + [cell(x) for x in c] + [
        ratio(c[0], c[3], "torch bf16+sdpa"), ratio(c[0], c[4], "torch compile")]) + " |")
for w in warnings:
    print("# warning: " + w)
EOF
