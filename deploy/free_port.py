#!/usr/bin/python3
"""Prints a TCP port nobody listens on now on 127.0.0.1, outside the kernel's ephemeral
range (net.ipv4.ip_local_port_range): a port from that range (what binding port 0 gives)
can be taken at any moment as the source port of an outgoing connection, and the scripts
and tests bind their ports later, sometimes again after a restart. Ports are tried from a
random start, probed with bind() and claimed for the calling process the way
tests/loopback.h ClaimPorts does for the C++ tests (an exclusive flock on a file named after
the port in a folder of the temp dir, held until the process exits), so that tests running
side by side never pick a port another has picked and not yet bound. Used by
tests/python/harness.py (which imports free_port) and, with --hold N, by
deploy/two-site.sh and deploy/demo-shard.sh: a script's claim would end with this
process, before the script's servers bind the port, so --hold prints N distinct ports and
keeps their claims until its standard input ends (the script runs it as a coprocess, whose
pipe closes when the script exits).

Usage: free_port.py               one port, claimed while this process lives
       free_port.py --hold N      N ports, one per line, claimed until stdin ends"""

import fcntl
import os
import random
import socket
import sys
import tempfile

_claims = []  # descriptors holding this process's port claims


def _claim(port):
    """True if this process now holds the claim on `port` (or no claim folder can be used)."""
    folder = os.path.join(tempfile.gettempdir(), "isthmus-test-ports")
    try:
        os.makedirs(folder, exist_ok=True)
        os.chmod(folder, 0o1777)
    except OSError:
        pass
    try:
        fd = os.open(os.path.join(folder, str(port)), os.O_RDONLY | os.O_CREAT, 0o666)
    except OSError:
        return True  # no usable folder: the bind() probe decides
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    _claims.append(fd)
    return True


def _test_range():
    """The part of [1024, 65535] outside the kernel's ephemeral range where ports are picked."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            eph_lo, eph_hi = (int(x) for x in f.read().split())
    except (OSError, ValueError):
        eph_lo, eph_hi = 32768, 60999
    lo, hi = 10000, eph_lo - 1
    if 65535 - eph_hi > hi - lo:
        lo, hi = eph_hi + 1, 65535
    if hi <= lo:
        lo, hi = 1024, 65535
    return lo, hi


def _can_bind(port):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_range(count):
    """The first of `count` consecutive ports, each free now and claimed for this process."""
    lo, hi = _test_range()
    bases = list(range(lo, hi - count + 2))
    start = random.SystemRandom().randrange(len(bases))
    for base in bases[start:] + bases[:start]:
        ports = range(base, base + count)
        if not all(_can_bind(p) for p in ports):
            continue
        held = len(_claims)
        if all(_claim(p) for p in ports):
            return base
        for fd in _claims[held:]:  # all or none: give back what this try claimed
            os.close(fd)
        del _claims[held:]
    raise RuntimeError(f"no {count} free TCP ports in a row on 127.0.0.1 outside the ephemeral range")


def free_port():
    return free_port_range(1)


def hold(count):
    """Prints `count` distinct claimed ports, then holds the claims until stdin ends."""
    # A port this process claimed cannot be claimed again by it (flock locks are per open
    # file), so the ports differ.
    for _ in range(count):
        print(free_port())
    sys.stdout.flush()
    sys.stdin.read()


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--hold" and sys.argv[2].isdigit():
        hold(int(sys.argv[2]))
    elif len(sys.argv) == 1:
        print(free_port())
    else:
        sys.exit("usage: free_port.py [--hold N]")
