#!/bin/sh
# Byte-level BPE encoding speed, isthmus (C++) vs Hugging Face's tokenizers.js (Node.js), in
# the same run, on the same documents, for GPT-2's, Llama 3's and Qwen3's tokenizer.json
# (tests/data/). Each side encodes every document of the given corpus files REPEAT times
# with a fresh tokenizer; the run checks that both produced the same ids (a digest) and
# prints tokens/s of each repetition and the ratio isthmus / tokenizers.js.
#
# Usage: bench/data/run.sh --node-modules DIR [--repeat N] [--build BUILD_DIR] FILE...
#   DIR: a node_modules folder holding @huggingface/tokenizers (npm install
#        @huggingface/tokenizers@0.2.0; see tests/data/tokenizers/README.md)
#   FILE: corpus files (deploy/fetch-corpus.sh), e.g. corpus/en.txt corpus/de.txt corpus/ja.txt
set -eu
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
usage() {
  sed -n 8,11p "$0" >&2
  exit 2
}
modules=
repeat=3
build=build
while [ $# -gt 0 ]; do
  case $1 in
    --node-modules) [ $# -ge 2 ] || usage; modules=$2; shift 2 ;;
    --repeat) [ $# -ge 2 ] || usage; repeat=$2; shift 2 ;;
    --build) [ $# -ge 2 ] || usage; build=$2; shift 2 ;;
    -h | --help) usage ;;
    -*) usage ;;
    *) break ;;
  esac
done
if [ -z "$modules" ] || [ $# -eq 0 ]; then usage; fi
[ -d "$modules/@huggingface/tokenizers" ] || {
  echo "run.sh: $modules has no @huggingface/tokenizers (npm install @huggingface/tokenizers@0.2.0)" >&2
  exit 2
}
bench="$build/bench/data/bench_tokenizer"
[ -x "$bench" ] || { echo "run.sh: $bench is missing: build the bench_tokenizer target" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for name in llama3 qwen3; do
  zstd -q -d "$repo/tests/data/tokenizers/$name-tokenizer.json.zst" -o "$work/$name.json"
done
/usr/bin/python3 - "$repo/tests/data/gpt2" "$work/gpt2.json" <<'PY'
import json, sys
vocab = json.load(open(sys.argv[1] + "/encoder.json"))
merges = [l.rstrip("\n") for l in open(sys.argv[1] + "/vocab.bpe")
          if l.strip() and not l.startswith("#version")]
bl = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
json.dump({"added_tokens": [{"id": 50256, "content": "<|endoftext|>", "special": True,
                             "single_word": False, "lstrip": False, "rstrip": False,
                             "normalized": True}],
           "normalizer": None, "pre_tokenizer": bl, "post_processor": bl, "decoder": bl,
           "model": {"type": "BPE", "vocab": vocab, "merges": merges}}, open(sys.argv[2], "w"))
PY
status=0
for name in gpt2 llama3 qwen3; do
  "$bench" --tokenizer "$work/$name.json" --repeat "$repeat" "$@" > "$work/cc.jsonl"
  node "$here/tokenizers_js.mjs" "$modules" "$work/$name.json" "$repeat" "$@" > "$work/js.jsonl"
  /usr/bin/python3 - "$name" "$work/cc.jsonl" "$work/js.jsonl" <<'PY' || status=1
import json, sys
name, cc, js = sys.argv[1], [json.loads(l) for l in open(sys.argv[2])], \
    [json.loads(l) for l in open(sys.argv[3])]
for l in cc + js:
    print(json.dumps(dict(l, tokenizer=name)))
same = cc[0]["ids_fnv1a"] == js[0]["ids_fnv1a"] and cc[0]["tokens"] == js[0]["tokens"]
ratios = [c["tokens_per_s"] / j["tokens_per_s"] for c, j in zip(cc, js)]
print(f"{name}: {cc[0]['documents']} documents, {cc[0]['bytes']} bytes, {cc[0]['tokens']} tokens; "
      f"ids {'equal' if same else 'DIFFER'}; isthmus "
      + ", ".join(f"{c['tokens_per_s']:,.0f}" for c in cc) + " tokens/s; tokenizers.js "
      + ", ".join(f"{j['tokens_per_s']:,.0f}" for j in js) + " tokens/s; ratio "
      + ", ".join(f"{r:.2f}x" for r in ratios))
sys.exit(0 if same else 1)
PY
done
exit $status
