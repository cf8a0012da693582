#!/usr/bin/env bash
# Two isthmus sites (three with --data-c) on one machine: per site S shards (RocksDB each)
# and R CPU worker ranks (Gloo), the sites' same-numbered shards joined by CURVE peer links
# on loopback.
# Trains a LoRA job for a fixed number of rounds, waits until every round has committed
# on every shard, then reports per site: validation loss on both sites' data, rounds
# committed, WAN bytes sent, compression ratio, and whether the committed digests agree.
# deploy/demo.sh prepares the inputs and calls this; bench/sync/run.sh calls it once per
# codec setting.
#
# Usage: deploy/two-site.sh --base BASE.safetensors --data-a DIR --data-b DIR [options]
#        deploy/two-site.sh --base-hf HF_DIR --data-a DIR --data-b DIR [options]
#   --base-hf DIR          a Hugging Face folder as the frozen base (config.json and
#                          model.safetensors or shards: Llama, Qwen2, Mistral or GPT-2);
#                          its config.json sets the shape, so --model then holds only the
#                          LoRA flags (default "--lora-rank 8 --lora-alpha 16"; a Llama-family
#                          base adapts every linear unless --model gives --lora-targets).
#                          Build the sites' data with its tokenizer (isthmus-data build
#                          --tokenizer DIR) unless its vocabulary is the 256 bytes
#   --out DIR              work folder, removed first (default demo-out/two-site)
#   --data-c DIR           a third site C (on loopback, peered with A and B like they are
#                          with each other), trained on DIR; not with --wan-rate
#   --model "FLAGS"        model flags shared by every worker (default: 2x128, ctx 128, LoRA r8)
#   --codec PIPELINE       sync.codec (default: the server's, int2:256+zstd)
#   --adaptive, --no-adaptive   sync.adaptive = true / false (default: the server's, true)
#   --adaptive-floor P     sync.adaptive_floor (default: the server's, the ladder's coarsest)
#   --adaptive-ceiling P   sync.adaptive_ceiling (default: the server's, sync.codec)
#   --rounds N             rounds to train (default 8)
#   --steps-per-round H    inner steps per round (default 20)
#   --site-b-steps H       inner steps per round at site B (default: same as A)
#   --train "FLAGS"        extra isthmus-worker train flags (lr, batch size, ...)
#   --outer-lr X --outer-momentum X   the outer optimizer (default: the server's, 1.25 / 0.6)
#   --max-rounds-ahead K   sync.max_rounds_ahead (default: the server's, 1); 0 with --train
#                          "--no-overlap" gives synchronous rounds
# Settings left unset here are the server's defaults (docs/CONFIG.md).
#   --shards S --ranks R   per site (default 2 / 2)
#   --wan-rate RATE        shape the WAN: site B runs in its own network namespace joined
#                          to site A by a veth pair with a tc tbf qdisc of RATE (e.g.
#                          500kbit) on both ends; needs root, ip and tc (iproute2)
#   --wan-capture FILE     with --wan-rate: record the WAN veth's packets (tcpdump) to FILE
#   --idle-seconds N       with --wan-rate: after the last round (and its acks), leave the
#                          sites idle N seconds and report the veth's bytes per second
#   --eval-set NAME=DIR    also evaluate each site's committed model on DIR's val.bin
#                          (repeatable; e.g. one per language), reported as val_loss_sets
#   --eval-batches N       batches per evaluation (default 16, isthmus-worker eval's)
#   --eval-every-rounds N  also have the workers evaluate the merged model after every Nth
#                          round on their site's validation data and on every --eval-set
#                          (isthmus-worker train --eval-every-rounds; off by default)
#   --translate-set LANG=FILE   with translation shards (isthmus-data parallel) as the sites'
#                          data: translate the first --translate-lines "source"s of FILE (a
#                          heldout-LANG.jsonl) with each site's committed model
#                          (isthmus-worker generate --translate) and score them with chrF
#                          (deploy/chrf.py); repeatable, reported as "chrf" per site
#   --translate-lines N    lines per --translate-set (default 200)
#   --translate-sites LIST with --translate-set: translate with these sites' models only
#                          (comma-separated, e.g. A; default every site). When the committed
#                          digests agree the sites' models are the same, so one site scores
#                          them all; the others' "chrf" is then empty
#   --round-translate-lines N   with --eval-every-rounds: the workers also translate the
#                          first N lines of each --translate-set after every evaluated round
#                          (isthmus-worker train --translate-set), which the report plots as
#                          chrF by round (default 50)
#   --distill "FLAGS"      word-level distillation: each site's workers train with
#                          --teacher-topk DATA/train.topk (the cache isthmus-worker teach
#                          wrote beside that site's task shard) and these flags (e.g.
#                          "--distill-alpha 0.5 --distill-temperature 2")
#   --export               also write each site's committed trainable tensors (isthmus-worker
#                          export, pulled from its shards) to OUT/trainable-<site>.safetensors
#                          (a fine-tuned teacher for teach --trainable, or generate --trainable)
#   --summary FILE         write the final figures as JSON here (they are always written to
#                          OUT/summary.json as well)
#   --top-interval S       seconds between the isthmusctl top samples (default 1)
#   --reference FILE       a JSON file of reference losses per --eval-set name, copied into
#                          the summary as "reference" for the report: "before" (the
#                          starting model, before round 1) and "centralised" (one process
#                          trained on every site's data for the same tokens); deploy/demo.sh
#                          writes one
#   --report DIR           at the end, write the run report (deploy/report.py: PNG plots and
#                          DIR/index.html) and print its path as the last line
# What OUT holds for deploy/report.py: summary.json; events-<site>.jsonl (rank 0's
# isthmus-worker --events: rounds and validations); top-<site>.jsonl (isthmusctl top --json
# --interval S of the site's shards, from the shards' start to after the final evaluations);
# worker-<site>-<rank>.json (--json-summary); eval-*.json and sync-<site>.json (final).
# Environment: ISTHMUS_BUILD_DIR (default build); binaries must be built.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=deploy/shard-toml.sh
. deploy/shard-toml.sh
build="${ISTHMUS_BUILD_DIR:-build}"
server="$build/server/isthmus-server"
ctl="$build/server/isthmusctl"
worker="$build/worker/isthmus-worker"

