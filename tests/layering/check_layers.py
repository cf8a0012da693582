#!/usr/bin/python3
"""Checks that the code's layers hold: each folder includes only the project headers of the
layers its CMake library links (docs/ARCHITECTURE.md, "The server's layers"), and third-party
headers that belong to one layer stay there (RocksDB in server/storage, ZeroMQ's sockets out
of the storage and config layers).

A header of a layer a library does not link would compile where the include path allows it
but link only by accident, or drag that layer's dependencies into a program that must not
have them (isthmusctl with RocksDB). This is the check CMake cannot make: CMake refuses a
cycle between libraries, not an include that crosses them.

Usage: check_layers.py [REPO]   (default: the checkout this file is in). Exit 0 when every
include is allowed; 1, listing each offending file:line, when not; 2 on bad usage.
"""
import os
import re
import sys

# Folder -> the project folders its sources may include. A folder's own headers are always
# allowed. Order matters only for reading: lower layers first.
ALLOWED = {
    "schemas": [],
    "common": ["schemas"],
    "ops": ["common"],
    "server/config": ["common", "ops"],  # ops/codec.h: pipelines are checked at load
    "server/storage": ["common"],
    "server/sync": ["common", "ops", "server/storage", "server/config"],
    "server/shard": ["common", "ops", "server/storage", "server/config", "server/sync"],
    "server/ctl": ["common", "server/config"],
    "worker": ["common", "ops", "schemas"],
}

# Third-party headers that belong to one layer only: header prefix -> folders allowed.
EXCLUSIVE = {
    "rocksdb/": ["server/storage"],
}

INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]')


def layer_of(path):
    """The most specific ALLOWED key that `path` (relative, '/'-separated) lies under."""
    best = None
    for folder in ALLOWED:
        if path == folder or path.startswith(folder + "/"):
            if best is None or len(folder) > len(best):
                best = folder
    return best


def check(repo):
    problems = []
    checked = 0
    for top in ("schemas", "common", "ops", "server", "worker"):
        for root, _, files in os.walk(os.path.join(repo, top)):
            for name in files:
                if not name.endswith((".h", ".cc", ".cu", ".cuh")):
                    continue
                full = os.path.join(root, name)
                rel = os.path.relpath(full, repo).replace(os.sep, "/")
                layer = layer_of(rel)
                if layer is None:
                    problems.append(f"{rel}: in no known layer (add its folder to ALLOWED)")
                    continue
                checked += 1
                with open(full, encoding="utf-8", errors="replace") as f:
                    for lineno, line in enumerate(f, 1):
                        m = INCLUDE.match(line)
                        if not m:
                            continue
                        kind, header = m.groups()
                        for prefix, owners in EXCLUSIVE.items():
                            if header.startswith(prefix) and layer not in owners:
                                problems.append(f"{rel}:{lineno}: includes <{header}>, which "
                                                f"belongs to {', '.join(owners)} only")
                        if kind != '"':
                            continue
                        target = layer_of(header)
                        if target is None or target == layer:
                            continue
                        if target not in ALLOWED[layer]:
                            problems.append(f"{rel}:{lineno}: includes \"{header}\" of layer "
                                            f"{target}, which {layer} does not link (allowed: "
                                            f"{', '.join(ALLOWED[layer]) or 'none'})")
    return checked, problems


def main():
    if len(sys.argv) > 2 or (len(sys.argv) == 2 and sys.argv[1] in ("-h", "--help")):
        print(__doc__)
        return 0 if len(sys.argv) == 2 else 2
    repo = sys.argv[1] if len(sys.argv) == 2 else os.path.join(os.path.dirname(__file__), "..", "..")
    checked, problems = check(os.path.abspath(repo))
    for p in problems:
        print(p)
    if checked == 0:
        print("no sources found under", repo)
        return 1
    print(f"layers: {checked} files checked, {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
