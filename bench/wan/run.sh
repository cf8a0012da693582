#!/usr/bin/env bash
# The WAN at GPU scale, without a GPU. Two or three sites, each in its own network
# namespace joined to a bridge by a veth pair shaped with tc tbf (RATE each way, per site),
# each running real isthmus-server shards with real CURVE peer links. In each site a
# SYNTHETIC site (bench_wan_load) stands for the GPU workers: every --round-seconds it
# pushes a round delta recorded from real GPT-2-small-shaped training (bench/wan/record.sh:
# LoRA r16, 2,359,296 values, or full mode, 85 M values), waits while the site is more than
# sync.max_rounds_ahead rounds ahead of the last commit, and pulls the merged state, as
# isthmus-worker does. Per case it reports the kernel-counted WAN bytes per round (the
# veths' counters), the wire time a round needs at RATE, the round's commit latency, the
# WAN wait, the utilisation (fraction of wall time not waiting for the WAN) and the
# fraction spent computing (the headline: the round boundary's LAN push and pull, and with
# overlap whatever of them is not hidden behind the next round, count against it). The
# synthetic sites end their rounds through the product's round driver
# (common/round_driver.h), serially or, with --overlap on, in the background.
#
# Usage: bench/wan/run.sh [--cases "CASE ..."] [--rates "20mbit 100mbit"] [--sites 2|3]
#                         [--rounds N] [--round-seconds S] [--shards S] [--json FILE]
#                         [--overlap "off on"] [--pull-by-replay "off on"]
#                         [--encode-here "off on"] [--encode-threads N]
#   cases: lora-dense lora-default lora-sparse lora-adaptive full-default full-sparse
#          full-adaptive full-lowrank full-fragments (default: lora-default lora-adaptive
#          full-default). "default": the server's defaults (int2:256+zstd, adaptive from it
#          down); "sparse": topk:0.05+int2+zstd fixed (the default before); "adaptive": from
#          dense down; lowrank and fragments: fixed pipelines.
#   --rounds 20, --round-seconds 3, --shards 1 per site, --sites 2, --overlap off by
#   default (each case runs once per value given).
#   --pull-by-replay "off on": the synthetic sites pull the rounds as encoded deltas and
#   replay them (bench_wan_load --pull-by-replay, isthmus-worker's default) or pull every
#   tensor (off, the default here, as before it existed); each case runs once per value.
#   --encode-here "off on": the synthetic sites encode their deltas themselves with error
#   feedback (bench_wan_load --encode-threads N, N from --encode-threads, default 1) and push
#   the encoded bytes, or push fp32 deltas for the shards to encode (off, the default);
#   docs/SYNC.md, "Deltas encoded by the worker". Each case runs once per value.
#   --merge-after-steps M   overlapped sites merge no earlier than M of the round's 30
#   emulated steps, then as soon as the round in flight is done (bench_wan_load
#   --merge-after-steps; default 3, a tenth, as isthmus-worker; 0: as soon as it is done);
#   --merge-wait: at exactly step M, waiting there if need be. Both recorded in each row.
# ISTHMUS_BENCH_LOAD_FLAGS: more bench_wan_load flags for every site (e.g. --pass-threads 1).
# ISTHMUS_BENCH_SHARD_FLAGS: more isthmus-server flags for every shard (e.g.
# "--log.level debug" logs each close's and commit's time split).
# Needs root and iproute2 (ip netns, tc), the recorded deltas (bench/wan/record.sh) and a
# build with the bench programs (ISTHMUS_BUILD_DIR, default build).
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=deploy/shard-toml.sh
. deploy/shard-toml.sh
build="${ISTHMUS_BUILD_DIR:-build}"
cases="lora-default lora-adaptive full-default" rates="20mbit 100mbit" nsites=2 rounds=20
round_seconds=3 shards=1 json_out="" deltas=demo-out/wan-deltas overlaps="off" replays="off" merge_after=3 merge_wait=false
encodes="off" encode_threads=1
while [ $# -gt 0 ]; do
  case "$1" in
    --cases) cases="$2"; shift 2 ;;
    --rates) rates="$2"; shift 2 ;;
    --sites) nsites="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --round-seconds) round_seconds="$2"; shift 2 ;;
    --shards) shards="$2"; shift 2 ;;
    --deltas) deltas="$2"; shift 2 ;;
    --json) json_out="$2"; shift 2 ;;
    --overlap) overlaps="$2"; shift 2 ;;
    --pull-by-replay) replays="$2"; shift 2 ;;
    --encode-here) encodes="$2"; shift 2 ;;
    --encode-threads) encode_threads="$2"; shift 2 ;;
    --merge-after-steps) merge_after="$2"; shift 2 ;;
    --merge-wait) merge_wait=true; shift ;;
    -h|--help) sed -n 2,40p "$0"; exit 0 ;;
    *) echo "run.sh: unknown option '$1' (try --help)" >&2; exit 2 ;;
  esac
