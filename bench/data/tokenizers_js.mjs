// The same measurement as bench_tokenizer with Hugging Face's tokenizers.js: documents split
// as isthmus-data splits them (maximal runs of non-blank lines), each encoded without
// post-processing by a tokenizer built afresh each repetition (not timed). One JSON line
// per repetition, with the same FNV-1a digest of the ids.
//   node tokenizers_js.mjs NODE_MODULES TOKENIZER_JSON REPEAT FILE...
import fs from "node:fs";
import path from "node:path";
import zlib from "node:zlib";

const [modules, tokenizerPath, repeatText, ...files] = process.argv.slice(2);
const { Tokenizer } = await import(
  path.join(path.resolve(modules), "@huggingface/tokenizers/dist/tokenizers.mjs"));
const json = JSON.parse(fs.readFileSync(tokenizerPath, "utf8"));
const docs = [];
let bytes = 0;
for (const f of files) {
  let raw = fs.readFileSync(f);
  if (raw[0] === 0x1f && raw[1] === 0x8b) raw = zlib.gunzipSync(raw);
  let doc = [];
  const flush = () => {
    if (doc.length) {
      const d = doc.join("\n");
      docs.push(d);
      bytes += Buffer.byteLength(d);
    }
    doc = [];
  };
  const lines = raw.toString("utf8").split("\n");
  if (lines.length && lines[lines.length - 1] === "") lines.pop();
  for (const line of lines) {
    if (/^[ \t\r]*$/.test(line)) flush(); else doc.push(line);
  }
  flush();
}
for (let r = 0; r < Number(repeatText); ++r) {
  const t = new Tokenizer(json, {});
  let tokens = 0;
  let digest = 1469598103934665603n;
  const start = process.hrtime.bigint();
  const all = [];
  for (const d of docs) all.push(t.encode(d, { add_special_tokens: false }).ids);
  const s = Number(process.hrtime.bigint() - start) / 1e9;
  for (const ids of all) {
    tokens += ids.length;
    for (const id of ids) digest = ((digest ^ BigInt(id)) * 1099511628211n) & 0xffffffffffffffffn;
  }
  console.log(JSON.stringify({ impl: "tokenizers.js", documents: docs.length, bytes, tokens,
                               seconds: s, tokens_per_s: tokens / s, ids_fnv1a: digest.toString() }));
}
