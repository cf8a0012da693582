#!/usr/bin/env bash
# DeployInstall.Units: installs the build tree into a scratch prefix with `cmake --install
# --prefix`, checks the layout (binaries, units, sysusers.d/tmpfiles.d, docs, examples),
# that each unit names the binaries of that prefix, then runs `systemd-analyze verify` on
# every installed unit (templates through an instance) and holds the shard and worker
# units' `systemd-analyze security` exposure to the hardening they have. It first shows
# that the check catches mistakes: a misspelled directive (which systemd only warns
# about, exit status 0) and an ExecStart binary that does not exist.
#   units_test.sh BUILD_DIR
# Exit 77 (skipped) without systemd-analyze.
set -euo pipefail
build="$1"

if ! command -v systemd-analyze >/dev/null; then
  echo "SKIP: systemd-analyze not found (Debian: apt-get install systemd; deploy/install-deps.sh installs it)"
  exit 77
fi
# shellcheck source=tests/deploy/checks.sh
. "$(dirname "$0")/checks.sh"
prefix="$tmp/prefix"

if ! cmake --install "$build" --prefix "$prefix" >"$tmp/install.log" 2>&1; then
  cat "$tmp/install.log"
  echo "FAIL: cmake --install $build --prefix $prefix"
  exit 1
fi

# The layout.
units="$prefix/lib/systemd/system"
doc="$prefix/share/doc/isthmus"
for f in bin/isthmus-server bin/isthmusctl bin/isthmus-worker bin/isthmus-data; do
  [ -x "$prefix/$f" ] || fail "$f is not installed (or not executable)"
done
for f in isthmus-server@.service isthmus-worker@.service isthmus-site.target \
  isthmus-workers.target; do
  [ -f "$units/$f" ] || fail "unit $f is not in lib/systemd/system"
done
[ -f "$prefix/lib/sysusers.d/isthmus.conf" ] || fail "lib/sysusers.d/isthmus.conf missing"
[ -f "$prefix/lib/tmpfiles.d/isthmus.conf" ] || fail "lib/tmpfiles.d/isthmus.conf missing"
for f in README.md DEPLOY.md CONFIG.md WORKER.md examples/shard.toml examples/worker.toml \
  examples/worker.env; do
  [ -f "$doc/$f" ] || fail "share/doc/isthmus/$f missing"
done
[ ! -e "$prefix/etc" ] || fail "cmake --install wrote under etc/ (an operator's configuration must never be written over)"

# Each unit names this prefix's binaries and docs; no template placeholder is left.
server_exec="$(grep '^ExecStart=' "$units/isthmus-server@.service" || true)"
[ "$server_exec" = "ExecStart=$prefix/bin/isthmus-server --config /etc/isthmus/%i.toml" ] ||
  fail "isthmus-server@.service: unexpected '$server_exec'"
worker_exec="$(grep '^ExecStart=' "$units/isthmus-worker@.service" || true)"
case "$worker_exec" in
  "ExecStart=$prefix/bin/isthmus-worker train "*) ;;
  *) fail "isthmus-worker@.service: unexpected '$worker_exec'" ;;
esac
if grep -n '@ISTHMUS_\|/usr/local/' "$units"/isthmus-*; then
  fail "a unit keeps a placeholder or names /usr/local instead of the install prefix"
fi
grep -q "^Documentation=file:$doc/DEPLOY.md" "$units/isthmus-server@.service" ||
  fail "isthmus-server@.service does not point at the installed DEPLOY.md"

