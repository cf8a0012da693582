#!/usr/bin/python3
"""Runs a program under the seccomp part of a systemd unit's sandbox, without systemd.

    unit_sandbox.py UNIT_FILE -- PROGRAM [ARGS...]

Reads the unit's [Service] settings that systemd enforces with seccomp filters and installs
equivalent filters before exec'ing PROGRAM (no_new_privs set, as NoNewPrivileges=yes):

  SystemCallFilter= (allow list and ~deny lists, groups expanded by `systemd-analyze
  syscall-filter`), SystemCallErrorNumber=, RestrictAddressFamilies= (socket() of any other
  family fails with EAFNOSUPPORT), MemoryDenyWriteExecute= (writable+executable mmap,
  mprotect/pkey_mprotect adding PROT_EXEC, shmat with SHM_EXEC: EPERM), RestrictRealtime=
  (SCHED_FIFO/RR/DEADLINE: EPERM), RestrictNamespaces=yes (unshare, setns, clone with a
  CLONE_NEW* flag: EPERM), and the system call groups that ProtectClock=,
  ProtectKernelLogs=, ProtectKernelModules= and PrivateDevices= take away.

Several filters are stacked, as systemd stacks them; the kernel applies the strictest
answer. The namespace settings (ProtectSystem=, PrivateDevices=' /dev, PrivateUsers=, ...)
are not reproduced: they change what the program sees, not what it may call. Needs
python3-seccomp (Debian) and systemd-analyze. Used by tests/deploy/sandbox_test.sh.
"""

import errno
import os
import re
import subprocess
import sys

import seccomp

# Families by name, as RestrictAddressFamilies= names them (Linux values).
ADDRESS_FAMILIES = {
    "AF_UNIX": 1, "AF_LOCAL": 1, "AF_INET": 2, "AF_AX25": 3, "AF_IPX": 4,
    "AF_APPLETALK": 5, "AF_NETROM": 6, "AF_BRIDGE": 7, "AF_ATMPVC": 8, "AF_X25": 9,
    "AF_INET6": 10, "AF_ROSE": 11, "AF_DECnet": 12, "AF_NETBEUI": 13, "AF_SECURITY": 14,
    "AF_KEY": 15, "AF_NETLINK": 16, "AF_PACKET": 17, "AF_ASH": 18, "AF_ECONET": 19,
    "AF_ATMSVC": 20, "AF_RDS": 21, "AF_SNA": 22, "AF_IRDA": 23, "AF_PPPOX": 24,
    "AF_WANPIPE": 25, "AF_LLC": 26, "AF_IB": 27, "AF_MPLS": 28, "AF_CAN": 29, "AF_TIPC": 30,
    "AF_BLUETOOTH": 31, "AF_IUCV": 32, "AF_RXRPC": 33, "AF_ISDN": 34, "AF_PHONET": 35,
    "AF_IEEE802154": 36, "AF_CAIF": 37, "AF_ALG": 38, "AF_NFC": 39, "AF_VSOCK": 40,
    "AF_KCM": 41, "AF_QIPCRTR": 42, "AF_SMC": 43, "AF_XDP": 44, "AF_MCTP": 45,
}
AF_MAX = 46
PROT_WRITE, PROT_EXEC = 0x2, 0x4
SHM_EXEC = 0o100000
SCHED_FIFO, SCHED_RR, SCHED_DEADLINE = 1, 2, 6
CLONE_NEW_FLAGS = [0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000,
                   0x40000000, 0x00000080]  # NS, CGROUP, UTS, IPC, USER, PID, NET, TIME


def unit_settings(path):
    """The [Service] section's settings as name -> list of values (in file order)."""
    settings, section, pending = {}, None, ""
    for raw in open(path, encoding="utf-8"):
        line = raw.rstrip("\n")
        if pending:
            line, pending = pending + line, ""
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            section = line
            continue
        if section == "[Service]" and "=" in line:
            key, value = line.split("=", 1)
            settings.setdefault(key.strip(), []).append(value.strip())
    return settings


def syscall_groups():
    out = subprocess.run(["systemd-analyze", "syscall-filter"], check=True,
                         capture_output=True, text=True).stdout
    groups, current = {}, None
    for line in out.splitlines():
        if line.startswith("@"):
            current = groups.setdefault(line.strip(), [])
        elif current is not None and line.strip() and not line.strip().startswith("#"):
            current.append(line.strip())
    return groups


def expand(names, groups):
    result = set()
    for name in names:
        if name.startswith("@"):
            result |= expand(groups[name], groups)
        else:
            result.add(name)
    return result


