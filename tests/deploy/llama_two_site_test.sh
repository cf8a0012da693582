#!/usr/bin/env bash
# deploy/two-site.sh --base-hf: a LoRA job on a Llama-family Hugging Face folder across two
# sites on loopback (one shard and one CPU rank each). The folder is a tiny random Llama
# (grouped-query attention, untied head) over the 256 byte tokens that
# tests/model/llama_reference.py writes in Hugging Face's layout; the sites train on two of
# the repository's own docs for 3 rounds. Checks that both sites committed every round with
# equal digests, that the committed adapters carry the Llama names on every linear, and that
# `isthmus-worker export` turns a site's adapters into a PEFT folder with PEFT's names beside
# a Llama config.json. A folder without config.json is refused with exit 2.
# Usage: llama_two_site_test.sh BUILD_DIR
set -euo pipefail
build=$(cd "$1" && pwd)
root=$(cd "$(dirname "$0")/../.." && pwd)
for b in server/isthmus-server server/isthmusctl worker/isthmus-worker worker/data/isthmus-data; do
  [ -x "$build/$b" ] || { echo "FAIL: $build/$b is not built"; exit 1; }
done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
/usr/bin/python3 "$root/tests/model/llama_reference.py" "$work/ref" --family llama --vocab 256 \
  --hidden 32 --layers 2 --heads 4 --kv-heads 2 --intermediate 48 --ctx 64 --seed 5 >/dev/null
hf="$work/ref/hf"
data="$build/worker/data/isthmus-data"
"$data" build --out "$work/A" --val-fraction 0.2 "$root/docs/ARCHITECTURE.md" >/dev/null
"$data" build --out "$work/B" --val-fraction 0.2 "$root/docs/SYNC.md" >/dev/null

set +e
ISTHMUS_BUILD_DIR="$build" "$root/deploy/two-site.sh" --base-hf "$hf" --data-a "$work/A" \
  --data-b "$work/B" --model "--lora-rank 4 --lora-alpha 8" --train "--batch-size 2 --lr 3e-3" \
  --rounds 3 --steps-per-round 4 --shards 1 --ranks 1 --eval-batches 2 --export \
  --out "$work/run" > "$work/out.txt" 2>&1
rc=$?
set -e
cat "$work/out.txt"
[ "$rc" -eq 0 ] || { echo "FAIL: two-site.sh --base-hf exited $rc"; exit 1; }
grep -q "committed digests agree across sites: yes" "$work/out.txt" ||
  { echo "FAIL: the sites' digests were not found equal"; exit 1; }
"$build/worker/isthmus-worker" export --base "$hf" --trainable "$work/run/trainable-A.safetensors" \
  --peft-dir "$work/peft" 2>&1
/usr/bin/python3 - "$work" <<'PY'
import json, struct, sys
work = sys.argv[1]

def names(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    return {k: v["shape"] for k, v in header.items() if k != "__metadata__"}

s = json.load(open(f"{work}/run/summary.json"))
assert s["digests_agree"] and s["rounds_verified"] >= 3, (s["digests_agree"], s["rounds_verified"])
for site, r in s["sites"].items():
    assert r["committed_round"] >= 3, (site, r["committed_round"])
    assert all(0 < v < 10 for v in r["val_loss"].values()), r["val_loss"]
targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
for site in "AB":
    t = names(f"{work}/run/trainable-{site}.safetensors")
    want = {f"layers.{l}.{'self_attn' if m in targets[:4] else 'mlp'}.{m}.lora_{ab}.weight"
            for l in (0, 1) for m in targets for ab in "AB"}
    assert set(t) == want, sorted(set(t) ^ want)[:4]
    assert t["layers.0.self_attn.k_proj.lora_B.weight"] == [16, 4], t["layers.0.self_attn.k_proj.lora_B.weight"]
peft = json.load(open(f"{work}/peft/adapter_config.json"))
assert peft["target_modules"] == targets and peft["fan_in_fan_out"] is False, peft
adapter = names(f"{work}/peft/adapter_model.safetensors")
assert all(n.startswith("base_model.model.model.layers.") for n in adapter), sorted(adapter)[:2]
config = json.load(open(f"{work}/peft/base/config.json"))
assert (config["model_type"], config["num_key_value_heads"]) == ("llama", 2), config
print("llama across two sites: ok")
PY

mkdir -p "$work/empty"
set +e
ISTHMUS_BUILD_DIR="$build" "$root/deploy/two-site.sh" --base-hf "$work/empty" --data-a "$work/A" \
  --data-b "$work/B" --out "$work/run2" > "$work/out2.txt" 2>&1
rc=$?
set -e
[ "$rc" -eq 2 ] || { cat "$work/out2.txt"; echo "FAIL: --base-hf without config.json exited $rc, not 2"; exit 1; }
grep -q "no config.json" "$work/out2.txt" || { cat "$work/out2.txt"; echo "FAIL: no reason given"; exit 1; }
echo "PASS"
