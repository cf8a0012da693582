"""isthmus-worker on a Llama-family Hugging Face folder: `--base DIR` takes the shape from its
config.json (model_type llama; grouped-query attention, untied head), LoRA adapts every linear
by default, `train` trains, `export` writes a PEFT adapter with PEFT's names and a Llama folder,
and a from-scratch PyTorch Llama (tests/model/llama_reference.py's forward) on the exported
files gives the validation loss `isthmus-worker eval` reports, to 1e-5 relative. A config.json
the worker cannot compute is refused naming the field."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import types
import unittest

import numpy as np
import torch

import isthmus

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
REFERENCE = os.path.join(REPO, "tests", "model", "llama_reference.py")
B, T = 4, 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def load_reference():
    spec = importlib.util.spec_from_file_location("llama_reference", REFERENCE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class LlamaWorkerTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.worker = os.environ["ISTHMUS_WORKER"]
        cls.dir = tempfile.mkdtemp(prefix="isthmus-llama-")
        # A tiny random Llama in Hugging Face's layout over the 256 byte tokens.
        subprocess.run([sys.executable, REFERENCE, cls.dir, "--family", "llama", "--vocab", "256",
                        "--hidden", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2",
                        "--intermediate", "48", "--ctx", "16", "--seed", "3"],
                       check=True, capture_output=True)
        cls.hf = os.path.join(cls.dir, "hf")
        with open(os.path.join(REPO, "docs", "ARCHITECTURE.md"), "rb") as f:
            text = np.frombuffer(f.read(), dtype=np.uint8).astype("<u2")
        cls.data = os.path.join(cls.dir, "data")
        os.makedirs(cls.data)
        text[:15000].tofile(os.path.join(cls.data, "train.bin"))
        cls.val = text[16000:16000 + B * T + 1]  # eval's one batch: B windows of T + 1
        cls.val.tofile(os.path.join(cls.data, "val.bin"))
        cls.reference = load_reference()
        # A tokenizer file beside the weights, which export copies into the folders it writes.
        with open(os.path.join(cls.hf, "tokenizer_config.json"), "w") as f:
            json.dump({"model_max_length": 16, "tokenizer_class": "PreTrainedTokenizerFast"}, f)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir, ignore_errors=True)

    def run_worker(self, *args, ok=True):
        r = subprocess.run([self.worker, *args], capture_output=True, text=True, timeout=300)
        if ok and r.returncode != 0:
            raise AssertionError(f"{args[0]} exited {r.returncode}: {r.stderr[-2000:]}")
        return r

    def train(self, init, save, *flags):
        self.run_worker("train", "--base", self.hf, "--standalone", "--init", init, "--save", save,
                        "--data", self.data, "--batch-size", str(B), "--max-steps", "15",
                        "--lr", "3e-3", "--warmup-steps", "0", "--no-progress", *flags)

    def eval_loss(self, trainable):
        r = self.run_worker("eval", "--base", self.hf, "--trainable", trainable, "--data",
                            self.data, "--batch-size", str(B), "--batches", "1", "--json")
        return json.loads(r.stdout)["val_loss"]

    def reference_model(self, folder, lora_file=None):
        """The reference's arguments for a Hugging Face folder and, optionally, an isthmus
        LoRA file (its "layers.N..." names taken to the reference's PEFT names)."""
        with open(os.path.join(folder, "config.json")) as f:
            c = json.load(f)
        tensors, _ = isthmus.read_safetensors(os.path.join(folder, "model.safetensors"))
        w = {n: torch.from_numpy(x).double() for n, x in tensors.items()}
        lora = {}
        if lora_file:
            trained, _ = isthmus.read_safetensors(lora_file)
            lora = {"base_model.model.model." + n: x for n, x in trained.items()}
        a = types.SimpleNamespace(
            heads=c["num_attention_heads"], kv_heads=c["num_key_value_heads"],
            hidden=c["hidden_size"], layers=c["num_hidden_layers"], eps=c["rms_norm_eps"],
            theta=c["rope_theta"], rope_scaling=False, tied=c["tie_word_embeddings"],
            lora_rank=4 if lora_file else 0)  # the reference scales LoRA by 2 = alpha 8 / 4
        return a, w, {n: torch.from_numpy(x).double() for n, x in lora.items()}

    def torch_loss(self, folder, peft_tensors):
        """The reference's float64 loss of eval's batch on a Hugging Face folder (and PEFT's
        "base_model.model.model.layers..." tensors, the reference's own names)."""
        a, w, _ = self.reference_model(folder)
        a.lora_rank = 4 if peft_tensors else 0
        lora = {n: torch.from_numpy(x).double() for n, x in peft_tensors.items()}
        v = torch.from_numpy(self.val.astype(np.int64))
        x = torch.stack([v[i * T:i * T + T] for i in range(B)])
        y = torch.stack([v[i * T + 1:i * T + T + 1] for i in range(B)])
        with torch.no_grad():
            return self.reference.forward_loss(a, w, lora, x, y).item()

    def test_lora_on_every_linear_exports_a_peft_adapter_pytorch_scores_alike(self):
        init = os.path.join(self.dir, "lora0.st")
        r = self.run_worker("init", "--base", self.hf, "--lora-rank", "4", "--lora-alpha", "8",
                            "--out", init)
        # The job's base hash is that of the checkpoint as the folder holds it.
        folder, _ = isthmus.read_safetensors(os.path.join(self.hf, "model.safetensors"))
        self.assertEqual(r.stdout.strip(), isthmus.tensors_hash(folder))
        lora0, meta = isthmus.read_safetensors(init)
        self.assertEqual(meta["lora_targets"], ",".join(
            ("self_attn." if t in TARGETS[:4] else "mlp.") + t for t in TARGETS))
        self.assertEqual(len(lora0), 2 * 2 * len(TARGETS))
        self.assertEqual(lora0["layers.1.self_attn.k_proj.lora_B.weight"].shape, (16, 4))
        saved = os.path.join(self.dir, "lora.st")
        self.train(init, saved)
        peft = os.path.join(self.dir, "peft")
        self.run_worker("export", "--base", self.hf, "--trainable", saved, "--peft-dir", peft)

        with open(os.path.join(peft, "adapter_config.json")) as f:
            adapter = json.load(f)
        self.assertEqual(adapter["target_modules"], TARGETS)
        self.assertFalse(adapter["fan_in_fan_out"])
        self.assertEqual((adapter["r"], adapter["lora_alpha"]), (4, 8.0))
        base_dir = adapter["base_model_name_or_path"]
        with open(os.path.join(base_dir, "config.json")) as f:
            config = json.load(f)
        self.assertEqual((config["model_type"], config["architectures"]),
                         ("llama", ["LlamaForCausalLM"]))
        self.assertEqual((config["num_key_value_heads"], config["intermediate_size"],
                          config["tie_word_embeddings"]), (2, 48, False))
        with open(os.path.join(base_dir, "tokenizer_config.json")) as f:
            self.assertEqual(json.load(f)["model_max_length"], 16)
        exported, _ = isthmus.read_safetensors(os.path.join(base_dir, "model.safetensors"))
        original, _ = isthmus.read_safetensors(os.path.join(self.hf, "model.safetensors"))
        self.assertEqual(sorted(exported), sorted(original))
        for n in original:
            np.testing.assert_array_equal(exported[n], original[n])

        tensors, _ = isthmus.read_safetensors(os.path.join(peft, "adapter_model.safetensors"))
        prefix = "base_model.model.model.layers."
        self.assertTrue(all(n.startswith(prefix) for n in tensors), sorted(tensors)[:3])
        trained, _ = isthmus.read_safetensors(saved)
        self.assertGreater(max(np.abs(trained[n] - lora0[n]).max() for n in lora0), 1e-4)
        want = self.eval_loss(saved)
        got = self.torch_loss(base_dir, tensors)
        print(f"\n{self._testMethodName}: torch {got:.7f} eval {want:.7f} "
              f"rel {abs(got - want) / want:.2e}")
        self.assertLess(abs(got - want) / want, 1e-5, (got, want))

    def test_full_mode_exports_a_llama_folder_pytorch_scores_alike(self):
        init = os.path.join(self.dir, "full0.st")
        self.run_worker("init", "--mode", "full", "--base", self.hf, "--out", init)
        saved = os.path.join(self.dir, "full.st")
        self.train(init, saved, "--mode", "full")
        out = os.path.join(self.dir, "hf-out")
        self.run_worker("export", "--base", self.hf, "--trainable", saved, "--hf-dir", out)
        model, meta = isthmus.read_safetensors(os.path.join(out, "model.safetensors"))
        self.assertEqual(meta.get("format"), "pt")
        original, _ = isthmus.read_safetensors(os.path.join(self.hf, "model.safetensors"))
        self.assertEqual(sorted(model), sorted(original))
        for n in original:
            self.assertEqual(model[n].shape, original[n].shape, n)
        self.assertGreater(np.abs(model["model.layers.0.mlp.down_proj.weight"] -
                                  original["model.layers.0.mlp.down_proj.weight"]).max(), 1e-4)
        want = self.eval_loss(saved)
        got = self.torch_loss(out, {})
        print(f"\n{self._testMethodName}: torch {got:.7f} eval {want:.7f} "
              f"rel {abs(got - want) / want:.2e}")
        self.assertLess(abs(got - want) / want, 1e-5, (got, want))

    def test_generate_continues_a_prompt_as_pytorch_predicts(self):
        saved = os.path.join(self.dir, "gen.st")
        self.run_worker("init", "--base", self.hf, "--lora-rank", "4", "--lora-alpha", "8",
                        "--out", os.path.join(self.dir, "gen0.st"))
        self.train(os.path.join(self.dir, "gen0.st"), saved)
        prompt = "The shard "
        r = subprocess.run([self.worker, "generate", "--base", self.hf, "--trainable", saved,
                            "--prompt", prompt, "--tokens", "10", "--temperature", "0"],
                           capture_output=True, timeout=300)
        self.assertEqual(r.returncode, 0, r.stderr[-2000:])
        self.assertTrue(r.stdout.endswith(b"\n"))  # generate ends its text with a newline
        out = r.stdout[:-1]
        self.assertTrue(out.startswith(prompt.encode()), out)
        # Greedy decoding by the PyTorch reference on the same tensors, window n_ctx = 16.
        a, w, lora = self.reference_model(self.hf, saved)
        ids = list(prompt.encode())
        with torch.no_grad():
            for _ in range(10):
                x = torch.tensor([ids[-T:]])
                ids.append(int(self.reference.forward_logits(a, w, lora, x)[-1].argmax()))
        self.assertEqual(out, bytes(ids))

    def test_a_config_the_worker_cannot_compute_is_refused_naming_the_field(self):
        folder = os.path.join(self.dir, "windowed")
        shutil.copytree(self.hf, folder, dirs_exist_ok=True)
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
        config.update({"model_type": "mistral", "sliding_window": 8})
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(config, f)
        r = self.run_worker("init", "--base", folder, "--out", os.path.join(self.dir, "w.st"),
                            ok=False)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("sliding_window", r.stderr)
        self.assertFalse(os.path.exists(os.path.join(self.dir, "w.st")))
        # A shape flag that contradicts the folder names both values.
        r = self.run_worker("init", "--base", self.hf, "--heads", "8", "--out",
                            os.path.join(self.dir, "h.st"), ok=False)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("--heads 8 contradicts", r.stderr)


if __name__ == "__main__":
    unittest.main()