done
server="$build/server/isthmus-server" ctl="$build/server/isthmusctl" load="$build/bench/wan/bench_wan_load"
for b in "$server" "$ctl" "$load"; do
  [ -x "$b" ] || { echo "run.sh: $b is not built (cmake --build $build)" >&2; exit 2; }
done
if [ "$(id -u)" -ne 0 ] || ! command -v tc >/dev/null; then
  echo "run.sh: needs root and tc/ip (iproute2)" >&2; exit 2
fi
[ -d "$deltas/lora/A" ] || { echo "run.sh: no recorded deltas in $deltas (run bench/wan/record.sh)" >&2; exit 2; }
all_sites=(A B C)
sites=("${all_sites[@]:0:$nsites}")
# Each site replays its own recording; a site without one (C: record.sh records A and B)
# replays A's.
recorded() {  # MODE SITE -> folder
  if [ -d "$deltas/$1/$2" ]; then echo "$deltas/$1/$2"; else echo "$deltas/$1/A"; fi
}
out=demo-out/bench-wan
mkdir -p "$out"
results="$out/results.jsonl"
: > "$results"
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE

# --- the WAN: a bridge in the root namespace, one shaped veth per site ------------------
tag="iwb$$" net=$(( $$ % 200 + 20 ))
declare -A ns_of ip_of veth_of
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  for s in "${sites[@]}"; do
    ip netns pids "${ns_of[$s]:-none}" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    ip link del "${veth_of[$s]:-none}" 2>/dev/null || true
    ip netns del "${ns_of[$s]:-none}" 2>/dev/null || true
  done
  ip link del "$tag" 2>/dev/null || true
}
trap cleanup EXIT
trap 'exit 143' INT TERM  # a signal exits through the EXIT trap too
ip link add "$tag" type bridge
ip link set "$tag" up
sysctl -qw "net.ipv6.conf.$tag.disable_ipv6=1" 2>/dev/null || true
k=1
for s in "${sites[@]}"; do
  ns_of[$s]="$tag-$s" veth_of[$s]="$tag$s" ip_of[$s]="10.79.$net.$k"
  ip netns add "${ns_of[$s]}"
  ip netns exec "${ns_of[$s]}" ip link set lo up
  ip link add "${veth_of[$s]}" type veth peer name wan0 netns "${ns_of[$s]}"
  sysctl -qw "net.ipv6.conf.${veth_of[$s]}.disable_ipv6=1" 2>/dev/null || true
  ip netns exec "${ns_of[$s]}" sysctl -qw net.ipv6.conf.wan0.disable_ipv6=1 2>/dev/null || true
  ip link set "${veth_of[$s]}" master "$tag" up
  ip netns exec "${ns_of[$s]}" ip addr add "${ip_of[$s]}/24" dev wan0
  ip netns exec "${ns_of[$s]}" ip link set wan0 up
  k=$((k + 1))