# systemd-analyze verify reports unknown directives and bad values on stderr and still
# exits 0; missing binaries make it exit 1. Both count as failures here.
verify() {
  local out rc=0
  out="$(systemd-analyze verify --man=no "$@" 2>&1)" || rc=$?
  if [ "$rc" -ne 0 ] || [ -n "$out" ]; then
    printf '%s\n' "$out"
    return 1
  fi
}
# Does the check see mistakes? A copy of the shard unit with one directive misspelled,
# then one whose binary is missing.
mkdir -p "$tmp/broken"
sed 's/^PrivateTmp=/PrivatTmp=/' "$units/isthmus-server@.service" >"$tmp/broken/isthmus-server@.service"
cp "$units/isthmus-site.target" "$tmp/broken/"
if verify "$tmp/broken/isthmus-server@a-0.service" >/dev/null; then
  fail "systemd-analyze verify did not report a misspelled directive (PrivatTmp=)"
fi
sed "s|^ExecStart=$prefix/bin/|ExecStart=$prefix/no-such-dir/|" "$units/isthmus-server@.service" \
  >"$tmp/broken/isthmus-server@.service"
if verify "$tmp/broken/isthmus-server@a-0.service" >/dev/null; then
  fail "systemd-analyze verify did not report a missing ExecStart binary"
fi

echo "systemd-analyze verify: the installed units"
verify "$units/isthmus-server@siteA-0.service" "$units/isthmus-worker@3.service" \
  "$units/isthmus-site.target" "$units/isthmus-workers.target" ||
  fail "systemd-analyze verify reported the problems above"

# Exposure (systemd-analyze security: 0 = fully sandboxed, 10 = not at all; --threshold
# counts in tenths). The limits are the exposures measured when the hardening was written,
# shard 1.2 and worker 1.9 (the worker keeps devices, W+X memory and NUMA calls for CUDA
# and NCCL; docs/DEPLOY.md): a weaker unit fails.
security() {
  local unit="$1" limit="$2" out rc=0
  out="$(systemd-analyze security --offline=yes --threshold="$limit" "$unit" 2>&1)" || rc=$?
  printf '%s\n' "$out" | tail -n 1
  if [ "$rc" -ne 0 ]; then
    printf '%s\n' "$out" | grep '✗' || true
    fail "$(basename "$unit"): exposure above $limit/10"
  fi
}
security "$units/isthmus-server@siteA-0.service" 12
security "$units/isthmus-worker@3.service" 19
# Some settings weigh too little to move the score: each one the units were reviewed with
# must still be there.
require() {
  local unit="$1" setting
  shift
  for setting in "$@"; do
    grep -qxF "$setting" "$units/$unit" || fail "$unit lacks $setting"
  done
}
common=(NoNewPrivileges=yes CapabilityBoundingSet= AmbientCapabilities= ProtectSystem=strict
  ProtectHome=yes PrivateTmp=yes PrivateMounts=yes ProtectHostname=yes
  ProtectKernelTunables=yes ProtectKernelModules=yes ProtectKernelLogs=yes
  ProtectControlGroups=yes ProtectProc=invisible RestrictNamespaces=yes RestrictRealtime=yes
  RestrictSUIDSGID=yes LockPersonality=yes RemoveIPC=yes SystemCallArchitectures=native
  SystemCallFilter=@system-service SystemCallFilter=~@privileged SystemCallErrorNumber=EPERM
  UMask=0077 User=isthmus)
require isthmus-server@.service "${common[@]}" PrivateDevices=yes PrivateIPC=yes \
  PrivateUsers=yes ProtectClock=yes ProcSubset=pid MemoryDenyWriteExecute=yes \
  "RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX AF_NETLINK" "RestartPreventExitStatus=2 3 4 6"
require isthmus-worker@.service "${common[@]}" \
  "RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX AF_NETLINK" SuccessExitStatus=7 \
  "RestartPreventExitStatus=2 3 4 6 8"
# GPU access: the worker must not close the device list or forbid W+X memory.
if grep -nE '^(PrivateDevices=yes|DevicePolicy=|DeviceAllow=|ProtectClock=yes|MemoryDenyWriteExecute=yes)' \
  "$units/isthmus-worker@.service"; then
  fail "isthmus-worker@.service would keep CUDA from its GPUs (see the unit's comments)"
fi

finish "layout, unit paths, systemd-analyze verify, exposure"
