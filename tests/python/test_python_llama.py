"""isthmus.llama against isthmus-worker on Llama-family Hugging Face folders (written by
tests/model/llama_reference.py: Llama with an untied head, Llama with Llama 3's rope_scaling,
Qwen2 with q/k/v biases and a tied head): LlamaLora.base_hash() is the base hash
`isthmus-worker init --base DIR` prints; on the LoRA factors `isthmus-worker train` saved,
LlamaLora's loss is the validation loss `isthmus-worker eval` reports, to 1e-5 relative (from a
single file and from a sharded index alike); new factors have the job's names and shapes
(those of `isthmus-worker init --out`) and train; a config.json the worker refuses is refused
naming the field."""

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

import numpy as np
import torch

import isthmus
from isthmus.llama import TARGETS, LlamaLora

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
REFERENCE = os.path.join(REPO, "tests", "model", "llama_reference.py")
B, T = 4, 16
SHAPE = ["--vocab", "256", "--hidden", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2",
         "--intermediate", "48", "--ctx", str(T)]
FOLDERS = {"llama": ["--family", "llama", "--seed", "3"],
           "llama-rope-scaling": ["--family", "llama", "--rope-scaling", "--seed", "4"],
           "qwen2-tied": ["--family", "qwen2", "--tied", "--seed", "5"]}


class LlamaLoraTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.worker = os.environ["ISTHMUS_WORKER"]
        cls.dir = tempfile.mkdtemp(prefix="isthmus-pyllama-")
        cls.folders = {}
        for name, flags in FOLDERS.items():
            out = os.path.join(cls.dir, name)
            subprocess.run([sys.executable, REFERENCE, out, *SHAPE, *flags], check=True,
                           capture_output=True)
            cls.folders[name] = os.path.join(out, "hf")
        # Byte tokens of a document; eval's one batch is the B windows of T + 1 of val.bin.
        with open(os.path.join(REPO, "docs", "ARCHITECTURE.md"), "rb") as f:
            text = np.frombuffer(f.read(), dtype=np.uint8).astype("<u2")
        cls.data = os.path.join(cls.dir, "data")
        os.makedirs(cls.data)
        text[:15000].tofile(os.path.join(cls.data, "train.bin"))
        val = torch.from_numpy(text[16000:16000 + B * T + 1].astype(np.int64))
        val.numpy().astype("<u2").tofile(os.path.join(cls.data, "val.bin"))
        cls.x = torch.stack([val[i * T:i * T + T] for i in range(B)])
        cls.y = torch.stack([val[i * T + 1:i * T + T + 1] for i in range(B)])

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir, ignore_errors=True)

    def run_worker(self, *args):
        r = subprocess.run([self.worker, *args], capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise AssertionError(f"{args[0]} exited {r.returncode}: {r.stderr[-2000:]}")
        return r

    def init(self, folder, out):
        """isthmus-worker init's base hash (its first line) after writing rank-4 factors."""
        r = self.run_worker("init", "--base", folder, "--lora-rank", "4", "--lora-alpha", "8",
                            "--out", out)
        return r.stdout.splitlines()[0]

    def trained(self, name):
        """The factors isthmus-worker trained for 15 steps on folder `name` (a file)."""
        folder, init = self.folders[name], os.path.join(self.dir, name + "-init.st")
        saved = os.path.join(self.dir, name + "-trained.st")
        if not os.path.exists(saved):
            self.init(folder, init)
            self.run_worker("train", "--base", folder, "--standalone", "--init", init, "--save",
                            saved, "--data", self.data, "--batch-size", str(B), "--max-steps",
                            "15", "--lr", "3e-3", "--warmup-steps", "0", "--no-progress")
        return saved

    def eval_loss(self, folder, trainable):
        r = self.run_worker("eval", "--base", folder, "--trainable", trainable, "--data",
                            self.data, "--batch-size", str(B), "--batches", "1", "--json")
        return json.loads(r.stdout)["val_loss"]

    def assert_loss_matches(self, model, want, label):
        with torch.no_grad():
            got = model.loss(self.x, self.y).item()
        print(f"\n{label}: torch {got:.7f} eval {want:.7f} rel {abs(got - want) / want:.2e}")
        self.assertLess(abs(got - want) / want, 1e-5, (label, got, want))

    def test_base_hash_is_the_one_isthmus_worker_init_prints(self):
        for name, folder in self.folders.items():
            with self.subTest(name):
                want = self.init(folder, os.path.join(self.dir, name + "-hash.st"))
                self.assertRegex(want, r"^[0-9a-f]{64}$")
                self.assertEqual(LlamaLora.from_folder(folder).base_hash(), want)
        # A tied checkpoint that also stores the head (a copy of the embedding) and a rotary
        # buffer hashes as without them.
        folder = os.path.join(self.dir, "qwen2-extra")
        shutil.copytree(self.folders["qwen2-tied"], folder)
        path = os.path.join(folder, "model.safetensors")
        tensors, meta = isthmus.read_safetensors(path)
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)
        isthmus.write_safetensors(path, tensors, meta)
        self.assertEqual(LlamaLora.from_folder(folder).base_hash(),
                         LlamaLora.from_folder(self.folders["qwen2-tied"]).base_hash())

    def test_loss_on_trained_factors_is_isthmus_worker_eval_loss(self):
        for name, folder in self.folders.items():
            with self.subTest(name):
                saved = self.trained(name)
                lora, _ = isthmus.read_safetensors(saved)
                init, _ = isthmus.read_safetensors(os.path.join(self.dir, name + "-init.st"))
                self.assertGreater(max(np.abs(lora[n] - init[n]).max() for n in lora), 1e-4)
                model = LlamaLora.from_folder(folder, lora=lora, rank=4, alpha=8)
                self.assertEqual(sorted(model.job_parameters()), sorted(lora))
                self.assert_loss_matches(model, self.eval_loss(folder, saved), name)

    def test_a_sharded_checkpoint_reads_as_the_single_file(self):
        folder = os.path.join(self.dir, "sharded")
        os.makedirs(folder)
        shutil.copy(os.path.join(self.folders["llama"], "config.json"), folder)
        tensors, _ = isthmus.read_safetensors(
            os.path.join(self.folders["llama"], "model.safetensors"))
        names = sorted(tensors)
        weight_map = {}
        for k, part in enumerate((names[:len(names) // 2], names[len(names) // 2:])):
            shard = f"model-{k + 1:05d}-of-00002.safetensors"
            isthmus.write_safetensors(os.path.join(folder, shard), {n: tensors[n] for n in part},
                                      {"format": "pt"})
            weight_map.update({n: shard for n in part})
        with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
        saved = self.trained("llama")
        model = LlamaLora.from_folder(folder, lora=isthmus.read_safetensors(saved)[0], alpha=8)
        single = LlamaLora.from_folder(self.folders["llama"])
        self.assertEqual(model.base_hash(), single.base_hash())
        self.assert_loss_matches(model, self.eval_loss(self.folders["llama"], saved), "sharded")

    def test_new_factors_have_the_jobs_names_and_train(self):
        folder = self.folders["llama"]
        init = os.path.join(self.dir, "names.st")
        self.init(folder, init)
        job, meta = isthmus.read_safetensors(init)
        self.assertEqual(meta["lora_targets"], ",".join(TARGETS))
        model = LlamaLora.from_folder(folder, rank=4, alpha=8.0, seed=1)
        params = model.job_parameters()
        self.assertEqual({n: tuple(p.shape) for n, p in params.items()},
                         {n: a.shape for n, a in job.items()})
        for n, p in params.items():
            self.assertTrue(p.requires_grad, n)
            if ".lora_B." in n:
                self.assertEqual(p.abs().max().item(), 0.0, n)
            else:
                self.assertLessEqual(p.abs().max().item(), 1 / math.sqrt(p.shape[1]), n)
                self.assertGreater(p.abs().max().item(), 0.5 / math.sqrt(p.shape[1]), n)
        trainable = {id(p) for p in params.values()}
        frozen = [n for n, p in model.named_parameters() if id(p) not in trainable]
        self.assertIn("embed_tokens", frozen)
        self.assertTrue(all(not p.requires_grad for n, p in model.named_parameters()
                            if id(p) not in trainable))
        opt = torch.optim.SGD(params.values(), lr=0.1)
        losses = []
        for _ in range(10):
            loss = model.loss(self.x, self.y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        print(f"\nSGD on the factors: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
        self.assertLess(losses[-1], losses[0] - 0.05, losses)
        self.assertTrue(all(p.grad is None for n, p in model.named_parameters()
                            if id(p) not in trainable))
        # Another rank or other targets than the tensors' is refused, naming both.
        with self.assertRaisesRegex(ValueError, "rank 4, not rank=8"):
            LlamaLora.from_folder(folder, lora=job, rank=8)
        with self.assertRaisesRegex(ValueError, "not targets="):
            LlamaLora.from_folder(folder, lora=job, targets=["q_proj", "v_proj"])
        only_qv = LlamaLora.from_folder(folder, rank=2, targets=["q_proj", "v_proj"])
        self.assertEqual(len(only_qv.job_parameters()), 2 * 2 * 2)

    def test_a_config_isthmus_worker_refuses_is_refused_naming_the_field(self):
        with open(os.path.join(self.folders["llama"], "config.json")) as f:
            config = json.load(f)
        cases = {"model_type": {"model_type": "gemma"},
                 "hidden_act": {"hidden_act": "gelu"},
                 "head_dim": {"head_dim": 16},
                 "rope_scaling": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
                 "sliding_window": {"model_type": "mistral", "sliding_window": 8},
                 "mlp_bias": {"mlp_bias": True},
                 "attention_bias": {"attention_bias": True},
                 "num_local_experts": {"num_local_experts": 8},
                 "quantization_config": {"quantization_config": {"quant_method": "gptq"}}}
        folder = os.path.join(self.dir, "refused")
        shutil.copytree(self.folders["llama"], folder)
        for field, change in cases.items():
            with self.subTest(field):
                with open(os.path.join(folder, "config.json"), "w") as f:
                    json.dump({**config, **change}, f)
                with self.assertRaisesRegex(ValueError, field):
                    LlamaLora.from_folder(folder)
                r = subprocess.run([self.worker, "init", "--base", folder, "--out",
                                    os.path.join(self.dir, "refused.st")],
                                   capture_output=True, text=True, timeout=60)
                self.assertNotEqual(r.returncode, 0, field)
                self.assertIn(field, r.stderr)


if __name__ == "__main__":
    unittest.main()
