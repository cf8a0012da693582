"""isthmus.gpt2 on the translation task of `isthmus-data parallel`: token_batches serves one
whole example per window with target -1 off the translation (as isthmus-worker's reader),
refuses a context other than the examples' length, Gpt2Lora.loss averages over the learned
positions only, and a few AdamW steps of a PyTorch site on those batches lower it. The
catalogue is one the test writes (German, 80 messages). Gpt2Lora.translate gives the same
translation as isthmus-worker generate --translate for the same trained adapters.

Distillation: isthmus-worker teach's top-k cache read by token_batches(teacher_topk=...)
lines up with the teacher's own logits computed here in PyTorch, distill_loss equals a
from-scratch loop (and the cross-entropy at alpha 1), distilled steps lower the KL to the
teacher, and a cache of another shard or vocabulary is refused."""

import json
import math
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

    def test_translate_matches_the_workers_generate_translate(self):
        torch.manual_seed(2)
        base_path = os.path.join(self.root, "base-t.safetensors")
        init_path = os.path.join(self.root, "init-t.safetensors")
        worker = os.environ["ISTHMUS_WORKER"]
        subprocess.run([worker, "init", "--layers", "1", "--width", "32", "--heads", "2",
                        "--context", str(CONTEXT), "--lora-rank", "4", "--lora-alpha", "8",
                        "--write-base", base_path, "--out", init_path],
                       check=True, capture_output=True)
        base, _ = isthmus.read_safetensors(base_path)
        lora, _ = isthmus.read_safetensors(init_path)
        model = isthmus.gpt2.Gpt2Lora(base, lora, heads=2, alpha=8.0)
        batches = isthmus.gpt2.token_batches(self.train, 8, CONTEXT, seed=5)
        opt = torch.optim.AdamW(model.lora.parameters(), lr=2e-2)
        for _ in range(60):  # enough for the model to prefer some bytes clearly
            x, y = next(batches)
            loss = model.loss(x, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        trained = os.path.join(self.root, "trained-t.safetensors")
        isthmus.write_safetensors(trained, {n: p.detach().numpy()
                                            for n, p in model.job_parameters().items()})
        for line in ("Row 7", "Row 42"):
            ours = model.translate(line, "de", max_tokens=20)
            theirs = subprocess.run([worker, "generate", "--base", base_path, "--trainable",
                                     trained, "--lora-alpha", "8", "--translate", "de",
                                     "--prompt", line, "--tokens", "20"],
                                    check=True, capture_output=True).stdout.decode()
            self.assertTrue(ours.startswith("Zeile"), ours)  # it learned the task
            self.assertEqual(ours, theirs.rstrip("\n"), line)
        with self.assertRaisesRegex(ValueError, "reads bytes"):
            wide = dict(base, **{"wte.weight": base["wte.weight"].repeat(2, axis=0)})
            isthmus.gpt2.Gpt2Lora(wide, lora, heads=2, alpha=8.0).translate("x", "de")


class Distillation(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.root = tempfile.mkdtemp(prefix="isthmus-distill-py-")
        folder = os.path.join(cls.root, "locale", "de", "LC_MESSAGES")
        os.makedirs(folder)
        write_mo(os.path.join(folder, "t.mo"), {f"Row {i}": f"Zeile {i}" for i in range(80)})
        worker = os.environ["ISTHMUS_WORKER"]
        data = os.path.join(os.path.dirname(worker), "data", "isthmus-data")
        for seed in ("0", "1"):
            subprocess.run([data, "parallel", "--locale-dir", os.path.join(cls.root, "locale"),
                            "--lang", "de", "--out", os.path.join(cls.root, "task" + seed),
                            "--seq-len", str(CONTEXT), "--seed", seed],
                           check=True, capture_output=True)
        cls.train = os.path.join(cls.root, "task0", "train.bin")
        cls.base_path = os.path.join(cls.root, "base.safetensors")
        init_path = os.path.join(cls.root, "init.safetensors")
        subprocess.run([worker, "init", "--layers", "1", "--width", "32", "--heads", "2",
                        "--context", str(CONTEXT), "--lora-rank", "4", "--lora-alpha", "8",
                        "--write-base", cls.base_path, "--out", init_path],
                       check=True, capture_output=True)
        # The pre-trained model as its own teacher: the base alone.
        cls.cache = os.path.join(cls.root, "task0", "train.topk")
        subprocess.run([worker, "teach", "--base", cls.base_path, "--data",
                        os.path.join(cls.root, "task0"), "--k", "8"],
                       check=True, capture_output=True)
        # And the whole distribution (k = V), which a student can match exactly.
        cls.full_cache = os.path.join(cls.root, "full.topk")
        subprocess.run([worker, "teach", "--base", cls.base_path, "--data",
                        os.path.join(cls.root, "task0"), "--k", "256", "--out", cls.full_cache],
                       check=True, capture_output=True)
        cls.base, _ = isthmus.read_safetensors(cls.base_path)
        cls.lora, _ = isthmus.read_safetensors(init_path)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.root, ignore_errors=True)

    def model(self):
        lora = {name: a.copy() for name, a in self.lora.items()}  # each test its own
        return isthmus.gpt2.Gpt2Lora(self.base, lora, heads=2, alpha=8.0)

    def test_the_cache_lines_up_with_the_teachers_logits(self):
        batches = isthmus.gpt2.token_batches(self.train, 4, CONTEXT, seed=2,
                                             teacher_topk=self.cache, vocab_size=256)
        model = self.model()  # lora_B is zero: the base's logits
        for _ in range(3):
            x, y, (ids, logits) = next(batches)
            self.assertEqual(tuple(ids.shape), (4, CONTEXT, 8))
            with torch.no_grad():
                full = model(x)
            learned = y >= 0
            self.assertGreater(int(learned.sum()), 0)
            top = torch.topk(full, 8, dim=-1)
            self.assertTrue(torch.equal(ids[learned][:, 0], top.indices[learned][:, 0]))
            self.assertLess(float((logits[learned] - top.values[learned]).abs().max()), 1e-4)
            self.assertTrue(torch.all(ids[~learned] == 0))

    def test_distill_loss_is_the_formula_and_alpha_one_is_the_cross_entropy(self):
        torch.manual_seed(1)
        n, v, k, alpha, temp = 7, 11, 4, 0.3, 2.5
        logits = torch.randn(n, v, dtype=torch.float64)
        targets = torch.tensor([3, -1, 0, 10, 5, -1, 7])
        ids = torch.stack([torch.randperm(v)[:k] for _ in range(n)])
        teacher = torch.randn(n, k, dtype=torch.float64)
        got = isthmus.gpt2.distill_loss(logits, targets, ids, teacher, alpha, temp)
        rows = []
        for i in range(n):
            if targets[i] < 0:
                continue
            z = logits[i].tolist()
            lse = math.log(sum(math.exp(a) for a in z))
            lse_t = math.log(sum(math.exp(a / temp) for a in z))
            tl = teacher[i].tolist()
            lse_p = math.log(sum(math.exp(a / temp) for a in tl))
            kl = 0.0
            for e in range(k):
                log_p = tl[e] / temp - lse_p
                kl += math.exp(log_p) * (log_p - (z[ids[i, e]] / temp - lse_t))
            rows.append(alpha * (lse - z[targets[i]]) + (1 - alpha) * temp * temp * kl)
        self.assertAlmostEqual(got.item(), sum(rows) / len(rows), places=10)
        ce = torch.nn.functional.cross_entropy(logits, targets, ignore_index=-1)
        self.assertAlmostEqual(
            isthmus.gpt2.distill_loss(logits, targets, ids, teacher, 1.0, temp).item(),
            ce.item(), places=12)

    def test_distilled_steps_move_the_student_towards_the_teacher(self):
        torch.manual_seed(0)
        model = self.model()
        with torch.no_grad():  # a student that starts away from its teacher
            for p in model.lora.parameters():
                p.add_(0.3 * torch.randn_like(p))
        batches = isthmus.gpt2.token_batches(self.train, 8, CONTEXT, seed=4,
                                             teacher_topk=self.full_cache)
        x, y, teacher = next(batches)
        with torch.no_grad():
            first = model.loss(x, y, teacher, alpha=0.0, temperature=1.0).item()
        opt = torch.optim.AdamW(model.lora.parameters(), lr=1e-2)
        for _ in range(30):
            bx, by, bt = next(batches)
            loss = model.loss(bx, by, bt, alpha=0.0, temperature=1.0)
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            self.assertLess(model.loss(x, y, teacher, alpha=0.0, temperature=1.0).item(),
                            0.5 * first)

    def test_a_cache_of_another_shard_or_vocabulary_is_refused(self):
        other = os.path.join(self.root, "task1", "train.bin")
        with self.assertRaisesRegex(ValueError, "computed on another shard"):
            next(isthmus.gpt2.token_batches(other, 2, CONTEXT, seed=1, teacher_topk=self.cache))
        with self.assertRaisesRegex(ValueError, r"teacher's vocabulary \(256 ids, tokenizer "
                                                r"byte\) is not the student's \(300 ids\)"):
            next(isthmus.gpt2.token_batches(self.train, 2, CONTEXT, seed=1,
                                            teacher_topk=self.cache, vocab_size=300))

if __name__ == "__main__":
    unittest.main()