out=demo-out/two-site
model="--layers 2 --width 128 --heads 4 --context 128 --lora-rank 8 --lora-alpha 16"
distill="" distill_on=false codec="" adaptive="" adaptive_floor="" adaptive_ceiling="" rounds=8 steps=20 steps_b="" train_extra="" outer_lr="" outer_mom="" rounds_ahead=""
shards=2 ranks=2 summary="" base="" data_a="" data_b="" data_c="" wan_rate="" wan_capture="" idle_seconds=0 eval_sets=() eval_batches=16
eval_every=0 report="" export=false top_interval=1 base_hf=false model_given=false reference="" translate_sets=() translate_lines=200 translate_sites="" round_translate_lines=50
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out="$2"; shift 2 ;;
    --model) model="$2"; model_given=true; shift 2 ;;
    --codec) codec="$2"; shift 2 ;;
    --adaptive) adaptive=true; shift ;;
    --no-adaptive) adaptive=false; shift ;;
    --adaptive-floor) adaptive_floor="$2"; shift 2 ;;
    --adaptive-ceiling) adaptive_ceiling="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --steps-per-round) steps="$2"; shift 2 ;;
    --site-b-steps) steps_b="$2"; shift 2 ;;
    --train) train_extra="$2"; shift 2 ;;
    --outer-lr) outer_lr="$2"; shift 2 ;;
    --max-rounds-ahead) rounds_ahead="$2"; shift 2 ;;
    --outer-momentum) outer_mom="$2"; shift 2 ;;
    --shards) shards="$2"; shift 2 ;;
    --ranks) ranks="$2"; shift 2 ;;
    --summary) summary="$2"; shift 2 ;;
    --wan-rate) wan_rate="$2"; shift 2 ;;
    --wan-capture) wan_capture="$2"; shift 2 ;;
    --idle-seconds) idle_seconds="$2"; shift 2 ;;
    --eval-set) eval_sets+=("$2"); shift 2 ;;
    --translate-set) translate_sets+=("$2"); shift 2 ;;
    --translate-lines) translate_lines="$2"; shift 2 ;;
    --translate-sites) translate_sites="$2"; shift 2 ;;
    --round-translate-lines) round_translate_lines="$2"; shift 2 ;;
    --distill) distill="$2"; distill_on=true; shift 2 ;;
    --eval-batches) eval_batches="$2"; shift 2 ;;
    --eval-every-rounds) eval_every="$2"; shift 2 ;;
    --report) report="$2"; shift 2 ;;
    --export) export=true; shift ;;
    --reference) reference="$2"; shift 2 ;;
    --top-interval) top_interval="$2"; shift 2 ;;
    --base) base="$2"; shift 2 ;;
    --base-hf) base="$2"; base_hf=true; shift 2 ;;
    --data-a) data_a="$2"; shift 2 ;;
    --data-b) data_b="$2"; shift 2 ;;
    --data-c) data_c="$2"; shift 2 ;;
    -h|--help) sed -n 2,79p "$0"; exit 0 ;;
    *) echo "two-site.sh: unknown option '$1' (try --help)" >&2; exit 2 ;;
  esac
