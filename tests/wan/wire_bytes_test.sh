#!/usr/bin/env bash
# The WAN costs what the deltas cost: two sites at the demo's scale (deploy/two-site.sh:
# 2 shards x 2 CPU ranks per site, 2x128 GPT, LoRA r8, default codec, 8 rounds) with site B
# in its own network namespace behind a 20 Mbit/s tbf-shaped veth. Trains for real on real
# text (the licence texts under /usr/share/common-licenses), then checks the kernel's
# counters of that veth:
#   - every byte that crossed it (both directions, Ethernet frames) is at most 1.5x the
#     delta payload bytes the sites sent;
#   - left idle afterwards, each peer link (shard pair) costs under 100 bytes/s;
#   - the sites' own wire count (with estimated TCP/IP headers) is within 10% of the
#     kernel's, and the committed digests agree.
# Usage: wire_bytes_test.sh BUILD_DIR. Needs root and iproute2 (ip netns, tc); without
# them it exits 77, which ctest reports as skipped with this script's message.
set -euo pipefail
build=$(cd "$1" && pwd)
root=$(cd "$(dirname "$0")/../.." && pwd)
if [ "$(id -u)" -ne 0 ] || ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
  echo "SKIP: needs root with ip and tc (iproute2) to build a shaped network namespace"
  exit 77
fi
if ! ip netns add "isthmus-probe-$$" 2>/dev/null; then
  echo "SKIP: cannot create a network namespace here (no CAP_SYS_ADMIN / CAP_NET_ADMIN?)"
  exit 77
fi
ip netns del "isthmus-probe-$$"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
lic=/usr/share/common-licenses
data="$build/worker/data/isthmus-data"
"$data" build --out "$work/A" --val-fraction 0.1 "$lic/GPL-3" "$lic/GFDL-1.3" "$lic/Apache-2.0" >/dev/null
"$data" build --out "$work/B" --val-fraction 0.1 "$lic/LGPL-2.1" "$lic/MPL-2.0" "$lic/GPL-2" >/dev/null
"$data" build --out "$work/all" --val-fraction 0.1 "$lic/GPL-3" "$lic/GFDL-1.3" "$lic/Apache-2.0" \
  "$lic/LGPL-2.1" "$lic/MPL-2.0" "$lic/GPL-2" >/dev/null
model="--layers 2 --width 128 --heads 4 --context 128"
# A briefly pre-trained base: the LoRA rounds then move real, structured deltas.
# shellcheck disable=SC2086
"$build/worker/isthmus-worker" train --standalone --mode full $model --data "$work/all" \
  --batch-size 8 --lr 2e-3 --warmup-steps 5 --max-steps 60 --no-progress --save "$work/base.safetensors" \
  >/dev/null 2>&1
shards=2 idle=30
ISTHMUS_BUILD_DIR="$build" "$root/deploy/two-site.sh" --base "$work/base.safetensors" \
  --data-a "$work/A" --data-b "$work/B" --model "$model --lora-rank 8 --lora-alpha 16" \
  --train "--lr 2e-3 --min-lr 2e-4 --warmup-steps 10 --batch-size 8" --shards "$shards" \
  --wan-rate 20mbit --idle-seconds "$idle" --out "$work/two-site" --summary "$work/summary.json"
/usr/bin/python3 - "$work/summary.json" "$shards" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
links = int(sys.argv[2])
ratio = s["kernel_to_payload"]
idle_per_link = s["idle_bytes_per_second"] / links
counted = s["counted_wan_bytes"] / s["kernel_wan_bytes"]
print(f"kernel WAN bytes {s['kernel_wan_bytes']:,} = {ratio:.3f}x the payload {s['payload_bytes']:,} (limit 1.5x)")
print(f"idle: {s['idle_bytes_per_second']:.1f} bytes/s for {links} links = {idle_per_link:.1f} per link (limit 100)")
print(f"sites' own count (TCP/IP estimated) / kernel = {counted:.3f} (limit 0.9..1.1)")
bad = []
if not s["digests_agree"]: bad.append("committed digests differ")
if ratio > 1.5: bad.append(f"wire bytes {ratio:.3f}x the payload, over 1.5x")
if idle_per_link >= 100: bad.append(f"idle link {idle_per_link:.1f} bytes/s, not under 100")
if not 0.9 <= counted <= 1.1: bad.append(f"sites' count {counted:.3f}x the kernel's")
if bad:
    print("FAIL: " + "; ".join(bad))
    sys.exit(1)
print("PASS")
PY