def add(flt, action, name, *args):
    try:
        flt.add_rule(action, name, *args)
    except (RuntimeError, ValueError, OSError):
        pass  # a name this architecture or libseccomp does not know


def yes(settings, key):
    return settings.get(key, ["no"])[-1].lower() in ("yes", "true", "1", "on")


def build_filters(settings):
    groups = syscall_groups()
    number = settings.get("SystemCallErrorNumber", [""])[-1]
    deny = seccomp.ERRNO(getattr(errno, number)) if number else seccomp.KILL_PROCESS
    filters = []

    # SystemCallFilter=: the first allow list sets the default; ~lists deny from it.
    allowed, denied, allow_list = set(), set(), False
    for value in settings.get("SystemCallFilter", []):
        if value.startswith("~"):
            names = expand(value[1:].split(), groups)
            denied |= names
            allowed -= names
        else:
            allow_list = True
            allowed |= expand(value.split(), groups)
    for key, group in (("ProtectClock", "@clock"), ("ProtectKernelModules", "@module"),
                       ("PrivateDevices", "@raw-io")):
        if yes(settings, key):
            denied |= expand([group], groups)
            allowed -= expand([group], groups)
    if yes(settings, "ProtectKernelLogs"):
        denied.add("syslog")
        allowed.discard("syslog")
    if allow_list:
        flt = seccomp.SyscallFilter(defaction=deny)
        # What systemd itself needs between applying the filter and exec'ing the program.
        for name in sorted(allowed | {"execve", "exit_group", "exit"}):
            add(flt, seccomp.ALLOW, name)
    else:
        flt = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
        for name in sorted(denied):
            add(flt, deny, name)
    filters.append(flt)

    families = settings.get("RestrictAddressFamilies", [])
    if families:
        value = " ".join(families)
        names = value[1:].split() if value.startswith("~") else value.split()
        values = {ADDRESS_FAMILIES[n] for n in names}
        flt = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
        refused = seccomp.ERRNO(errno.EAFNOSUPPORT)
        if value.startswith("~"):
            for v in sorted(values):
                add(flt, refused, "socket", seccomp.Arg(0, seccomp.EQ, v))
        else:
            for v in range(AF_MAX):
                if v not in values:
                    add(flt, refused, "socket", seccomp.Arg(0, seccomp.EQ, v))
            add(flt, refused, "socket", seccomp.Arg(0, seccomp.GE, AF_MAX))
        filters.append(flt)

    extra = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
    eperm = seccomp.ERRNO(errno.EPERM)
    if yes(settings, "MemoryDenyWriteExecute"):
        add(extra, eperm, "mmap",
            seccomp.Arg(2, seccomp.MASKED_EQ, PROT_WRITE | PROT_EXEC, PROT_WRITE | PROT_EXEC))
        add(extra, eperm, "mprotect", seccomp.Arg(2, seccomp.MASKED_EQ, PROT_EXEC, PROT_EXEC))
        add(extra, eperm, "pkey_mprotect",
            seccomp.Arg(2, seccomp.MASKED_EQ, PROT_EXEC, PROT_EXEC))
        add(extra, eperm, "shmat", seccomp.Arg(2, seccomp.MASKED_EQ, SHM_EXEC, SHM_EXEC))
    if yes(settings, "RestrictRealtime"):
        for policy in (SCHED_FIFO, SCHED_RR, SCHED_DEADLINE):
            add(extra, eperm, "sched_setscheduler", seccomp.Arg(1, seccomp.EQ, policy))
    if yes(settings, "RestrictNamespaces"):
        add(extra, eperm, "unshare")
        add(extra, eperm, "setns")
        for flag in CLONE_NEW_FLAGS:
            add(extra, eperm, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
        # clone3 passes its flags in memory a filter cannot read: refused as ENOSYS, so
        # the C library falls back to clone, as systemd does.
        add(extra, seccomp.ERRNO(errno.ENOSYS), "clone3")
    filters.append(extra)
    return filters


def main():
    if len(sys.argv) < 4 or sys.argv[2] != "--":
        sys.exit("usage: unit_sandbox.py UNIT_FILE -- PROGRAM [ARGS...]")
    settings = unit_settings(sys.argv[1])
    filters = build_filters(settings)
    # The allow list goes last: loading a filter is itself a system call it may not allow.
    for flt in reversed(filters):
        flt.load()
    os.execv(sys.argv[3], sys.argv[3:])


if __name__ == "__main__":
    main()