done
for v in base data_a data_b; do
  if [ -z "${!v}" ]; then echo "two-site.sh: --${v//_/-} is required (try --help)" >&2; exit 2; fi
done
if $base_hf; then
  if [ ! -f "$base/config.json" ]; then
    echo "two-site.sh: --base-hf $base: no config.json there (a Hugging Face model folder has one)" >&2; exit 2
  fi
  # The folder's config.json sets the shape: only the LoRA settings are ours.
  $model_given || model="--lora-rank 8 --lora-alpha 16"
fi
if [ -n "$data_c" ] && [ -n "$wan_rate" ]; then
  echo "two-site.sh: --wan-rate shapes the link between two sites; it does not take --data-c" >&2; exit 2
fi
for t in "${translate_sets[@]}"; do
  if [[ "$t" != ?*=?* ]] || [ ! -r "${t#*=}" ]; then
    echo "two-site.sh: --translate-set $t: give LANG=FILE with a readable heldout-LANG.jsonl" >&2; exit 2
  fi
done
if [ -n "$reference" ] && ! /usr/bin/python3 -c 'import json, sys; json.load(open(sys.argv[1]))' "$reference" 2>/dev/null; then
  echo "two-site.sh: --reference $reference is not a readable JSON file" >&2; exit 2
fi
for b in "$server" "$ctl" "$worker"; do
  [ -x "$b" ] || { echo "two-site.sh: $b is not built (cmake --build $build)" >&2; exit 2; }
