#!/usr/bin/env bash
# DeployInstall.ExamplesAndUnitsMatchThePrograms: the example configs and the units agree
# with the programs they are for.
#  - isthmus-server reads deploy/examples/shard.toml (it then stops at the missing key
#    file the example names, exit 4: every key of the file was accepted; an unknown key
#    would have been exit 2);
#  - isthmus-worker train reads deploy/examples/worker.toml (it stops at the missing base
#    the example names), refuses a key that is no flag, and a flag wins over the file;
#  - every flag the units pass is a flag of the program (--help), every variable the unit
#    expands has a default in the unit, and worker.env sets only variables the unit reads.
#   examples_test.sh SOURCE_DIR SERVER WORKER
set -euo pipefail
src="$1"
server="$2"
worker="$3"
# shellcheck source=tests/deploy/checks.sh
. "$(dirname "$0")/checks.sh"
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

key_path="$(sed -n 's/^secret_key = "\([^"]*\)".*/\1/p' "$examples/shard.toml")"
[ -n "$key_path" ] || fail "shard.toml names no security.secret_key"
# (its data_dir moved to a scratch folder: the shard opens its database before its keys)
run "shard.toml" 4 "$key_path" "$server" --config "$examples/shard.toml" \
  --shard.data_dir="$tmp/shard-data"

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
