"""A PyTorch site and an isthmus-worker site train one LoRA job together over CURVE peer
links: site A is a PyTorch loop (isthmus.gpt2.Gpt2Lora driven by isthmus.torch.SiteRank),
site B is isthmus-worker; and the same with docs/PYTHON.md's example script as site A,
run with two torch ranks. Both train on real text (this repository's docs, built into
token shards by isthmus-data), both finish every round, the rounds commit on both sites,
and `isthmusctl sync verify` finds the committed digests equal, round for round; the
example script run again against the trained job exits 2, training nothing."""

import json
import os
import shutil
import subprocess
import sys
import time
import unittest

import numpy as np
import torch

import harness
import isthmus
import isthmus.gpt2
import isthmus.torch

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
MODEL = ["--layers", "2", "--width", "32", "--heads", "2", "--context", "16",
         "--lora-rank", "4", "--lora-alpha", "8"]
ROUNDS, H = 3, 4


class InteropTest(unittest.TestCase):
    def setUp(self):
        self.root, self.sites = harness.synced_sites(("A", "B"), sync_config="max_rounds_ahead = 1\n")
        self.worker = os.environ["ISTHMUS_WORKER"]

    def tearDown(self):
        for s in self.sites.values():
            s.close()
        shutil.rmtree(self.root, ignore_errors=True)

    def run_ok(self, cmd):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        self.assertEqual(r.returncode, 0, f"{cmd[0]} failed: {r.stderr[-2000:]}")
        return r.stdout

    def prepare_job(self):
        """Token shards of this repository's docs, a base, the initial adapters, and job
        "mix" created from them on both sites. Returns (data, base, init, base_hash)."""
        root = self.root
        data_bin = os.path.join(os.path.dirname(self.worker), "data", "isthmus-data")
        data = os.path.join(root, "data")
        self.run_ok([data_bin, "build", "--out", data,
                     *(os.path.join(REPO, p) for p in ("README.md", "docs/ARCHITECTURE.md",
                                                        "docs/SYNC.md", "docs/WORKER.md"))])
        base, init = os.path.join(root, "base.safetensors"), os.path.join(root, "init.safetensors")
        base_hash = self.run_ok([self.worker, "init", *MODEL, "--write-base", base,
                                 "--out", init]).strip().splitlines()[-1]
        for site in self.sites.values():
            site.create_job("mix", None, base_hash=base_hash, path=init)
        return data, base, init, base_hash

    def committed(self, site):
        out = site.ctl("sync", "status", "--json")
        self.assertEqual(out.returncode, 0, out.stderr)
        rows = json.loads(out.stdout)
        return min(j["committed_round"] for r in rows for j in r.get("jobs", []) if j["job"] == "mix")

    def test_a_pytorch_site_and_an_isthmus_worker_site_commit_identical_rounds(self):
        self.run_pair(encode=False)

    def test_sites_that_encode_their_own_deltas_commit_identical_rounds(self):
        """Site A's Site.encode_deltas and site B's isthmus-worker --encode-deltas: each
        pushes its rounds encoded with error feedback, and every shard sends them as they
        came (counted as by-worker in `isthmusctl sync status`)."""
        lora0, residuals = self.run_pair(encode=True)
        self.assertEqual(set(residuals), set(lora0))
        self.assertGreater(max(np.abs(r).max() for r in residuals.values()), 0)
        for site in self.sites.values():
            out = site.ctl("sync", "status", "--json")
            self.assertEqual(out.returncode, 0, out.stderr)
            [job] = [j for r in json.loads(out.stdout) for j in r.get("jobs", [])
                     if j["job"] == "mix"]
            self.assertEqual(job["pipelines"], {"by-worker": len(lora0)}, job)

    def run_pair(self, encode):
        """Site A (PyTorch) and site B (isthmus-worker) train ROUNDS rounds; checks that
        they commit identical rounds. Returns the initial adapters and, with `encode`, site
        A's encoder residuals."""
        root, a, b = self.root, self.sites["A"], self.sites["B"]
        data, base, init, base_hash = self.prepare_job()
        lora0, _ = isthmus.read_safetensors(init)
        base_tensors, _ = isthmus.read_safetensors(base)
        # The Python side computes the same base hash as isthmus-worker.
        self.assertEqual(isthmus.tensors_hash(base_tensors), base_hash)

        # Site B: isthmus-worker, in the background.
        log_b = open(os.path.join(root, "worker-B.log"), "w")
        worker_b = subprocess.Popen(
            [self.worker, "train", *MODEL, "--base", base, "--job", "mix",
             "--server", b.worker_eps[0], "--server-key", b.server_pubs[0],
             "--key", b.worker_key, "--client-name", "B", "--data", data,
             "--steps-per-round", str(H), "--max-rounds", str(ROUNDS), "--batch-size", "4",
             "--lr", "3e-3", "--warmup-steps", "0", "--no-progress",
             "--json-summary", os.path.join(root, "worker-B.json"),
             *(["--encode-deltas", "--encode-threads", "2"] if encode else [])],
            stdout=log_b, stderr=subprocess.STDOUT)
        try:
            # Site A: a PyTorch loop.
            torch.manual_seed(0)
            model = isthmus.gpt2.Gpt2Lora(base_tensors, lora0, heads=2, alpha=8.0)
            opt = torch.optim.AdamW(model.lora.parameters(), lr=3e-3)
            site = isthmus.Site(a.worker_eps, job="mix", key=a.worker_key,
                                server_keys=a.server_pubs, client_name="A")
            if encode:
                site.encode_deltas(threads=2)
            rank = isthmus.torch.SiteRank(site, model.job_parameters(), steps_per_round=H,
                                          base_hash=base_hash, staleness_timeout_s=120)
            self.assertEqual(rank.start(), 0)
            batches = isthmus.gpt2.token_batches(os.path.join(data, "train.bin"), 4, 16, seed=3)
            losses = []
            for _ in range(ROUNDS * H):
                x, y = next(batches)
                loss = model.loss(x, y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
                rank.step(tokens=x.numel())
            self.assertEqual(rank.round, ROUNDS)
            code = worker_b.wait(timeout=240)
            with open(log_b.name) as f:
                self.assertEqual(code, 0, f.read()[-3000:])
        finally:
            if worker_b.poll() is None:
                worker_b.kill()
                worker_b.wait()
            log_b.close()
        with open(os.path.join(root, "worker-B.json")) as f:
            summary_b = json.load(f)
        self.assertEqual(summary_b["rounds"], ROUNDS)
        self.assertTrue(all(np.isfinite(losses)))

        # Both sites commit every round (bounded wait), then the digests agree.
        self.wait_committed(a, b)
        self.check_verify(a, b)

        # The merged adapters moved away from the initial ones, identically on both sites.
        merged_a = isthmus.Site(a.worker_eps, job="mix", key=a.worker_key,
                                server_keys=a.server_pubs).pull()
        merged_b = isthmus.Site(b.worker_eps, job="mix", key=b.worker_key,
                                server_keys=b.server_pubs).pull()
        moved = max(np.abs(merged_a[n] - lora0[n]).max() for n in lora0)
        self.assertGreater(moved, 1e-4)
        for n in lora0:
            np.testing.assert_array_equal(merged_a[n], merged_b[n])
        if not encode:
            return lora0, None
        rank.finish()  # the last round in flight completes: the residual after it
        return lora0, site.encoder_residuals()

    def test_the_python_md_example_with_two_torch_ranks(self):
        """docs/PYTHON.md's site_a.py, as printed there, with two gloo ranks at site A."""
        root, a, b = self.root, self.sites["A"], self.sites["B"]
        with open(os.path.join(REPO, "docs", "PYTHON.md")) as f:
            doc = f.read()
        blocks = [blk.split("```", 1)[0] for blk in doc.split("```python\n")[1:]]
        [script] = [blk for blk in blocks if blk.startswith("# site_a.py")]
        with open(os.path.join(root, "site_a.py"), "w") as f:
            f.write(script)
        data, base, init, base_hash = self.prepare_job()
        with open(os.path.join(root, "worker-B.log"), "w") as log_b:
            worker_b = subprocess.Popen(
                [self.worker, "train", *MODEL, "--base", base, "--job", "mix",
                 "--server", b.worker_eps[0], "--server-key", b.server_pubs[0],
                 "--key", b.worker_key, "--client-name", "B", "--data", data,
                 "--steps-per-round", str(H), "--max-rounds", str(ROUNDS), "--batch-size", "4",
                 "--lr", "3e-3", "--warmup-steps", "0", "--no-progress"],
                stdout=log_b, stderr=subprocess.STDOUT)
        try:
            env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(harness.free_port()))
            ranks = [subprocess.Popen(
                [sys.executable, os.path.join(root, "site_a.py"),
                 "--server", a.worker_eps[0], "--server-key", a.server_pubs[0],
                 "--key", a.worker_key, "--job", "mix", "--base", base, "--init", init,
                 "--data", data, "--heads", "2", "--lora-alpha", "8", "--context", "16",
                 "--batch-size", "4", "--steps-per-round", str(H), "--rounds", str(ROUNDS)],
                env=dict(env, RANK=str(r)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True) for r in (0, 1)]
            outs = [p.communicate(timeout=240) for p in ranks]
            for p, (out, err) in zip(ranks, outs):
                self.assertEqual(p.returncode, 0, out[-2000:] + err[-3000:])
            for r in range(1, ROUNDS + 1):
                self.assertIn(f"round {r}: loss", outs[0][0])
            code = worker_b.wait(timeout=240)
            with open(os.path.join(root, "worker-B.log")) as f:
                self.assertEqual(code, 0, f.read()[-3000:])
        finally:
            if worker_b.poll() is None:
                worker_b.kill()
                worker_b.wait()
        self.wait_committed(a, b)
        self.check_verify(a, b)
        [hello] = isthmus.Site(a.worker_eps, job="mix", key=a.worker_key,
                               server_keys=a.server_pubs).hello()
        self.assertEqual(hello["local_round"], ROUNDS)
        # Run again against the trained job: nothing to train, said so, exit 2 (it used to
        # exit 0 having trained nothing).
        again = subprocess.run(
            [sys.executable, os.path.join(root, "site_a.py"),
             "--server", a.worker_eps[0], "--server-key", a.server_pubs[0],
             "--key", a.worker_key, "--job", "mix", "--base", base, "--init", init,
             "--data", data, "--heads", "2", "--lora-alpha", "8", "--context", "16",
             "--batch-size", "4", "--steps-per-round", str(H), "--rounds", str(ROUNDS)],
            env=dict(env, RANK="0", WORLD_SIZE="1", MASTER_PORT=str(harness.free_port())),
            capture_output=True, text=True, timeout=120)
        self.assertEqual(again.returncode, 2, again.stdout + again.stderr)
        self.assertIn(f"nothing to train: job mix is at round {ROUNDS}", again.stderr)
        self.assertNotIn("loss", again.stdout)

    def wait_committed(self, a, b):
        deadline = time.monotonic() + 60
        while min(self.committed(a), self.committed(b)) < ROUNDS:
            self.assertLess(time.monotonic(), deadline, "rounds did not commit in 60 s")
            time.sleep(0.2)

    def check_verify(self, a, b):
        verify = a.ctl("sync", "verify", "--job", "mix", "--json",
                       "--site", f"A={a.admin_eps[0]}", "--site", f"B={b.admin_eps[0]}",
                       "--site-key", f"A={a.server_pubs[0]}", "--site-key", f"B={b.server_pubs[0]}",
                       servers=[])
        self.assertEqual(verify.returncode, 0, verify.stdout + verify.stderr)
        [report] = json.loads(verify.stdout)
        self.assertTrue(report["agree"], report)
        self.assertEqual(report["committed"], {"A": ROUNDS, "B": ROUNDS})
        self.assertEqual(report["rounds_compared"], ROUNDS + 1)  # the initial state too


if __name__ == "__main__":
    unittest.main()
