#!/usr/bin/python3
"""Writes a gettext .mo catalogue (little-endian, no hash table) for tests: the pairs come
as a JSON object {english: translation} on standard input; the UTF-8 header is added.
Usage: write_mo.py OUT.mo < pairs.json"""
import json
import struct
import sys

pairs = json.load(sys.stdin)
pairs[""] = "Content-Type: text/plain; charset=UTF-8\n"
keys = sorted(pairs)
n = len(keys)
tables, blob, base = [b"", b""], b"", 28 + 16 * n
for k in keys:
    for t, s in enumerate((k, pairs[k])):
        b = s.encode()
        tables[t] += struct.pack("<II", len(b), base + len(blob))
        blob += b + b"\0"
with open(sys.argv[1], "wb") as f:
    f.write(struct.pack("<7I", 0x950412DE, 0, n, 28, 28 + 8 * n, 0, 0) + tables[0] + tables[1] +
            blob)