done
steps_b="${steps_b:-$steps}"
# shellcheck disable=SC2206
model_flags=($model)
# shellcheck disable=SC2206
train_flags=($train_extra)
# Per-round evaluation by the workers (their --events record it): the site's own data and
# every --eval-set. Without --eval-every-rounds the sets are evaluated once, at the end.
if [ "$eval_every" -gt 0 ]; then
  train_flags+=(--eval-every-rounds "$eval_every")
  for e in "${eval_sets[@]}"; do train_flags+=(--eval-set "$e"); done
  # And chrF by round: rank 0 translates the first lines of each --translate-set.
  for e in "${translate_sets[@]}"; do train_flags+=(--translate-set "$e"); done
  [ ${#translate_sets[@]} -eq 0 ] || train_flags+=(--translate-lines "$round_translate_lines")
fi

rm -rf "$out"
mkdir -p "$out/keys/admins" "$out/logs"
pids=()
ns="" veth=""
cleanup() {
  # SIGTERM first (shards and workers shut down cleanly), SIGKILL what is left after 10 s.
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for _ in $(seq 50); do
    alive=0
    for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ "$alive" -eq 0 ] && break
    sleep 0.2
  done
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  # The port holder (a coprocess) would end only when this shell does: the wait below
  # would wait for it for ever.
  [ -n "${PORT_HOLDER_PID:-}" ] && kill "$PORT_HOLDER_PID" 2>/dev/null || true
  wait 2>/dev/null || true
  if [ -n "$ns" ]; then
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    ip link del "$veth" 2>/dev/null || true
    ip netns del "$ns" 2>/dev/null || true
  fi
}
trap cleanup EXIT
trap 'exit 143' INT TERM  # a signal exits through the EXIT trap too
# Where each site's sockets live: both on loopback, or with --wan-rate site A on the host
# side of a shaped veth pair and site B inside its own network namespace.
declare -A host_of=([A]=127.0.0.1 [B]=127.0.0.1 [C]=127.0.0.1)
declare -A admin_host_of=([A]=127.0.0.1 [B]=127.0.0.1 [C]=127.0.0.1)
declare -A admin_bind_of=([A]=127.0.0.1 [B]=127.0.0.1 [C]=127.0.0.1)
declare -A verify_host_of=([A]=127.0.0.1 [B]=127.0.0.1 [C]=127.0.0.1)
if [ -n "$wan_rate" ]; then
  if [ "$(id -u)" -ne 0 ] || ! command -v tc >/dev/null; then
    echo "two-site.sh: --wan-rate needs root and tc/ip (iproute2)" >&2; exit 2
  fi
  net=$(( $$ % 200 + 20 ))
  ns="isthmus-wan-$$" veth="isw$$a"
  ip netns add "$ns"
  ip netns exec "$ns" ip link set lo up
  ip link add "$veth" type veth peer name "isw$$b"
  ip link set "isw$$b" netns "$ns"
  ip addr add "10.77.$net.1/24" dev "$veth" && ip link set "$veth" up
  ip netns exec "$ns" ip addr add "10.77.$net.2/24" dev "isw$$b"
  ip netns exec "$ns" ip link set "isw$$b" up
  # No IPv6 on the WAN link: its neighbour discovery would be counted as WAN traffic.
  sysctl -qw "net.ipv6.conf.$veth.disable_ipv6=1" 2>/dev/null || true
  ip netns exec "$ns" sysctl -qw "net.ipv6.conf.isw$$b.disable_ipv6=1" 2>/dev/null || true
  tc qdisc add dev "$veth" root tbf rate "$wan_rate" burst 32kbit latency 2s
  ip netns exec "$ns" tc qdisc add dev "isw$$b" root tbf rate "$wan_rate" burst 32kbit latency 2s
  # Only the peer links cross the WAN: site B's admin socket listens on every address of its
  # namespace, its own polling uses the namespace's loopback, and only the final
  # cross-site verify (after the WAN counters are read) reaches it over the veth.
  if [ -n "$wan_capture" ]; then
    command -v tcpdump >/dev/null || { echo "two-site.sh: --wan-capture needs tcpdump" >&2; exit 2; }
    tcpdump -i "$veth" -w "$wan_capture" -U -q 2>/dev/null &
    pids+=($!)
    sleep 0.5
  fi
  host_of=([A]="10.77.$net.1" [B]="10.77.$net.2") admin_host_of=([A]=127.0.0.1 [B]=127.0.0.1)
  admin_bind_of=([A]=127.0.0.1 [B]=0.0.0.0) verify_host_of=([A]=127.0.0.1 [B]="10.77.$net.2")
fi
# The kernel's byte counters of the WAN veth (both directions, Ethernet frames included).
wan_counter() {
  if [ -z "$veth" ]; then echo 0; return; fi
  echo $(( $(cat "/sys/class/net/$veth/statistics/tx_bytes") + $(cat "/sys/class/net/$veth/statistics/rx_bytes") ))
}
# Command prefix that runs a process where SITE's processes live. Used as
# "${prefix[@]}" CMD ... &, so $! is the process itself (ip netns exec execs it).
declare -A netns_of=([A]="" [B]="$ns" [C]="")
site_prefix() {  # fills the array `prefix` for site $1
  prefix=()
  if [ -n "${netns_of[$1]}" ]; then prefix=(ip netns exec "${netns_of[$1]}"); fi
}
quiet() { "$@" >/dev/null; }

sites=(A B)
[ -n "$data_c" ] && sites+=(C)
declare -A data_of=([A]="$data_a" [B]="$data_b" [C]="$data_c")
declare -A steps_of=([A]="$steps" [B]="$steps_b" [C]="$steps")
declare -A wport aport pport
make_keys "$ctl" "$out/keys" "$shards" "${sites[@]}"
export ISTHMUS_CTL_KEY="$out/keys/admins/admin.key"
# Every port of the run, outside the ephemeral range and claimed until this script ends
# (deploy/free_port.py --hold, a coprocess that exits when its stdin, our pipe, closes): no
# test or script running beside this one takes a port before its server binds it, and no
# two are the same.
nports=$((${#sites[@]} * shards * 3))
coproc PORT_HOLDER { exec /usr/bin/python3 deploy/free_port.py --hold "$nports"; }
mapfile -t -n "$nports" held_ports <&"${PORT_HOLDER[0]}"
if [ "${#held_ports[@]}" -ne "$nports" ]; then
  echo "two-site.sh: could not claim $nports free TCP ports on 127.0.0.1" >&2
  exit 1
fi
k=0
for s in "${sites[@]}"; do
  for ((i = 0; i < shards; i++)); do
    wport[$s-$i]=${held_ports[k]} aport[$s-$i]=${held_ports[k + 1]} pport[$s-$i]=${held_ports[k + 2]}
    k=$((k + 3))
  done
done

# The [sync] settings given on the command line; the others are the server's defaults.
sync_lines=""
[ -n "$codec" ] && sync_lines+="codec = \"$codec\""$'\n'
[ -n "$adaptive" ] && sync_lines+="adaptive = $adaptive"$'\n'
[ -n "$adaptive_floor" ] && sync_lines+="adaptive_floor = \"$adaptive_floor\""$'\n'
[ -n "$adaptive_ceiling" ] && sync_lines+="adaptive_ceiling = \"$adaptive_ceiling\""$'\n'
[ -n "$outer_lr" ] && sync_lines+="outer_lr = $outer_lr"$'\n'
[ -n "$outer_mom" ] && sync_lines+="outer_momentum = $outer_mom"$'\n'
[ -n "$rounds_ahead" ] && sync_lines+="max_rounds_ahead = $rounds_ahead"$'\n'

# Shard configs: shard i of each site peers with shard i of the other site.
for s in "${sites[@]}"; do
  for ((i = 0; i < shards; i++)); do
    peers=""
    for t in "${sites[@]}"; do
      [ "$t" = "$s" ] && continue
      peers+="\"$t=tcp://${host_of[$t]}:${pport[$t-$i]}=$out/keys/$t-$i.pub\", "
    done
    shard_toml "$out" "$out/keys" "$s" "$i" "tcp://127.0.0.1:${wport[$s-$i]}" \
      "tcp://${admin_bind_of[$s]}:${aport[$s-$i]}" "tcp://${host_of[$s]}:${pport[$s-$i]}" \
      "${peers%, }" "$sync_lines" > "$out/$s-$i.toml"
    site_prefix "$s"
    "${prefix[@]}" "$server" --config "$out/$s-$i.toml" 2> "$out/logs/shard-$s-$i.log" &
    pids+=($!)
  done
done
wan_start=$(wan_counter)
admin_args() {  # --server/--server-key pairs of site $1's admin sockets
  for ((i = 0; i < shards; i++)); do
    printf -- '--server\ntcp://%s:%s\n--server-key\n%s\n' "${admin_host_of[$1]}" "${aport[$1-$i]}" "$out/keys/$1-$i.pub"
  done
}
worker_args() {  # the same for the worker sockets
  for ((i = 0; i < shards; i++)); do
    printf -- '--server\ntcp://127.0.0.1:%s\n--server-key\n%s\n' "${wport[$1-$i]}" "$out/keys/$1-$i.pub"
  done
}
for s in "${sites[@]}"; do
  mapfile -t a < <(admin_args "$s")
  site_prefix "$s"
  for _ in $(seq 100); do "${prefix[@]}" "$ctl" status "${a[@]}" --timeout-ms 300 >/dev/null 2>&1 && break; sleep 0.2; done
done
# One `isthmusctl top --json` per site, where the site's processes run (site B's admin
# sockets are on its namespace's loopback, so its samples never cross the WAN): the
# report's per-round WAN bytes, lag, bandwidth and codec come from these samples.
tpids=()
for s in "${sites[@]}"; do
  mapfile -t a < <(admin_args "$s")
  site_prefix "$s"
  "${prefix[@]}" "$ctl" top --json --interval "$top_interval" "${a[@]}" > "$out/top-$s.jsonl" 2> "$out/logs/top-$s.log" &
  tpids+=($!)
done
pids+=("${tpids[@]}")

# The same initial adapters and base hash on both sites.
base_hash=$("$worker" init "${model_flags[@]}" --base "$base" --out "$out/init.safetensors" 2>/dev/null | tail -1)
for s in "${sites[@]}"; do
  mapfile -t a < <(admin_args "$s")
  site_prefix "$s"
  quiet "${prefix[@]}" "$ctl" job create "${a[@]}" --job demo --from "$out/init.safetensors" --base-hash "$base_hash"
done

echo "two-site: sites ${sites[*]}, $shards shards and $ranks ranks each, $rounds rounds" \
     "$([ -n "$wan_rate" ] && echo "WAN shaped to $wan_rate")" \
     "(H = ${steps_of[A]} at A, ${steps_of[B]} at B$([ -n "$data_c" ] && echo ", ${steps_of[C]} at C")), codec '${codec:-default}'$([ "$adaptive" != false ] && echo ', adaptive')"
start=$(date +%s)
wpids=()
for s in "${sites[@]}"; do
  mapfile -t w < <(worker_args "$s")
  mkdir -p "$out/rendezvous-$s"
  site_prefix "$s"
  d=()
  if [ "$distill_on" = true ]; then
    # shellcheck disable=SC2206
    d=(--teacher-topk "${data_of[$s]}/train.topk" $distill)
  fi
  for ((r = 0; r < ranks; r++)); do
    "${prefix[@]}" "$worker" train "${model_flags[@]}" --base "$base" --job demo "${w[@]}" \
      --key "$out/keys/workers-$s/worker.key" --client-name "$s" --data "${data_of[$s]}" \
      --rank "$r" --world-size "$ranks" --rendezvous "file:$out/rendezvous-$s" \
      --steps-per-round "${steps_of[$s]}" --max-rounds "$rounds" \
      --checkpoint-dir "$out/checkpoints-$s" --json-summary "$out/worker-$s-$r.json" \
      --events "$out/events-$s.jsonl" \
      --no-progress --log-every 20 "${train_flags[@]}" "${d[@]}" > "$out/logs/worker-$s-$r.log" 2>&1 &
    wpids+=($!)
  done
done
pids+=("${wpids[@]}")
failed=0
for p in "${wpids[@]}"; do wait "$p" || failed=1; done
if [ "$failed" -ne 0 ]; then
  echo "two-site: a worker failed; its log:" >&2
  tail -n 20 "$out"/logs/worker-*.log >&2
  exit 1
fi
trained=$(( $(date +%s) - start ))

# Wait (bounded) until every shard of both sites has committed every round and every
# link has its last round acknowledged (acks may wait sync.ack_delay_ms for a delta to
# ride in): the WAN bytes then cover the whole exchange.
for _ in $(seq 300); do
  done_all=1
  for s in "${sites[@]}"; do
    mapfile -t a < <(admin_args "$s")
    site_prefix "$s"
    "${prefix[@]}" "$ctl" sync status "${a[@]}" --json > "$out/sync-$s.json" 2>/dev/null || { done_all=0; continue; }
    /usr/bin/python3 -c '
import json, sys
rows = json.load(open(sys.argv[1]))
ok = all(j["committed_round"] >= int(sys.argv[2]) for r in rows for j in r.get("jobs", []) if j["job"] == "demo")
ok = ok and all(j["lag_rounds"] == 0 for r in rows for l in r.get("links", []) for j in l["jobs"])
sys.exit(0 if ok and rows else 1)' "$out/sync-$s.json" "$rounds" || done_all=0
  done
  [ "$done_all" -eq 1 ] && break
  sleep 0.5
done
wan_end=$(wan_counter)
idle_bytes=0
if [ -n "$veth" ] && [ "$idle_seconds" -gt 0 ]; then
  # Idle: nothing left to send; only keep-alives (one per sync.backoff_max_ms) may cross.
  sleep 1
  idle_start=$(wan_counter)
  sleep "$idle_seconds"
  idle_bytes=$(( $(wan_counter) - idle_start ))
fi

# The translations run side by side, at most one per core; each is scored once it is done.
translating=() translated=()  # their pids, oldest first, and their SITE-LANG names
finish_translation() {  # waits for the oldest translation and scores it if it succeeded
  local name=${translated[0]}
  if wait "${translating[0]}"; then
    /usr/bin/python3 deploy/chrf.py --json "$out/translate-$name.jsonl" \
      > "$out/chrf-$name.json" 2>> "$out/logs/translate-$name.log" || true
  fi
  translating=("${translating[@]:1}") translated=("${translated[@]:1}")
}
# Evaluate each site's committed model on both sites' validation data, and translate.
for s in "${sites[@]}"; do
  mapfile -t w < <(worker_args "$s")
  site_prefix "$s"
  for d in "${sites[@]}"; do
    "${prefix[@]}" "$worker" eval "${model_flags[@]}" --base "$base" --job demo "${w[@]}" \
      --key "$out/keys/workers-$s/worker.key" --data "${data_of[$d]}" --json \
      --batches "$eval_batches" > "$out/eval-$s-on-$d.json" 2> "$out/logs/eval-$s-on-$d.log"
  done
  for e in "${eval_sets[@]}"; do
    "${prefix[@]}" "$worker" eval "${model_flags[@]}" --base "$base" --job demo "${w[@]}" \
      --key "$out/keys/workers-$s/worker.key" --data "${e#*=}" --json --batches "$eval_batches" \
      > "$out/eval-$s-set-${e%%=*}.json" 2> "$out/logs/eval-$s-set-${e%%=*}.log"
  done
  if [ "$export" = true ]; then
    "${prefix[@]}" "$worker" export "${model_flags[@]}" --base "$base" --job demo "${w[@]}" \
      --key "$out/keys/workers-$s/worker.key" --out "$out/trainable-$s.safetensors" \
      2> "$out/logs/export-$s.log" ||
      { cat "$out/logs/export-$s.log" >&2; echo "two-site: export of site $s failed" >&2; }
  fi
  [ -z "$translate_sites" ] || [[ ",$translate_sites," == *",$s,"* ]] || continue
  for t in "${translate_sets[@]}"; do
    lang="${t%%=*}"
    head -n "$translate_lines" "${t#*=}" > "$out/translate-input-$lang.jsonl"
    while [ ${#translating[@]} -ge "$(getconf _NPROCESSORS_ONLN)" ]; do finish_translation; done
    "${prefix[@]}" "$worker" generate "${model_flags[@]}" --base "$base" --job demo "${w[@]}" \
      --key "$out/keys/workers-$s/worker.key" --translate "$lang" \
      --input "$out/translate-input-$lang.jsonl" --output "$out/translate-$s-$lang.jsonl" \
      2> "$out/logs/translate-$s-$lang.log" &
    translating+=($!) translated+=("$s-$lang")
  done
done
while [ ${#translating[@]} -gt 0 ]; do finish_translation; done
# The top samples end here (SIGTERM is top's normal end: exit 0).
for p in "${tpids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
for p in "${tpids[@]}"; do wait "$p" 2>/dev/null || echo "two-site: isthmusctl top (pid $p) ended with exit $?" >&2; done
verify_args=()
for s in "${sites[@]}"; do
  eps=""
  for ((i = 0; i < shards; i++)); do eps+="tcp://${verify_host_of[$s]}:${aport[$s-$i]},"; done
  keys=""
  for ((i = 0; i < shards; i++)); do keys+="$out/keys/$s-$i.pub,"; done
  verify_args+=(--site "$s=${eps%,}" --site-key "$s=${keys%,}")
done
set +e
"$ctl" sync verify "${verify_args[@]}" --json > "$out/verify.json" 2> "$out/logs/verify.log"
verify_rc=$?
set -e

set_names=""
for e in "${eval_sets[@]}"; do set_names+="${e%%=*},"; done
translate_names=""
for t in "${translate_sets[@]}"; do translate_names+="${t%%=*},"; done
set +e
/usr/bin/python3 - "$out" "$rounds" "$trained" "$verify_rc" "${summary:-}" "$((wan_end - wan_start))" "$wan_rate" "$idle_seconds" "$idle_bytes" "${set_names%,}" "$reference" "${sites[*]}" "${translate_names%,}" "$translate_sites" <<'PY'
import json, os, sys
out, rounds, trained, verify_rc, summary = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
kernel_bytes, wan_rate = int(sys.argv[6]), sys.argv[7]
idle_seconds, idle_bytes = int(sys.argv[8]), int(sys.argv[9])
set_names = [n for n in sys.argv[10].split(",") if n]
reference = json.load(open(sys.argv[11])) if sys.argv[11] else None
sites = sys.argv[12].split()
translate_names = [n for n in sys.argv[13].split(",") if n]
translate_sites = [t for t in sys.argv[14].split(",") if t]
result = {"rounds": rounds, "train_seconds": trained, "sites": {}}
try:
    verify = json.load(open(f"{out}/verify.json"))
    agree = verify_rc == 0 and all(r.get("agree") for r in verify)
    compared = min((r.get("rounds_compared", 0) for r in verify), default=0)
except Exception as e:  # reported, not hidden
    verify, agree, compared = None, False, 0
for s in sites:
    rows = json.load(open(f"{out}/sync-{s}.json"))
    committed = min(j["committed_round"] for r in rows for j in r.get("jobs", []) if j["job"] == "demo")
    links = [l for r in rows for l in r.get("links", [])]
    sent = sum(l["bytes_sent"] for l in links)
    raw = sum(l["raw_bytes_sent"] for l in links)
    wire_sent = sum(l["wire_bytes_sent"] for l in links)
    wire_received = sum(l["wire_bytes_received"] for l in links)
    tcp = sum(l["tcp_bytes_estimate"] for l in links)
    losses = {}
    for d in sites:
        try:
            losses[d] = json.load(open(f"{out}/eval-{s}-on-{d}.json"))["val_loss"]
        except Exception:
            losses[d] = None
    sets = {}
    for n in set_names:
        try:
            sets[n] = json.load(open(f"{out}/eval-{s}-set-{n}.json"))["val_loss"]
        except Exception:
            sets[n] = None
    chrf = {}
    for n in translate_names if not translate_sites or s in translate_sites else []:
        try:
            chrf[n] = json.load(open(f"{out}/chrf-{s}-{n}.json"))["chrf"]
        except Exception:
            chrf[n] = None
    result["sites"][s] = {"committed_round": committed, "wan_bytes_sent": sent,
                          "chrf": chrf,
                          "val_loss_sets": sets,
                          "raw_bytes": raw, "compression_ratio": (raw / sent) if sent else None,
                          "wire_bytes_sent": wire_sent, "wire_bytes_received": wire_received,
                          "tcp_bytes_estimate": tcp,
                          "wire_ratio": (raw / wire_sent) if wire_sent else None,
                          "val_loss": losses}
result["digests_agree"] = agree
result["rounds_verified"] = compared
print()
# The wire (every message, framing, CURVE, handshakes) is the headline; the payload after.
print(f"{'site':<6}" + "".join(f"{'val loss ' + d:>12}" for d in sites)
      + f"{'committed':>11}{'wire sent':>12}{'wire x':>8}{'payload':>10}{'payload x':>11}")
for s, r in result["sites"].items():
    fmt = lambda v: f"{v:.4f}" if isinstance(v, float) else "n/a"
    x = lambda v: f"{v:.1f}x" if v else "n/a"
    print(f"{s:<6}" + "".join(f"{fmt(r['val_loss'][d]):>12}" for d in sites)
          + f"{r['committed_round']:>11}"
          f"{r['wire_bytes_sent']:>12,}{x(r['wire_ratio']):>8}{r['wan_bytes_sent']:>10,}"
          f"{x(r['compression_ratio']):>11}")
if reference:
    result["reference"] = reference
    before, central = reference.get("before", {}), reference.get("centralised", {})
    print(f"{'set':<6}{'before round 1':>16}" + "".join(f"{'site ' + s:>10}" for s in sites)
          + f"{'centralised':>13}")
    for n in set_names:
        fmt = lambda v: f"{v:.4f}" if isinstance(v, float) else "n/a"
        print(f"{n:<6}{fmt(before.get(n)):>16}"
              + "".join(f"{fmt(result['sites'][s]['val_loss_sets'].get(n)):>10}" for s in sites)
              + f"{fmt(central.get(n)):>13}")
if translate_names:
    result["translate_lines"] = {n: sum(1 for _ in open(f"{out}/translate-input-{n}.jsonl"))
                                 for n in translate_names}
    print(f"{'chrF':<6}" + "".join(f"{'site ' + s:>10}" for s in sites) + f"{'lines':>8}")
    for n in translate_names:
        fmt = lambda v: f"{v:.2f}" if isinstance(v, float) else "n/a"
        print(f"{n:<6}" + "".join(f"{fmt(result['sites'][s]['chrf'].get(n)):>10}" for s in sites)
              + f"{result['translate_lines'][n]:>8}")
print(f"committed digests agree across sites: {'yes' if agree else 'NO'} ({compared} rounds compared per shard)")
print(f"training wall time: {trained} s")
payload = sum(r["wan_bytes_sent"] for r in result["sites"].values())
wire = sum(r["wire_bytes_sent"] for r in result["sites"].values())
# Each site estimates the TCP/IP headers of both directions of its links: halve the sum.
tcp = sum(r["tcp_bytes_estimate"] for r in result["sites"].values()) // 2
result["counted_wan_bytes"] = wire + tcp
result["payload_bytes"] = payload
if wan_rate:
    result["kernel_wan_bytes"] = kernel_bytes
    print(f"WAN veth, both directions: kernel counted {kernel_bytes:,} bytes = "
          f"{kernel_bytes / payload:.2f}x the {payload:,} delta payload bytes; the sites counted "
          f"{wire:,} wire bytes + ~{tcp:,} TCP/IP (estimated) = {(wire + tcp) / kernel_bytes:.2f}x "
          f"the kernel's")
    result["kernel_to_payload"] = kernel_bytes / payload if payload else None
    if idle_seconds > 0:
        result["idle_seconds"] = idle_seconds
        result["idle_kernel_bytes"] = idle_bytes
        result["idle_bytes_per_second"] = idle_bytes / idle_seconds
        print(f"idle WAN after the last round: kernel counted {idle_bytes:,} bytes in "
              f"{idle_seconds} s = {idle_bytes / idle_seconds:.1f} bytes/s")
json.dump(result, open(f"{out}/summary.json", "w"), indent=2)
if summary and os.path.abspath(summary) != os.path.abspath(f"{out}/summary.json"):
    json.dump(result, open(summary, "w"), indent=2)
scored = all(v is not None for r in result["sites"].values() for v in r["chrf"].values())
if not scored:
    print("two-site: a translation set was not scored (logs/translate-*.log)", file=sys.stderr)
sys.exit(0 if agree and scored and all(r["committed_round"] >= rounds for r in result["sites"].values()) else 1)
PY
rc=$?
set -e
if [ -n "$report" ]; then
  # The report is written whatever the run's outcome: a failed run is worth a look too.
  /usr/bin/python3 deploy/report.py --run "$out" --out "$report" || {
    echo "two-site: the report was not written (deploy/report.py failed)" >&2
    [ "$rc" -ne 0 ] || rc=1
  }
fi
exit "$rc"