done
shape() {  # RATE: both directions of every site's veth
  for s in "${sites[@]}"; do
    tc qdisc replace dev "${veth_of[$s]}" root tbf rate "$1" burst 256kbit latency 1s
    ip netns exec "${ns_of[$s]}" tc qdisc replace dev wan0 root tbf rate "$1" burst 256kbit latency 1s
  done
}
# Bytes every site sent onto the WAN (Ethernet frames), as the kernel counted them.
wan_bytes() {
  local n=0
  for s in "${sites[@]}"; do n=$(( n + $(cat "/sys/class/net/${veth_of[$s]}/statistics/rx_bytes") )); done
  echo "$n"
}
in_ns() { local s=$1; shift; ip netns exec "${ns_of[$s]}" "$@"; }
# Stops every process in the sites' namespaces (the shards are grandchildren of this shell,
# under a subshell and `ip netns exec`): TERM, up to 10 s to exit, then KILL.
stop_sites() {
  local s left
  for s in "${sites[@]}"; do ip netns pids "${ns_of[$s]}" | xargs -r kill -TERM 2>/dev/null || true; done
  for _ in $(seq 50); do
    left=0
    for s in "${sites[@]}"; do [ -z "$(ip netns pids "${ns_of[$s]}")" ] || left=1; done
    [ "$left" -eq 0 ] && break
    sleep 0.2
  done
  for s in "${sites[@]}"; do ip netns pids "${ns_of[$s]}" | xargs -r kill -9 2>/dev/null || true; done
  wait 2>/dev/null || true
  pids=()
}

# One line per case from its JSON row.
print_row='
import json, sys
r = json.loads(sys.stdin.read())
print("{case:<15} {rate:>7} overlap {overlap:<3} replay {pull_by_replay:<3} encode here {encode_here:<3}  {kernel_bytes_per_round:>12,.0f} B/round  wire {wire_seconds_per_round:6.2f} s"
      " of {round_seconds:.1f} s  commit latency {mean_commit_latency_s:5.2f} s (max"
      " {max_commit_latency_s:5.2f})  WAN wait {wait_s:6.2f} s in {rounds_waited} rounds  push"
      " {push_s:5.2f} s  pull {pull_s:5.2f} s  blocked {blocked_s:5.2f} s  utilisation {pct:5.1f}%  computing {cpct:5.1f}%".format(
          pct=100 * r["utilisation"], cpct=100 * r["compute_fraction"], **r))'

