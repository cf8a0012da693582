"""isthmus.gpt2 on the translation task of `isthmus-data parallel`: token_batches serves one
whole example per window with target -1 off the translation (as isthmus-worker's reader),
refuses a context other than the examples' length, Gpt2Lora.loss averages over the learned
positions only, and a few AdamW steps of a PyTorch site on those batches lower it. The
catalogue is one the test writes (German, 80 messages)."""

import json
import os
import shutil
import subprocess
import tempfile
import unittest

import torch

import isthmus
import isthmus.gpt2

CONTEXT = 48


def write_mo(path, pairs):
    """The catalogue, written by tests/data/write_mo.py."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "write_mo.py")
    subprocess.run(["/usr/bin/python3", script, path], input=json.dumps(pairs).encode(),
                   check=True)


class TranslationBatches(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.root = tempfile.mkdtemp(prefix="isthmus-translate-py-")
        folder = os.path.join(cls.root, "locale", "de", "LC_MESSAGES")
        os.makedirs(folder)
        write_mo(os.path.join(folder, "t.mo"),
                 {f"Row {i}": f"Zeile {i}" for i in range(80)})
        data = os.path.join(os.path.dirname(os.environ["ISTHMUS_WORKER"]), "data",
                            "isthmus-data")
        subprocess.run([data, "parallel", "--locale-dir", os.path.join(cls.root, "locale"),
                        "--lang", "de", "--out", os.path.join(cls.root, "task"),
                        "--seq-len", str(CONTEXT)], check=True, capture_output=True)
        cls.train = os.path.join(cls.root, "task", "train.bin")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.root, ignore_errors=True)

    def test_whole_examples_learned_on_the_translation_only(self):
        batches = isthmus.gpt2.token_batches(self.train, 8, CONTEXT, seed=1)
        for _ in range(5):
            x, y = next(batches)
            self.assertEqual(tuple(x.shape), (8, CONTEXT))
            for row_x, row_y in zip(x.tolist(), y.tolist()):
                text = bytes(row_x).decode()
                learned = bytes(t for t in row_y if t >= 0).decode()
                self.assertTrue(text.startswith("en: Row "), text)
                number = text[len("en: Row "):text.index("\n")]
                self.assertEqual(learned, f"Zeile {number}\n\n")
                self.assertIn(f"de: Zeile {number}\n\n", text)

    def test_another_context_is_refused(self):
        with self.assertRaisesRegex(ValueError, f"use context={CONTEXT}"):
            next(isthmus.gpt2.token_batches(self.train, 2, CONTEXT + 16, seed=1))

    def test_the_loss_is_the_mean_over_learned_positions_and_training_lowers_it(self):
        torch.manual_seed(0)
        base_path = os.path.join(self.root, "base.safetensors")
        init_path = os.path.join(self.root, "init.safetensors")
        subprocess.run([os.environ["ISTHMUS_WORKER"], "init", "--layers", "1", "--width", "32",
                        "--heads", "2", "--context", str(CONTEXT), "--lora-rank", "4",
                        "--lora-alpha", "8", "--write-base", base_path, "--out", init_path],
                       check=True, capture_output=True)
        base, _ = isthmus.read_safetensors(base_path)
        lora, _ = isthmus.read_safetensors(init_path)
        model = isthmus.gpt2.Gpt2Lora(base, lora, heads=2, alpha=8.0)
        batches = isthmus.gpt2.token_batches(self.train, 8, CONTEXT, seed=3)
        x, y = next(batches)
        with torch.no_grad():
            logits = model(x).reshape(-1, 256)
            keep = y.reshape(-1) >= 0
            by_hand = torch.nn.functional.cross_entropy(logits[keep], y.reshape(-1)[keep])
            self.assertAlmostEqual(model.loss(x, y).item(), by_hand.item(), places=5)
            first = model.loss(x, y).item()
        opt = torch.optim.AdamW(model.lora.parameters(), lr=1e-2)
        for _ in range(30):
            bx, by = next(batches)
            loss = model.loss(bx, by)
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            self.assertLess(model.loss(x, y).item(), first)


if __name__ == "__main__":
    unittest.main()
