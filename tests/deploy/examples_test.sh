#!/usr/bin/env bash
# DeployInstall.ExamplesAndUnitsMatchThePrograms: the example configs and the units agree
# with the programs they are for.
#  - isthmus-server reads deploy/examples/shard.toml (it then stops at the first missing
#    key file the example names, exit 4: every key of the file was accepted; an unknown
#    key would have been exit 2);
#  - isthmus-worker train reads deploy/examples/worker.toml (it stops at the missing base
#    the example names), refuses a key that is no flag, and a flag wins over the file;
#  - shard.toml and worker.toml are one site's, laid out as `isthmusctl fleet init` writes
#    it (docs/DEPLOY.md): every setting fleet init writes has fleet init's value in them
#    (key paths included), and they agree with each other (site name, shard 0's endpoint
#    and key pair);
#  - docs/CONFIG.md's example is shard.toml, verbatim;
#  - every flag the units pass is a flag of the program (--help), every variable the unit
#    expands has a default in the unit, and worker.env sets only variables the unit reads.
#   examples_test.sh SOURCE_DIR SERVER WORKER ISTHMUSCTL
set -euo pipefail
# shellcheck source=tests/deploy/checks.sh
. "$(dirname "$0")/checks.sh"
usage 4 16 "$@"
src="$1"
server="$2"
worker="$3"
ctl="$4"
examples="$src/deploy/examples"
units="$src/deploy/systemd"
export OMP_WAIT_POLICY=PASSIVE

# run NAME EXPECTED_CODE PATTERN COMMAND...: the command exits EXPECTED_CODE and says PATTERN.
run() {
  local name="$1" code="$2" pattern="$3" out rc=0
  shift 3
  out="$("$@" 2>&1)" || rc=$?
  if [ "$rc" -ne "$code" ] || ! grep -qF -- "$pattern" <<<"$out"; then
    printf '%s\n' "$out" | tail -n 5
    fail "$name: expected exit $code and '$pattern', got exit $rc"
  else
    echo "$name: exit $rc, '$pattern'"
  fi
}

