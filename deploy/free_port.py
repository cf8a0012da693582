#!/usr/bin/python3
"""Prints a TCP port nobody listens on now on 127.0.0.1, outside the kernel's ephemeral
range (net.ipv4.ip_local_port_range): a port from that range (what binding port 0 gives)
can be taken at any moment as the source port of an outgoing connection, and the scripts
and tests bind their ports later, sometimes again after a restart. Ports are tried from a
random start and probed with bind(). Used by deploy/two-site.sh, deploy/demo-shard.sh and
tests/python/harness.py (which imports free_port)."""

import random
import socket


def free_port():
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
    ports = list(range(lo, hi + 1))
    start = random.SystemRandom().randrange(len(ports))
    for port in ports[start:] + ports[:start]:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free TCP port on 127.0.0.1 outside the ephemeral range")


if __name__ == "__main__":
    print(free_port())