# --- one case: fresh shards in every site, the synthetic sites, the figures -------------
run_case() {  # NAME MODE RATE SYNC_TOML_LINES OVERLAP(on|off) REPLAY(on|off) ENCODE(on|off)
  local name=$1 mode=$2 rate=$3 sync_lines=$4 overlap=$5 replay=$6 encode=$7
  local dir="$out/$1-$3-overlap-$5-replay-$6-encode-$7"
  rm -rf "$dir" && mkdir -p "$dir/logs"
  make_keys "$ctl" "$dir/keys" "$shards" "${sites[@]}"
  export ISTHMUS_CTL_KEY="$dir/keys/admins/admin.key"
  for s in "${sites[@]}"; do
    for ((i = 0; i < shards; i++)); do
      local peers=""
      for t in "${sites[@]}"; do
        [ "$t" = "$s" ] && continue
        peers+="\"$t=tcp://${ip_of[$t]}:$((7300 + i))=$dir/keys/$t-$i.pub\", "
      done
      shard_toml "$dir" "$dir/keys" "$s" "$i" "tcp://127.0.0.1:$((7100 + i))" \
        "tcp://127.0.0.1:$((7200 + i))" "tcp://${ip_of[$s]}:$((7300 + i))" "${peers%, }" \
        "$sync_lines" > "$dir/$s-$i.toml"
      # shellcheck disable=SC2086  # ISTHMUS_BENCH_SHARD_FLAGS: more server flags, split
      in_ns "$s" "$server" --config "$dir/$s-$i.toml" ${ISTHMUS_BENCH_SHARD_FLAGS:-} \
        2> "$dir/logs/shard-$s-$i.log" &
      pids+=($!)
    done
  done
  for s in "${sites[@]}"; do
    local a=()
    for ((i = 0; i < shards; i++)); do
      a+=(--server "tcp://127.0.0.1:$((7200 + i))" --server-key "$dir/keys/$s-$i.pub")
    done
    for _ in $(seq 100); do in_ns "$s" "$ctl" status "${a[@]}" --timeout-ms 300 >/dev/null 2>&1 && break; sleep 0.2; done
    in_ns "$s" "$ctl" job create "${a[@]}" --job wan --from "$deltas/$mode/A/round-0.safetensors" \
      > "$dir/logs/create-$s.log" 2>&1
  done
  shape "$rate"
  local before
  before=$(wan_bytes)
  local lpids=() wait_flag=()
  [ "$merge_wait" = true ] && wait_flag=(--merge-wait)
  for s in "${sites[@]}"; do
    local w=()
    for ((i = 0; i < shards; i++)); do
      w+=(--server "tcp://127.0.0.1:$((7100 + i))" --server-key "$dir/keys/$s-$i.pub")
    done
    # shellcheck disable=SC2086  # ISTHMUS_BENCH_LOAD_FLAGS: more bench_wan_load flags, split
    in_ns "$s" "$load" --job wan "${w[@]}" --key "$dir/keys/workers-$s/worker.key" \
      --client-name "$s" --deltas "$(recorded "$mode" "$s")" --rounds "$rounds" \
      --round-seconds "$round_seconds" --"$( [ "$overlap" = on ] && echo overlap || echo no-overlap )" \
      --"$( [ "$replay" = on ] && echo pull-by-replay || echo no-pull-by-replay )" \
      --merge-after-steps "$merge_after" "${wait_flag[@]}" \
      --encode-threads "$( [ "$encode" = on ] && echo "$encode_threads" || echo 0 )" \
      ${ISTHMUS_BENCH_LOAD_FLAGS:-} --json "$dir/load-$s.json" > "$dir/logs/load-$s.log" 2>&1 &
    lpids+=($!)
  done
  pids+=("${lpids[@]}")
  # The first synthetic site to fail stops the case (the others would wait for its rounds).
  # Each is waited for once, when it has ended (`wait -n` with ids can answer 127, "no such
  # job", when two end together).
  local failed=0 left=("${lpids[@]}") still p q
  while [ "${#left[@]}" -gt 0 ]; do
    still=()
    for p in "${left[@]}"; do
      if kill -0 "$p" 2>/dev/null; then still+=("$p"); continue; fi
      if ! wait "$p" 2>/dev/null && [ "$failed" -eq 0 ]; then
        failed=1
        for q in "${lpids[@]}"; do kill "$q" 2>/dev/null || true; done
      fi
    done
    left=("${still[@]}")
    [ "${#left[@]}" -eq 0 ] || sleep 0.2
  done
  local after
  after=$(wan_bytes)
  for s in "${sites[@]}"; do
    local a=()
    for ((i = 0; i < shards; i++)); do
      a+=(--server "tcp://127.0.0.1:$((7200 + i))" --server-key "$dir/keys/$s-$i.pub")
    done
    in_ns "$s" "$ctl" sync status "${a[@]}" --json > "$dir/sync-$s.json" 2>/dev/null || true
  done
  stop_sites
  # The shards' data (GBs per case in full mode) goes; logs, configs and JSON stay.
  for s in "${sites[@]}"; do
    for ((i = 0; i < shards; i++)); do rm -rf "${dir:?}/$s-$i"; done
  done
  if [ "$failed" -ne 0 ]; then
    echo "run.sh: case $name at $rate: a synthetic site failed:" >&2
    tail -n 5 "$dir"/logs/load-*.log >&2
    return 1
  fi
  /usr/bin/python3 - "$dir" "$name" "$mode" "$rate" "$((after - before))" "$rounds" "$round_seconds" "${sites[*]}" "$overlap" "$merge_after" "$merge_wait" "$replay" "$encode" >> "$results" <<'PY'
import json, sys
d, name, mode, rate, kernel, rounds, round_s, sites, overlap, merge_after, merge_wait, replay, encode = sys.argv[1:14]
kernel, rounds, round_s, sites = int(kernel), int(rounds), float(round_s), sites.split()
bps = float(rate.replace("mbit", "")) * 1e6 / 8
loads = {s: json.load(open(f"{d}/load-{s}.json")) for s in sites}
payload = raw = wire = 0
pipes = {}
for s in sites:
    for shard in json.load(open(f"{d}/sync-{s}.json")):
        for l in shard.get("links", []):
            payload += l["bytes_sent"]; raw += l["raw_bytes_sent"]; wire += l["wire_bytes_sent"]
        for j in shard.get("jobs", []):
            pipes[s] = j.get("detail", "")
summ = {s: loads[s]["summary"] for s in sites}
per_round = kernel / rounds
# The busiest direction: each site sends its round to every other site over its own veth.
per_site_round = per_round / len(sites)
row = {"case": name, "mode": mode, "rate": rate, "overlap": overlap, "pull_by_replay": replay,
       "encode_here": encode,
       "pushed_bytes": sum(loads[s]["pushed_bytes"] for s in sites),
       "pushed_raw_bytes": sum(loads[s]["pushed_raw_bytes"] for s in sites),
       "merge_after_steps": int(merge_after), "merge_wait": merge_wait == "true",
       "sites": len(sites),
       "rounds": rounds,
       "round_seconds": round_s, "numel": loads[sites[0]]["numel"],
       "kernel_bytes": kernel, "kernel_bytes_per_round": per_round,
       "wire_seconds_per_round": per_site_round / bps,
       "payload_bytes": payload, "raw_bytes": raw, "wire_bytes_counted": wire,
       "utilisation": min(v["utilisation"] for v in summ.values()),
       "compute_fraction": min(v["compute_fraction"] for v in summ.values()),
       "wait_fraction": max(v["wait_fraction"] for v in summ.values()),
       "wait_s": max(v["wait_s"] for v in summ.values()),
       "push_s": max(v["push_s"] for v in summ.values()),
       "pull_s": max(v["pull_s"] for v in summ.values()),
       "boundary_s": max(v["boundary_s"] for v in summ.values()),
       "blocked_s": max(v["blocked_s"] for v in summ.values()),
       "drain_s": max(loads[s]["drain_s"] for s in sites),
       "rounds_waited": max(v["rounds_waited"] for v in summ.values()),
       "summary_rounds": summ[sites[0]]["rounds"],
       "mean_commit_latency_s": max(v["mean_commit_latency_s"] for v in summ.values()),
       "max_commit_latency_s": max(v["max_commit_latency_s"] for v in summ.values()),
       "engine": pipes}
print(json.dumps(row))
PY
  tail -n 1 "$results" | /usr/bin/python3 -c "$print_row"
}

