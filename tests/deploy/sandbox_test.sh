#!/usr/bin/env bash
# DeploySandbox.ProcessTestsUnderTheUnits: runs the process tests of the shard (integration/
# shard_process_test), of cross-site sync (a few sync_net/sync_process_test cases) and of
# the worker (worker/worker_process_test) with isthmus-server and isthmus-worker started
# under the sandbox of their systemd units, as far as it can be built without systemd:
#  - the units' seccomp settings (system call filter, address families, W^X memory,
#    realtime, namespaces), applied by unit_sandbox.py from the unit files themselves;
#  - for the shard, when this process may make mount namespaces (root): the root file
#    system read-only but for the shard's own folder (ProtectSystem=strict) and a /proc
#    that shows processes only (ProcSubset=pid, ProtectProc=invisible).
# A setting that breaks a program shows as a failing process test: libzmq aborts in bind
# without AF_NETLINK and in every I/O thread without the @resources calls, which this test
# caught when the units were written (docs/DEPLOY.md). It first checks that the filters
# bite (a refused socket family, W+X memory, a @privileged call).
#   sandbox_test.sh SOURCE_DIR SANITIZED SERVER WORKER SHARD_TEST SYNC_TEST WORKER_TEST
#   (the programs and test binaries of the build)
# Exit 77 (skipped) without python3-seccomp or systemd-analyze, and in sanitizer builds
# (their runtimes make system calls of their own that the production binaries do not).
set -euo pipefail
src="$1"
sanitized="$2"
server_bin="$3"
worker_bin="$4"
shard_test="$5"
sync_test="$6"
worker_test="$7"

skip() {
  echo "SKIP: $*"
  exit 77
}
if [ "$sanitized" = ON ]; then
  skip "sanitizer build: the units' filters are checked against the production binaries, not ASan/TSan runtimes"
fi
python=/usr/bin/python3
[ -x "$python" ] || python="$(command -v python3)"
command -v systemd-analyze >/dev/null || skip "systemd-analyze not found (Debian: systemd)"
"$python" -c 'import seccomp' 2>/dev/null ||
  skip "python3-seccomp not found (Debian: apt-get install python3-seccomp; deploy/install-deps.sh installs it)"

server_unit="$src/deploy/systemd/isthmus-server@.service.in"
worker_unit="$src/deploy/systemd/isthmus-worker@.service.in"
sandbox="$src/tests/deploy/unit_sandbox.py"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# The filters bite: under the shard unit's, a packet socket, W+X memory and setuid are
# refused and an Internet socket is not; under the worker unit's, W+X memory is allowed.
cat >"$tmp/probe.py" <<'EOF'
import ctypes, errno, mmap, os, socket, sys
def probe(f):
    try:
        f()
        return "allowed"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))
libc = ctypes.CDLL(None, use_errno=True)
def unshare():
    if libc.unshare(0x10000000) != 0:  # CLONE_NEWUSER
        raise OSError(ctypes.get_errno(), "unshare")
print(" ".join([
    "packet=" + probe(lambda: socket.socket(17, socket.SOCK_RAW, 0)),
    "inet=" + probe(lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM)),
    "wx=" + probe(lambda: mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)),
    "setuid=" + probe(lambda: os.setuid(os.getuid())),
    "unshare=" + probe(unshare),
]))
EOF
server_probe="$("$python" "$sandbox" "$server_unit" -- "$python" "$tmp/probe.py")"
worker_probe="$("$python" "$sandbox" "$worker_unit" -- "$python" "$tmp/probe.py")"
echo "shard unit's filters:  $server_probe"
echo "worker unit's filters: $worker_probe"
[ "$server_probe" = "packet=EAFNOSUPPORT inet=allowed wx=EPERM setuid=EPERM unshare=EPERM" ] ||
  { echo "FAIL: the shard unit's filters do not act as the unit says"; exit 1; }
[ "$worker_probe" = "packet=EAFNOSUPPORT inet=allowed wx=allowed setuid=EPERM unshare=EPERM" ] ||
  { echo "FAIL: the worker unit's filters do not act as the unit says"; exit 1; }

# Mount namespaces: root may make them (unless a container forbids it).
ns=0
if [ "$(id -u)" -eq 0 ] && unshare -m --propagation private \
  sh -c 'mount -t proc -o subset=pid,hidepid=invisible proc /proc && mount -o remount,bind,ro /' \
  2>/dev/null; then
  ns=1
  echo "shard: also with a read-only root and a process-only /proc"
else
  echo "shard: seccomp filters only (no mount namespace here: not root, or not allowed)"
fi

cat >"$tmp/server.sh" <<EOF
#!/bin/sh
# isthmus-server as its unit would run it (tests/deploy/sandbox_test.sh).
run() { exec "$python" "$sandbox" "$server_unit" -- "$server_bin" "\$@"; }
case "$ns:\${1:-}" in
  1:--config=*) ;;
  *) run "\$@" ;;
esac
# The shard writes only where its test config lives (data_dir is inside that folder).
dir="\$(dirname "\${1#--config=}")"
exec unshare -m --propagation private sh -c '
  mount -t proc -o subset=pid,hidepid=invisible proc /proc &&
  mount --bind "\$0" "\$0" && mount -o remount,bind,ro / || exit 90
  shift
  exec "\$@"' "\$dir" - "$python" "$sandbox" "$server_unit" -- "$server_bin" "\$@"
EOF
cat >"$tmp/worker.sh" <<EOF
#!/bin/sh
exec "$python" "$sandbox" "$worker_unit" -- "$worker_bin" "\$@"
EOF
chmod +x "$tmp/server.sh" "$tmp/worker.sh"

export ISTHMUS_SERVER_BIN="$tmp/server.sh" ISTHMUS_WORKER_BIN="$tmp/worker.sh"
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
failures=0
run_suite() {
  local name="$1" binary="$2" filter="$3" out rc=0
  if [ ! -x "$binary" ]; then
    echo "FAIL: $binary not built"
    failures=$((failures + 1))
    return
  fi
  out="$("$binary" --gtest_filter="$filter" 2>&1)" || rc=$?
  if [ "$rc" -ne 0 ] || ! grep -qE '^\[  PASSED  \] [1-9][0-9]* test' <<<"$out"; then
    printf '%s\n' "$out" | tail -n 60
    echo "FAIL: $name under the units' sandbox (exit $rc)"
    failures=$((failures + 1))
  else
    echo "$name: $(grep -E '^\[  PASSED  \]' <<<"$out")"
  fi
}
run_suite shard "$shard_test" '*'
run_suite sync "$sync_test" \
  'SyncProcessTest.ThreeSitesCommitEveryRoundWithIdenticalDigests:SyncProcessTest.SenderKilledAfterClosingARoundResendsAfterRestart:SyncProcessTest.PeerWithUnlistedKeyIsRefused'
run_suite worker "$worker_test" '*'

if [ "$failures" -ne 0 ]; then
  exit 1
fi
echo "PASS: the shard's and the worker's process tests pass under their units' sandbox"
