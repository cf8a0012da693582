#!/usr/bin/env bash
# A site's parameter servers driven by the admin CLI, end to end on loopback: builds what
# it needs, makes CURVE keys, starts two isthmus-server shards, creates a job from a
# safetensors file, shows status, takes and lists a snapshot, exports the job, and stops
# the shards with SIGTERM. Everything it writes goes to demo-out/shard/ (removed first).
#
#   deploy/demo-shard.sh     (env ISTHMUS_BUILD_DIR, default build)
set -euo pipefail
cd "$(dirname "$0")/.."
build="${ISTHMUS_BUILD_DIR:-build}"
out=demo-out/shard

deploy/install-deps.sh
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$build" --target isthmus-server isthmusctl -j"$(getconf _NPROCESSORS_ONLN)"
server="$build/server/isthmus-server"
ctl="$build/server/isthmusctl"

rm -rf "$out" && mkdir -p "$out/keys/workers" "$out/keys/admins"
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

step "keys: one per shard, one admin, one worker (secret files are mode 0600)"
"$ctl" keygen --out "$out/keys/admins/admin"
"$ctl" keygen --out "$out/keys/workers/worker0"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT
# Four ports outside the ephemeral range, claimed until this script ends (a coprocess that
# exits when its stdin, our pipe, closes): nothing beside it takes one before a shard binds it.
coproc PORT_HOLDER { exec /usr/bin/python3 deploy/free_port.py --hold 4; }
mapfile -t -n 4 held_ports <&"${PORT_HOLDER[0]}"
[ "${#held_ports[@]}" -eq 4 ] || { echo "demo-shard.sh: could not claim 4 free TCP ports" >&2; exit 1; }
admins=()
for i in 0 1; do
  "$ctl" keygen --out "$out/keys/shard$i"
  wp=${held_ports[2 * i]} ap=${held_ports[2 * i + 1]}
  cat > "$out/shard$i.toml" <<TOML
[shard]
id = "demo-$i"
data_dir = "$out/shard$i"
[listen]
worker = "tcp://127.0.0.1:$wp"
admin = "tcp://127.0.0.1:$ap"
[security]
secret_key = "$out/keys/shard$i.key"
worker_keys = ["$out/keys/workers"]
admin_keys = ["$out/keys/admins"]
TOML
  "$server" --config "$out/shard$i.toml" 2> "$out/shard$i.log" &
  pids+=($!)
  admins+=(--server "tcp://127.0.0.1:$ap" --server-key "$out/keys/shard$i.pub")
done
export ISTHMUS_CTL_KEY="$out/keys/admins/admin.key"
for _ in $(seq 50); do "$ctl" status "${admins[@]}" --timeout-ms 300 >/dev/null 2>&1 && break; sleep 0.2; done

step "initial tensors: a small model's LoRA adapters (random, deterministic) as safetensors"
/usr/bin/python3 - "$out/init.safetensors" <<'PY'
import json, random, struct, sys
random.seed(7)
tensors = {}
for layer in range(2):
    for mod, (fan_in, fan_out) in {"attn.c_attn": (64, 192), "mlp.c_fc": (64, 256)}.items():
        tensors[f"base_model.model.h.{layer}.{mod}.lora_A.weight"] = ([8, fan_in], [random.gauss(0, 0.02) for _ in range(8 * fan_in)])
        tensors[f"base_model.model.h.{layer}.{mod}.lora_B.weight"] = ([fan_out, 8], [0.0] * (fan_out * 8))
header, blobs, off = {}, [], 0
for name, (shape, vals) in sorted(tensors.items()):
    b = struct.pack(f"<{len(vals)}f", *vals)
    header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [off, off + len(b)]}
    blobs.append(b); off += len(b)
h = json.dumps(header).encode(); h += b" " * (-len(h) % 8)
with open(sys.argv[1], "wb") as f:
    f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))
PY

step "isthmusctl job create (tensors spread over both shards)"
"$ctl" job create "${admins[@]}" --job demo --from "$out/init.safetensors"
step "isthmusctl status"
"$ctl" status "${admins[@]}"
step "isthmusctl job describe"
"$ctl" job describe "${admins[@]}" --job demo | head -12
step "isthmusctl snapshot create / list"
"$ctl" snapshot create "${admins[@]}" first
"$ctl" snapshot list "${admins[@]}"
step "isthmusctl export (equals the file the job was created from)"
"$ctl" export "${admins[@]}" --job demo --out "$out/export.safetensors"
/usr/bin/python3 - "$out/init.safetensors" "$out/export.safetensors" <<'PY'
import json, struct, sys
def load(path):
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    head = json.loads(raw[8:8 + n]); body = raw[8 + n:]
    return {k: (v["shape"], body[v["data_offsets"][0]:v["data_offsets"][1]])
            for k, v in head.items() if k != "__metadata__"}
a, b = load(sys.argv[1]), load(sys.argv[2])
same = a == b
print(f"export: {len(b)} tensors; identical to the initial file: {same}")
sys.exit(0 if same else 1)
PY
step "a worker key is refused on the admin socket (exit code 3)"
set +e
ISTHMUS_CTL_KEY="$out/keys/workers/worker0.key" "$ctl" status "${admins[@]}" --timeout-ms 2000
echo "exit code: $?"
set -e
step "SIGTERM: clean shutdown"
for p in "${pids[@]}"; do kill -TERM "$p"; done
for p in "${pids[@]}"; do wait "$p"; echo "shard pid $p exited with $?"; done
pids=()
echo; echo "demo-shard: done; files in $out"