# (its data_dir moved to a scratch folder; the shard reads its key pair and allowlists
# before it touches its data dir, so the first file it opens is security.secret_key)
key_path="$(sed -n 's/^secret_key = "\([^"]*\)".*/\1/p' "$examples/shard.toml")"
[ -n "$key_path" ] || fail "shard.toml names no security.secret_key"
run "shard.toml" 4 "$key_path" "$server" --config "$examples/shard.toml" \
  --shard.data_dir="$tmp/shard-data"
# With that key found, the next file it opens: the folder of security.worker_keys.
workers_path="$(sed -n 's/^worker_keys = \["\([^"]*\)"\].*/\1/p' "$examples/shard.toml")"
[ -n "$workers_path" ] || fail "shard.toml names no security.worker_keys folder"
"$ctl" keygen --out "$tmp/A-0" >/dev/null
run "shard.toml with its key" 4 "$workers_path" "$server" --config "$examples/shard.toml" \
  --shard.data_dir="$tmp/shard-data" --security.secret_key="$tmp/A-0.key"

# The examples against the site fleet init writes with the options their header names.
"$ctl" fleet init --sites A,B --shards 2 --host A=10.0.0.1 --host B=10.1.0.1 --job demo \
  --metrics --out "$tmp/fleet" >/dev/null || fail "isthmusctl fleet init failed"
python3 - "$examples/shard.toml" "$tmp/fleet/A/A-0.toml" "$examples/worker.toml" \
  "$tmp/fleet/A/worker.toml" <<'PY' || fail "the examples do not follow fleet init's layout (above)"
import sys, tomllib

def load(path):
    with open(path, "rb") as f:
        return tomllib.load(f)

def flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat(v, prefix + k + "."))
        else:
            out[prefix + k] = v
    return out

shard, fleet_shard, wk, fleet_wk = (flat(load(p)) for p in sys.argv[1:5])
bad = []
for name, example, fleet in (("shard.toml", shard, fleet_shard), ("worker.toml", wk, fleet_wk)):
    for key, value in fleet.items():
        if example.get(key) != value:
            bad.append(f"{name}: {key} is {example.get(key)!r}, fleet init writes {value!r}")
# The two examples are one site: its name, shard 0's worker endpoint and key pair.
if wk.get("client-name") != shard.get("sync.site"):
    bad.append(f"worker.toml's client-name {wk.get('client-name')!r} is not shard.toml's "
               f"sync.site {shard.get('sync.site')!r}")
if not wk.get("server") or wk["server"][0] != shard.get("listen.worker"):
    bad.append(f"worker.toml's first server {wk.get('server')} is not shard.toml's "
               f"listen.worker {shard.get('listen.worker')!r}")
secret = shard.get("security.secret_key", "")
if not wk.get("server-key") or wk["server-key"][0] != secret.removesuffix(".key") + ".pub":
    bad.append(f"worker.toml's first server-key {wk.get('server-key')} is not the public half "
               f"of shard.toml's security.secret_key {secret!r}")
keys_dir = secret.rsplit("/", 1)[0]
for path in [wk.get("key", "")] + shard.get("security.worker_keys", []):
    if path.rsplit("/", 1)[0] != keys_dir:
        bad.append(f"{path!r} is not in the keys folder {keys_dir!r} of shard.toml's secret_key")
for b in bad:
    print("  " + b)
sys.exit(1 if bad else 0)
PY
echo "shard.toml and worker.toml: fleet init's layout, one site"

# docs/CONFIG.md's example is shard.toml, verbatim (the block after "Example").
awk '/^Example/ { ex = 1 } ex && /^```toml$/ { on = 1; next } on && /^```$/ { exit } on' \
  "$src/docs/CONFIG.md" >"$tmp/config-md-example.toml"
if ! diff -u "$examples/shard.toml" "$tmp/config-md-example.toml"; then
  fail "docs/CONFIG.md's example differs from deploy/examples/shard.toml (above): copy the file into it"
fi

base_path="$(sed -n 's/^base = "\([^"]*\)".*/\1/p' "$examples/worker.toml")"
[ -n "$base_path" ] || fail "worker.toml names no base"
run "worker.toml" 4 "$base_path" "$worker" train --config "$examples/worker.toml" --device cpu
cp "$examples/worker.toml" "$tmp/extra.toml"
echo 'no-such-setting = 1' >>"$tmp/extra.toml"
run "worker.toml with an unknown key" 2 "no-such-setting" \
  "$worker" train --config "$tmp/extra.toml" --device cpu
run "a flag over worker.toml" 4 "$tmp/other-base.safetensors" \
  "$worker" train --config "$examples/worker.toml" --device cpu --base "$tmp/other-base.safetensors"

# Flags the units pass exist.
check_flags() {
  local unit="$1" help="$2" flag
  for flag in $(sed -n '/^ExecStart=/,/[^\\]$/p' "$unit" | grep -oE -- '--[a-z][a-z-]+' | sort -u); do
    grep -qE -- "(^|[ ,])$flag([ =,{]|$)" <<<"$help" || fail "$(basename "$unit") passes $flag, which $(basename "$3") does not have"
  done
}
check_flags "$units/isthmus-server@.service.in" "$("$server" --help 2>&1)" "$server"
check_flags "$units/isthmus-worker@.service.in" "$("$worker" train --help 2>&1)" "$worker"

# The worker unit: every ${VAR} it expands has a default; worker.env sets only ISTHMUS_*
# variables the unit reads (others, like NCCL_*, are for the programs) in KEY=VALUE lines.
wunit="$units/isthmus-worker@.service.in"
for var in $(grep -oE '\$\{?ISTHMUS_[A-Z_]+' "$wunit" | tr -d '${' | sort -u); do
  grep -q "^Environment=$var=" "$wunit" || fail "isthmus-worker@.service expands $var without a default"
done
while IFS= read -r line; do
  case "$line" in '' | '#'*) continue ;; esac
  [[ "$line" =~ ^[A-Z_][A-Z0-9_]*= ]] || fail "worker.env: not a KEY=VALUE line: $line"
  var="${line%%=*}"
  if [[ "$var" == ISTHMUS_* ]] && ! grep -q "^Environment=$var=" "$wunit"; then
    fail "worker.env sets $var, which isthmus-worker@.service does not read"
  fi
done <"$examples/worker.env"

finish "the examples are read by the programs and the units pass flags they have"
