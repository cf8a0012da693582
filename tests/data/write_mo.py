#!/usr/bin/python3
"""Writes a gettext .mo catalogue (little-endian, no hash table) for tests: the pairs come
as a JSON object {english: translation} on standard input; the UTF-8 header is added.
With --german N the pairs are instead N numbered messages ("Open file 3" -> "Datei 3
öffnen"): the German catalogue the worker's translation tests share.
Usage: write_mo.py OUT.mo < pairs.json
       write_mo.py OUT.mo --german N"""
import json
import struct
import sys

if len(sys.argv) == 4 and sys.argv[2] == "--german":
    words = ["file", "folder", "disk", "user", "group", "key", "page", "line"]
    german = ["Datei", "Ordner", "Platte", "Benutzer", "Gruppe", "Schlüssel", "Seite", "Zeile"]
    pairs = {f"Open {words[i % 8]} {i}": f"{german[i % 8]} {i} öffnen"
             for i in range(int(sys.argv[3]))}
elif len(sys.argv) == 2:
    pairs = json.load(sys.stdin)
else:
    sys.exit(__doc__)
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
