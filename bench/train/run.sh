#!/bin/sh
# Training throughput, isthmus vs PyTorch, same configs, same run: 4x256 and 6x384 GPT-2 with
# LoRA r16 on attn.c_attn/attn.c_proj/mlp.c_fc/mlp.c_proj, context 256, batch B (default 8),
# CPU with THREADS threads (default 1). Prints each JSON line and the ratio isthmus/torch.
# Usage: bench/train/run.sh [BUILD_DIR]   env: THREADS, BATCH, STEPS, WARMUP
set -eu
here=$(cd "$(dirname "$0")" && pwd)
build=${1:-build}
bin="$build/bench/train/bench_train"
[ -x "$bin" ] || { echo "run.sh: $bin not found; cmake --build $build --target bench_train" >&2; exit 2; }
threads=${THREADS:-1}
batch=${BATCH:-8}
steps=${STEPS:-10}
warmup=${WARMUP:-2}
cores=$(nproc --all)
# Spinning OpenMP/OpenBLAS workers steal cores from each other and from other processes.
export OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=$threads OPENBLAS_NUM_THREADS=$threads MKL_NUM_THREADS=$threads
echo "# threads=$threads batch=$batch ctx=256 lora_rank=16 steps=$steps warmup=$warmup OMP_WAIT_POLICY=PASSIVE"
echo "# cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $cores cores, load average $(cut -d' ' -f1-3 /proc/loadavg)"
for size in "4 256 4" "6 384 6"; do
  set -- $size
  common="--layers $1 --width $2 --heads $3 --ctx 256 --batch $batch --rank 16 --steps $steps --warmup $warmup --threads $threads"
  ours=$("$bin" $common)
  theirs=$(/usr/bin/python3 "$here/torch_gpt.py" $common)
  echo "isthmus $1x$2: $ours"
  echo "torch   $1x$2: $theirs"
  /usr/bin/python3 -c "
import json, sys
a = json.loads(sys.argv[1]); b = json.loads(sys.argv[2])
print('ratio %sx%s lora r16 B=%s T=256 threads=%s: isthmus %.0f tok/s / torch %.0f tok/s = %.2f' % (
    sys.argv[3], sys.argv[4], a['batch'], a['threads'], a['tokens_per_s'], b['tokens_per_s'],
    a['tokens_per_s'] / b['tokens_per_s']))" "$ours" "$theirs" "$1" "$2"
done