sync_of() {  # CASE -> "MODE|TOML lines" (no lines: the server's defaults, docs/SYNC.md "Defaults")
  case "$1" in
    lora-dense) printf 'lora|codec = "dense"\nadaptive = false' ;;
    lora-default) echo 'lora|' ;;
    lora-sparse) printf 'lora|codec = "topk:0.05+int2+zstd"\nadaptive = false' ;;
    lora-adaptive) printf 'lora|adaptive = true\nadaptive_ceiling = "dense"' ;;
    full-default) echo 'full|' ;;
    full-sparse) printf 'full|codec = "topk:0.05+int2+zstd"\nadaptive = false' ;;
    full-adaptive) printf 'full|adaptive = true\nadaptive_ceiling = "dense"' ;;
    full-lowrank) printf 'full|codec = "lowrank:4+int8+zstd"\nadaptive = false' ;;
    full-fragments) printf 'full|codec = "topk:0.05+int2+zstd"\nadaptive = false\nfragments = 4' ;;
    *) echo "run.sh: unknown case '$1'" >&2; exit 2 ;;
  esac
}

echo "bench/wan: ${#sites[@]} sites, $shards shard(s) each, $rounds rounds of $round_seconds s," \
     "cases: $cases; rates: $rates; overlap: $overlaps; pull by replay: $replays; encode here: $encodes; machine: cores=$(getconf _NPROCESSORS_ONLN), load $(cut -d' ' -f1-3 /proc/loadavg)"
for rate in $rates; do
  for c in $cases; do
    spec=$(sync_of "$c")
    for ov in $overlaps; do
      for rp in $replays; do
        for en in $encodes; do
          run_case "$c" "${spec%%|*}" "$rate" "${spec#*|}" "$ov" "$rp" "$en" || true
        done
      done
    done
  done
done
if [ -n "$json_out" ]; then cp "$results" "$json_out"; fi
