"""isthmus-worker export writes folders Hugging Face tools open without hand work, offline
from a `train --save` file: for full mode a model folder (config.json + model.safetensors
with format "pt"), for LoRA a PEFT folder whose adapter_config.json names the base
folder. Each is read back tensor by tensor, and a from-scratch PyTorch GPT-2
(isthmus.gpt2) on the exported files gives the validation loss `isthmus-worker eval`
reports, to 1e-5 relative. Shape flags come from the base file; a contradicting one exits 2."""

import json
import os
import shutil
import subprocess
import tempfile
import unittest

import numpy as np
import torch

import isthmus
import isthmus.gpt2

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SHAPE = ["--layers", "2", "--width", "32", "--heads", "2", "--context", "16"]
B, T = 4, 16


def write_safetensors_by_hand(path, tensors):
    """The safetensors layout, written without isthmus: {name: (dtype, array)}."""
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, (dtype, a) in tensors.items():
        data = np.ascontiguousarray(a).tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text + b"".join(blobs))


def read_safetensors_by_hand(path):
    """{name: float32 array} of an F32, F16 or BF16 safetensors file, read without isthmus."""
    with open(path, "rb") as f:
        raw = f.read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        b, end = e["data_offsets"]
        data = raw[8 + n + b:8 + n + end]
        if e["dtype"] == "F32":
            a = np.frombuffer(data, dtype="<f4")
        elif e["dtype"] == "F16":
            a = np.frombuffer(data, dtype="<f2").astype(np.float32)
        else:
            assert e["dtype"] == "BF16", e["dtype"]
            a = (np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        out[name] = a.reshape(e["shape"]).copy()
    return out


class ExportTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.worker = os.environ["ISTHMUS_WORKER"]
        cls.dir = tempfile.mkdtemp(prefix="isthmus-export-")
        with open(os.path.join(REPO, "docs", "ARCHITECTURE.md"), "rb") as f:
            text = np.frombuffer(f.read(), dtype=np.uint8).astype("<u2")
        cls.data = os.path.join(cls.dir, "data")
        os.makedirs(cls.data)
        text[:15000].tofile(os.path.join(cls.data, "train.bin"))
        # Exactly B windows of T + 1 tokens: eval's one batch holds all of them, in an
        # order that does not change their mean loss.
        cls.val = text[16000:16000 + B * T + 1]
        cls.val.tofile(os.path.join(cls.data, "val.bin"))
        cls.base = os.path.join(cls.dir, "base.safetensors")
        cls.run_ok(cls, [cls.worker, "init", *SHAPE, "--lora-rank", "4", "--lora-alpha", "8",
                         "--write-base", cls.base, "--out", os.path.join(cls.dir, "lora0.st")])

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir, ignore_errors=True)

    def run_ok(self, cmd):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise AssertionError(f"{' '.join(cmd[:2])} exited {r.returncode}: {r.stderr[-2000:]}")
        return r.stdout

    def train_standalone(self, init, save, *flags):
        self.run_ok([self.worker, "train", "--base", self.base, "--standalone", "--init", init,
                     "--save", save, "--data", self.data, "--batch-size", str(B),
                     "--max-steps", "15", "--lr", "3e-3", "--warmup-steps", "0",
                     "--no-progress", *flags])

    def eval_loss(self, trainable):
        out = self.run_ok([self.worker, "eval", "--base", self.base, "--trainable", trainable,
                           "--data", self.data, "--batch-size", str(B), "--batches", "1",
                           "--json"])
        return json.loads(out)["val_loss"]

    def torch_loss(self, base, lora, heads, alpha):
        model = isthmus.gpt2.Gpt2Lora(base, lora, heads=heads, alpha=alpha)
        v = torch.from_numpy(self.val.astype(np.int64))
        x = torch.stack([v[i * T:i * T + T] for i in range(B)])
        y = torch.stack([v[i * T + 1:i * T + T + 1] for i in range(B)])
        with torch.no_grad():
            return model.loss(x, y).item()

    def test_lora_exports_a_peft_folder_naming_its_base_folder(self):
        saved = os.path.join(self.dir, "lora.st")
        # No model flags at all: the shape comes from the base, LoRA settings from the file.
        self.train_standalone(os.path.join(self.dir, "lora0.st"), saved)
        peft = os.path.join(self.dir, "peft")
        self.run_ok([self.worker, "export", "--base", self.base, "--trainable", saved,
                     "--peft-dir", peft])

        with open(os.path.join(peft, "adapter_config.json")) as f:
            adapter = json.load(f)
        base_dir = adapter["base_model_name_or_path"]
        self.assertTrue(os.path.isabs(base_dir))
        self.assertEqual(os.path.realpath(base_dir), os.path.realpath(os.path.join(peft, "base")))
        self.assertEqual((adapter["peft_type"], adapter["r"], adapter["lora_alpha"]),
                         ("LORA", 4, 8.0))
        self.assertTrue(adapter["fan_in_fan_out"])
        with open(os.path.join(base_dir, "config.json")) as f:
            config = json.load(f)
        self.assertEqual((config["model_type"], config["n_layer"], config["n_embd"],
                          config["n_head"], config["n_positions"], config["vocab_size"]),
                         ("gpt2", 2, 32, 2, 16, 256))
        # A byte-level model has no <|endoftext|>: GPT-2's default id 50256 would not fit.
        self.assertIsNone(config["eos_token_id"])

        base_out, meta = isthmus.read_safetensors(os.path.join(base_dir, "model.safetensors"))
        self.assertEqual(meta.get("format"), "pt")
        base_in, base_meta = isthmus.read_safetensors(self.base)
        self.assertEqual(base_meta.get("format"), "pt")  # transformers 4.x accepts only pt
        self.assertEqual(sorted(base_out), sorted(base_in))
        for n in base_in:
            np.testing.assert_array_equal(base_out[n], base_in[n])
        lora_out, _ = isthmus.read_safetensors(os.path.join(peft, "adapter_model.safetensors"))
        trained, _ = isthmus.read_safetensors(saved)
        prefix = "base_model.model.transformer."
        self.assertTrue(all(n.startswith(prefix) for n in lora_out))
        lora = {n[len(prefix):]: a for n, a in lora_out.items()}
        self.assertEqual(sorted(lora), sorted(trained))
        for n in trained:
            np.testing.assert_array_equal(lora[n], trained[n])
        lora0, _ = isthmus.read_safetensors(os.path.join(self.dir, "lora0.st"))
        self.assertGreater(max(np.abs(trained[n] - lora0[n]).max() for n in lora0), 1e-4)

        want = self.eval_loss(saved)
        got = self.torch_loss(base_out, lora, config["n_head"], adapter["lora_alpha"])
        print(f"\n{self._testMethodName}: torch {got:.7f} eval {want:.7f} rel {abs(got - want) / want:.2e}")
        self.assertLess(abs(got - want) / want, 1e-5, (got, want))

    def test_full_mode_exports_a_model_folder(self):
        init = os.path.join(self.dir, "full0.st")
        self.run_ok([self.worker, "init", "--mode", "full", "--base", self.base, "--out", init])
        saved = os.path.join(self.dir, "full.st")
        self.train_standalone(init, saved, "--mode", "full")
        hf = os.path.join(self.dir, "hf")
        self.run_ok([self.worker, "export", "--base", self.base, "--trainable", saved,
                     "--hf-dir", hf])
        with open(os.path.join(hf, "config.json")) as f:
            config = json.load(f)
        self.assertEqual(config["architectures"], ["GPT2LMHeadModel"])
        self.assertEqual(config["n_positions"], 16)
        model, meta = isthmus.read_safetensors(os.path.join(hf, "model.safetensors"))
        self.assertEqual(meta.get("format"), "pt")
        trained, _ = isthmus.read_safetensors(saved)
        self.assertEqual(sorted(model), sorted(trained))
        for n in trained:
            np.testing.assert_array_equal(model[n], trained[n])
        base_in, _ = isthmus.read_safetensors(self.base)
        self.assertGreater(np.abs(model["wte.weight"] - base_in["wte.weight"]).max(), 1e-4)

        want = self.eval_loss(saved)
        got = self.torch_loss(model, {}, config["n_head"], 0.0)
        print(f"\n{self._testMethodName}: torch {got:.7f} eval {want:.7f} rel {abs(got - want) / want:.2e}")
        self.assertLess(abs(got - want) / want, 1e-5, (got, want))

    def test_a_hugging_face_folder_imports_as_the_same_base(self):
        # transformers' save_pretrained layout: "transformer." names, a tied lm_head, and
        # the head count only in config.json.
        base, _ = isthmus.read_safetensors(self.base)
        folder = os.path.join(self.dir, "hf-import")
        os.makedirs(folder, exist_ok=True)
        tensors = {"transformer." + n: a for n, a in base.items()}
        tensors["lm_head.weight"] = base["wte.weight"]
        isthmus.write_safetensors(os.path.join(folder, "model.safetensors"), tensors,
                                  {"format": "pt"})
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump({"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2,
                       "n_positions": 16, "vocab_size": 256}, f)
        hashes = [self.run_ok([self.worker, "init", "--base", b, "--out",
                               os.path.join(self.dir, "imp.st")]).strip() for b in (folder, self.base)]
        self.assertEqual(hashes[0], hashes[1])
        self.assertEqual(hashes[0], isthmus.tensors_hash(base))

    def test_sharded_checkpoints_import_and_export_in_hugging_faces_layout(self):
        # A folder as transformers writes a big model: shards model-0000k-of-0000n and
        # model.safetensors.index.json, here written from scratch (not by isthmus), with the
        # embedding in BF16 and the rest in F32; it imports as the same base as one F32 file
        # of the same (BF16-rounded) values.
        base, _ = isthmus.read_safetensors(self.base)
        rounded = {n: torch.from_numpy(a).to(torch.bfloat16).to(torch.float32).numpy()
                   for n, a in base.items()}
        config = {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2,
                  "n_positions": 16, "vocab_size": 256}
        single = os.path.join(self.dir, "hf-single")
        sharded = os.path.join(self.dir, "hf-sharded")
        for folder in (single, sharded):
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, "config.json"), "w") as f:
                json.dump(config, f)
        isthmus.write_safetensors(os.path.join(single, "model.safetensors"),
                                  {"transformer." + n: a for n, a in rounded.items()},
                                  {"format": "pt"})
        names = sorted(rounded)
        parts = [["wte.weight"], [n for n in names if n != "wte.weight"]]
        weight_map = {}
        for k, part in enumerate(parts):
            file = f"model-{k + 1:05d}-of-{len(parts):05d}.safetensors"
            tensors = {}
            for n in part:
                t = torch.from_numpy(rounded[n])
                tensors["transformer." + n] = (
                    ("BF16", t.to(torch.bfloat16).view(torch.int16).numpy()) if k == 0
                    else ("F32", rounded[n]))
                weight_map["transformer." + n] = file
            write_safetensors_by_hand(os.path.join(sharded, file), tensors)
        with open(os.path.join(sharded, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)
        hashes = [self.run_ok([self.worker, "init", "--base", b, "--out",
                               os.path.join(self.dir, "imp.st")]).strip()
                  for b in (sharded, single)]
        self.assertEqual(hashes[0], hashes[1])
        self.assertEqual(hashes[0], isthmus.tensors_hash(rounded))
        # An index that places a tensor in a shard that does not hold it is refused by name.
        bad = dict(weight_map, **{"transformer.wte.weight": "model-00002-of-00002.safetensors"})
        with open(os.path.join(sharded, "model.safetensors.index.json"), "w") as f:
            json.dump({"weight_map": bad}, f)
        r = subprocess.run([self.worker, "init", "--base", sharded, "--out",
                            os.path.join(self.dir, "imp.st")], capture_output=True, text=True)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("transformer.wte.weight", r.stderr)

        # Export: above --max-shard-mb the model folder is sharded with an index; read back
        # here from scratch, it holds the same tensors as the one-file export.
        init = os.path.join(self.dir, "full-shards.st")
        self.run_ok([self.worker, "init", "--mode", "full", "--base", self.base, "--out", init])
        out = os.path.join(self.dir, "hf-export-sharded")
        one = os.path.join(self.dir, "hf-export-one")
        self.run_ok([self.worker, "export", "--mode", "full", "--base", self.base,
                     "--trainable", init, "--hf-dir", out, "--max-shard-mb", "0.01"])
        self.run_ok([self.worker, "export", "--mode", "full", "--base", self.base,
                     "--trainable", init, "--hf-dir", one])
        with open(os.path.join(out, "model.safetensors.index.json")) as f:
            index = json.load(f)
        files = sorted(set(index["weight_map"].values()))
        self.assertGreater(len(files), 2)
        self.assertEqual(files[0], f"model-00001-of-{len(files):05d}.safetensors")
        self.assertFalse(os.path.exists(os.path.join(out, "model.safetensors")))
        got = {}
        for file in files:
            part = read_safetensors_by_hand(os.path.join(out, file))
            self.assertTrue(all(index["weight_map"][n] == file for n in part))
            self.assertLessEqual(sum(a.nbytes for a in part.values()), max(
                10_000, max(a.nbytes for a in part.values())))
            got.update(part)
        self.assertEqual(index["metadata"]["total_size"], sum(a.nbytes for a in got.values()))
        want = read_safetensors_by_hand(os.path.join(one, "model.safetensors"))
        self.assertEqual(sorted(got), sorted(want))
        for n in want:
            np.testing.assert_array_equal(got[n], want[n])
        # --dtype bf16 / fp16: the same tensors rounded as PyTorch rounds them, and
        # config.json says which.
        for dtype, torch_dtype, name in (("bf16", torch.bfloat16, "bfloat16"),
                                         ("fp16", torch.float16, "float16")):
            half = os.path.join(self.dir, f"hf-export-{dtype}")
            self.run_ok([self.worker, "export", "--mode", "full", "--base", self.base,
                         "--trainable", init, "--hf-dir", half, "--dtype", dtype])
            with open(os.path.join(half, "config.json")) as f:
                self.assertEqual(json.load(f)["torch_dtype"], name)
            got_half = read_safetensors_by_hand(os.path.join(half, "model.safetensors"))
            for n in want:
                rounded = torch.from_numpy(want[n]).to(torch_dtype).to(torch.float32).numpy()
                np.testing.assert_array_equal(got_half[n], rounded, err_msg=f"{dtype} {n}")
        r = subprocess.run([self.worker, "export", "--mode", "full", "--base", self.base,
                            "--trainable", init, "--hf-dir", one, "--dtype", "int8"],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 2)
        self.assertIn("--dtype", r.stderr)
        # Exported again as one file into the same folder: the shards and index are gone.
        self.run_ok([self.worker, "export", "--mode", "full", "--base", self.base,
                     "--trainable", init, "--hf-dir", out])
        self.assertEqual(sorted(n for n in os.listdir(out) if "safetensors" in n),
                         ["model.safetensors"])

    def test_grad_accum_trains_as_one_batch_that_many_times_larger(self):
        # 2 micro-batches of 2 sequences read the same windows, in the same order, as one
        # batch of 4: the trained tensors agree to rounding, and differ from a run that
        # saw only half of them.
        init = os.path.join(self.dir, "lora0.st")
        runs = {}
        for name, flags in (("whole", ["--batch-size", "4"]),
                            ("accum", ["--batch-size", "2", "--grad-accum", "2"]),
                            ("half", ["--batch-size", "2"])):
            saved = os.path.join(self.dir, f"accum-{name}.st")
            self.run_ok([self.worker, "train", "--base", self.base, "--standalone", "--init", init,
                         "--save", saved, "--data", self.data, "--max-steps", "6", "--lr", "3e-3",
                         "--warmup-steps", "0", "--no-progress", *flags])
            runs[name], _ = isthmus.read_safetensors(saved)
        worst = max(np.abs(runs["whole"][n] - runs["accum"][n]).max() for n in runs["whole"])
        apart = max(np.abs(runs["whole"][n] - runs["half"][n]).max() for n in runs["whole"])
        self.assertLess(worst, 2e-5)
        self.assertGreater(apart, 100 * worst + 1e-4)
        r = subprocess.run([self.worker, "train", "--base", self.base, "--standalone",
                            "--data", self.data, "--max-steps", "1", "--grad-accum", "0"],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 2)
        self.assertIn("--grad-accum must be in [1, 4096]", r.stderr)

    def test_train_plan_prints_the_memory_a_configuration_needs(self):
        # --plan needs no data, shards or rounds; its parts add up to what training needs,
        # and a bigger batch needs more activations and nothing more of the rest.
        def plan(batch, *flags):
            r = subprocess.run([self.worker, "train", "--plan", "--base", self.base,
                                "--batch-size", str(batch), *flags],
                               capture_output=True, text=True, timeout=60)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertTrue(r.stdout.rstrip().endswith("fits"), r.stdout)
            rows = {}
            for line in r.stdout.splitlines()[1:]:
                if "MiB" in line:
                    name, value = line.split("MiB")[0].rsplit(None, 1)
                    rows[name.strip()] = float(value)
            return r.stdout, rows

        out, small = plan(4)
        self.assertIn("2 layers x 32", out)
        parts = ["parameters (fp32)", "bf16 weight copies", "gradients (fp32)",
                 "optimizer (AdamW moments)", "activations and batch", "round base and staging"]
        self.assertAlmostEqual(sum(small[p] for p in parts), small["training needs"], delta=0.25)
        _, big = plan(64)
        self.assertGreater(big["activations and batch"], 10 * small["activations and batch"])
        for p in parts[:4]:
            self.assertEqual(big[p], small[p])
        # A synced run holds two more copies of the trainable tensors; --standalone does not.
        _, alone = plan(4, "--standalone")
        self.assertEqual(alone["round base and staging"], 0.0)
        self.assertAlmostEqual(small["round base and staging"],
                               2 * small["gradients (fp32)"], delta=0.15)
        _, full = plan(4, "--mode", "full")
        self.assertGreater(full["optimizer (AdamW moments)"], small["optimizer (AdamW moments)"])
        r = subprocess.run([self.worker, "train", "--plan", "--base", self.base,
                            "--batch-size", "0"], capture_output=True, text=True)
        self.assertEqual(r.returncode, 2)
        self.assertIn("--batch-size", r.stderr)

    def generate(self, *args):
        r = subprocess.run([self.worker, "generate", *args], capture_output=True, timeout=120)
        self.assertEqual(r.returncode, 0, r.stderr.decode(errors="replace")[-2000:])
        self.assertTrue(r.stdout.endswith(b"\n"))
        return r.stdout[:-1]

    def test_generate_continues_a_prompt_as_the_model_predicts(self):
        saved = os.path.join(self.dir, "gen.st")
        self.train_standalone(os.path.join(self.dir, "lora0.st"), saved)
        prompt = "The shard "
        out = self.generate("--base", self.base, "--trainable", saved, "--prompt", prompt,
                            "--tokens", "12", "--temperature", "0")
        self.assertTrue(out.startswith(prompt.encode()))
        self.assertEqual(len(out), len(prompt) + 12)
        # Greedy decoding by the PyTorch model on the same tensors, window n_ctx = 16.
        base, _ = isthmus.read_safetensors(self.base)
        lora, meta = isthmus.read_safetensors(saved)
        model = isthmus.gpt2.Gpt2Lora(base, lora, heads=2, alpha=float(meta["lora_alpha"]))
        ids = list(prompt.encode())
        with torch.no_grad():
            for _ in range(12):
                logits = model(torch.tensor([ids[-T:]]))
                ids.append(int(logits[0, -1].argmax()))
        self.assertEqual(out, bytes(ids))
        # Sampling: the same seed gives the same text, another seed (almost surely) not.
        a = self.generate("--base", self.base, "--trainable", saved, "--prompt", prompt,
                          "--tokens", "40", "--sample-seed", "7")
        b = self.generate("--base", self.base, "--trainable", saved, "--prompt", prompt,
                          "--tokens", "40", "--sample-seed", "7")
        c = self.generate("--base", self.base, "--trainable", saved, "--prompt", prompt,
                          "--tokens", "40", "--sample-seed", "8")
        self.assertEqual(a, b)
        self.assertNotEqual(a, c)

    def test_generate_with_a_hugging_face_folder_uses_its_bpe_tokenizer(self):
        # A GPT-2 folder with GPT-2's vocabulary: model.safetensors, config.json and the
        # tokenizer's vocab.json + merges.txt.
        base, _ = isthmus.read_safetensors(self.base)
        rng = np.random.default_rng(5)
        base["wte.weight"] = (rng.standard_normal((50257, 32)) * 0.02).astype(np.float32)
        folder = os.path.join(self.dir, "hf-bpe")
        os.makedirs(folder, exist_ok=True)
        isthmus.write_safetensors(os.path.join(folder, "model.safetensors"), base,
                                  {"format": "pt"})
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump({"model_type": "gpt2", "n_head": 2}, f)
        gpt2_vocab = os.path.join(REPO, "tests", "data", "gpt2")
        shutil.copy(os.path.join(gpt2_vocab, "encoder.json"), os.path.join(folder, "vocab.json"))
        shutil.copy(os.path.join(gpt2_vocab, "vocab.bpe"), os.path.join(folder, "merges.txt"))
        prompt = "Hello, world"
        out = self.generate("--base", folder, "--prompt", prompt, "--tokens", "6",
                            "--temperature", "0")
        self.assertTrue(out.startswith(prompt.encode()), out)
        # Greedy in PyTorch from the prompt's GPT-2 ids (tests/data/gpt2/expected.json:
        # "Hello, world" is 15496, 11, 995), decoded with the vocabulary's byte map.
        model = isthmus.gpt2.Gpt2Lora(base, {}, heads=2, alpha=0.0)
        ids = [15496, 11, 995]
        with torch.no_grad():
            for _ in range(6):
                ids.append(int(model(torch.tensor([ids[-T:]]))[0, -1].argmax()))
        with open(os.path.join(folder, "vocab.json")) as f:
            tokens = {i: t for t, i in json.load(f).items()}
        printable = (list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD))
                     + list(range(0xAE, 0x100)))
        byte_of, extra = {}, 0
        for b in range(256):
            if b in printable:
                byte_of[chr(b)] = b
            else:
                byte_of[chr(256 + extra)] = b
                extra += 1
        want = bytes(byte_of[ch] for i in ids for ch in tokens[i])
        self.assertEqual(out, want)
        # The same folder with the tokenizer as one tokenizer.json (as Hugging Face saves
        # GPT-2's) instead of vocab.json + merges.txt: the same text.
        with open(os.path.join(folder, "merges.txt")) as f:
            merges = [l.rstrip("\n") for l in f if l.strip() and not l.startswith("#version")]
        with open(os.path.join(folder, "vocab.json")) as f:
            vocab = json.load(f)
        byte_level = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
        with open(os.path.join(folder, "tokenizer.json"), "w") as f:
            json.dump({"added_tokens": [{"id": 50256, "content": "<|endoftext|>", "special": True}],
                       "normalizer": None, "pre_tokenizer": byte_level, "decoder": byte_level,
                       "model": {"type": "BPE", "vocab": vocab, "merges": merges}}, f)
        os.remove(os.path.join(folder, "vocab.json"))
        os.remove(os.path.join(folder, "merges.txt"))
        self.assertEqual(self.generate("--base", folder, "--prompt", prompt, "--tokens", "6",
                                       "--temperature", "0"), want)
        r = subprocess.run([self.worker, "generate", "--base", os.path.join(folder, "model.safetensors"),
                            "--heads", "2", "--prompt", "x"], capture_output=True, text=True)
        self.assertEqual(r.returncode, 2)
        self.assertIn("give --tokenizer", r.stderr)

    def test_a_damaged_checkpoint_is_an_error_naming_it(self):
        ckpt = os.path.join(self.dir, "ckpt")
        args = [self.worker, "train", "--base", self.base, "--standalone",
                "--init", os.path.join(self.dir, "lora0.st"), "--data", self.data,
                "--batch-size", str(B), "--steps-per-round", "5", "--max-rounds", "2",
                "--checkpoint-dir", ckpt, "--no-progress"]
        self.run_ok(args)
        [name] = os.listdir(ckpt)
        path = os.path.join(ckpt, name)
        tensors, meta = isthmus.read_safetensors(path)
        self.assertEqual(meta["round"], "2")
        for field, value in (("round", "two"), ("step", "-5"), ("tokens", "1e9")):
            isthmus.write_safetensors(path, tensors, dict(meta, **{field: value}))
            r = subprocess.run(args[:-5] + ["--max-rounds", "3", "--checkpoint-dir", ckpt,
                                            "--no-progress"],
                               capture_output=True, text=True, timeout=120)
            self.assertEqual(r.returncode, 6, r.stderr[-1500:])  # damaged data
            self.assertIn(f"checkpoint {path} metadata {field}", r.stderr)
            self.assertIn("Corruption", r.stderr)
            self.assertNotIn("terminate", r.stderr)

    def test_contradicting_flags_exit_2_naming_the_flag(self):
        for flags, named in ((["--layers", "3"], "--layers"), (["--heads", "4"], "--heads"),
                             (["--context", "32"], "--context")):
            r = subprocess.run([self.worker, "eval", "--base", self.base, *flags,
                                "--trainable", os.path.join(self.dir, "lora0.st"),
                                "--data", self.data],
                               capture_output=True, text=True, timeout=60)
            self.assertEqual(r.returncode, 2, r.stderr)
            self.assertIn(named, r.stderr)
            self.assertIn("contradicts the base", r.stderr)
        r = subprocess.run([self.worker, "export", "--base", self.base, "--lora-rank", "8",
                            "--trainable", os.path.join(self.dir, "lora0.st"),
                            "--out", os.path.join(self.dir, "x.st")],
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("--lora-rank 8 contradicts the trainable tensors", r.stderr)


if __name__ == "__main__":
    unittest.main()
