"""isthmus.torch.SiteRank against real shards: its rounds equal the same rounds done by
hand with the Site API, two torch.distributed ranks split the shards as isthmus-worker's
ranks do and reach the same values as one rank, overlapped rounds (the round driver in the
background) commit bit for bit what serial rounds commit on a site alone, with one rank and
with two, and a site too far ahead of the last cross-site commit waits (and gives up with a
clear error after its timeout)."""

import os
import tempfile
import unittest

import numpy as np
import torch

import harness
import isthmus
import isthmus.torch

STEPS_PER_ROUND = 3
ROUNDS = 3


def initial_tensors():
    g = torch.Generator().manual_seed(1)
    return {"w": torch.randn(4, 8, generator=g).numpy(), "b": torch.zeros(4).numpy()}


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)

    def named_job_parameters(self):
        return {"w": self.lin.weight, "b": self.lin.bias}


def batches(step):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(16, 8, generator=g)
    y = torch.randn(16, 4, generator=g)
    return x, y


def train_step(model, opt, step):
    x, y = batches(step)
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model.lin(x), y)
    loss.backward()
    opt.step()


def run_with_helper(site, rank_group=None, overlap=False, merge_after_steps=None,
                    merge_wait=False):
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    rank = isthmus.torch.SiteRank(site, model.named_job_parameters(),
                                  steps_per_round=STEPS_PER_ROUND, base_hash="base-1",
                                  process_group=rank_group, overlap=overlap,
                                  merge_after_steps=merge_after_steps,
                                  merge_wait=merge_wait)
    start = rank.start()
    ended = 0
    for step in range(STEPS_PER_ROUND * ROUNDS):
        train_step(model, opt, step)
        inflight = rank._inflight
        ended += rank.step(tokens=16)
        if merge_wait and rank.steps_in_round == merge_after_steps:
            # The round in flight was merged after exactly merge_after_steps steps.
            assert not rank._inflight, f"step {step}: round in flight not merged"
        elif merge_after_steps and 0 < rank.steps_in_round < merge_after_steps:
            assert rank._inflight == inflight, f"step {step}: merged before its step"
    rank.finish()
    return start, ended, rank.round


def two_rank_main(rank, init_file, servers, key, pubs, result_file, job="two-ranks",
                  overlap=False):
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                         world_size=2)
    try:
        site = isthmus.Site(servers, job=job, key=key, server_keys=pubs)
        _, _, last = run_with_helper(site, overlap=overlap)
        if rank == 0:
            np.save(result_file, np.array([last]))
    finally:
        torch.distributed.destroy_process_group()


class SiteRankTest(harness.ShardsTestCase):
    def final(self, job):
        return self.shards.client(job).pull()

    def test_helper_equals_the_same_rounds_by_hand(self):
        self.shards.create_job("helper", initial_tensors())
        self.shards.create_job("byhand", initial_tensors())

        start, ended, last = run_with_helper(self.shards.client("helper"))
        self.assertEqual((start, ended, last), (0, ROUNDS, ROUNDS))

        site = self.shards.client("byhand")
        site.hello("base-1")
        torch.manual_seed(0)
        model = Tiny()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        params = model.named_job_parameters()

        def load(merged):
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(torch.from_numpy(merged[n]))

        load(site.pull())
        step = 0
        for r in range(1, ROUNDS + 1):
            begin = {n: p.detach().clone() for n, p in params.items()}
            for _ in range(STEPS_PER_ROUND):
                train_step(model, opt, step)
                step += 1
            pushed = site.push_round(r, {n: (p.detach() - begin[n]) for n, p in params.items()},
                                     tokens=16 * STEPS_PER_ROUND)
            self.assertFalse(any(p["duplicate"] for p in pushed))
            load(site.pull())

        helper, by_hand = self.final("helper"), self.final("byhand")
        for name in ("w", "b"):
            np.testing.assert_array_equal(helper[name], by_hand[name])
        # Training moved the values (the comparison is not between two untouched jobs).
        self.assertGreater(np.abs(helper["w"] - initial_tensors()["w"]).max(), 1e-3)
        # Every round reached both shards once.
        self.assertEqual({t["name"]: t["version"] for t in self.shards.describe("helper")},
                         {"w": 1 + ROUNDS, "b": 1 + ROUNDS})

    def test_two_torch_ranks_split_the_shards_and_match_one_rank(self):
        self.shards.create_job("two-ranks", initial_tensors())
        self.shards.create_job("one-rank", initial_tensors())
        run_with_helper(self.shards.client("one-rank"))
        with tempfile.TemporaryDirectory() as d:
            result = os.path.join(d, "last.npy")
            torch.multiprocessing.spawn(
                two_rank_main, nprocs=2, join=True,
                args=(os.path.join(d, "init"), self.shards.worker_eps, self.shards.worker_key,
                      self.shards.server_pubs, result))
            self.assertEqual(int(np.load(result)[0]), ROUNDS)
        one, two = self.final("one-rank"), self.final("two-ranks")
        for name in ("w", "b"):
            np.testing.assert_array_equal(one[name], two[name])
        # Rank r pushed shard r: each shard saw each round once (not once per rank).
        self.assertEqual({t["name"]: t["version"] for t in self.shards.describe("two-ranks")},
                         {"w": 1 + ROUNDS, "b": 1 + ROUNDS})


class OverlapTest(unittest.TestCase):
    """A synced site without peers: every round commits exactly (dense, outer lr 1, no
    momentum), with max_rounds_ahead 2, so overlapped rounds really run behind the next."""

    @classmethod
    def setUpClass(cls):
        cls.shards = harness.Site(shards=2, extra_config=(
            '[sync]\nsite = "solo"\nouter_lr = 1.0\nouter_momentum = 0.0\n'))

    @classmethod
    def tearDownClass(cls):
        cls.shards.close()

    def test_overlapped_rounds_commit_what_serial_rounds_commit(self):
        for job in ("serial", "overlapped", "overlapped-two-ranks", "overlapped-merge-2",
                    "overlapped-after-2"):
            self.shards.create_job(job, initial_tensors())
        self.assertEqual(run_with_helper(self.shards.client("serial")), (0, ROUNDS, ROUNDS))
        self.assertEqual(run_with_helper(self.shards.client("overlapped"), overlap=True),
                         (0, ROUNDS, ROUNDS))
        self.assertEqual(run_with_helper(self.shards.client("overlapped-merge-2"), overlap=True,
                                         merge_after_steps=2, merge_wait=True),
                         (0, ROUNDS, ROUNDS))
        self.assertEqual(run_with_helper(self.shards.client("overlapped-after-2"), overlap=True,
                                         merge_after_steps=2), (0, ROUNDS, ROUNDS))
        with tempfile.TemporaryDirectory() as d:
            result = os.path.join(d, "last.npy")
            torch.multiprocessing.spawn(
                two_rank_main, nprocs=2, join=True,
                args=(os.path.join(d, "init"), self.shards.worker_eps, self.shards.worker_key,
                      self.shards.server_pubs, result, "overlapped-two-ranks", True))
            self.assertEqual(int(np.load(result)[0]), ROUNDS)
        serial = self.shards.client("serial").pull()
        for job in ("overlapped", "overlapped-two-ranks", "overlapped-merge-2",
                    "overlapped-after-2"):
            site = self.shards.client(job)
            got = site.pull()
            for name in ("w", "b"):
                np.testing.assert_array_equal(got[name], serial[name], err_msg=f"{job} {name}")
            # Each shard closed every round once.
            self.assertEqual([h["local_round"] for h in site.hello("base-1")], [ROUNDS, ROUNDS])
        self.assertGreater(np.abs(serial["w"] - initial_tensors()["w"]).max(), 1e-3)

    def test_a_round_in_flight_owns_the_site_client(self):
        self.shards.create_job("busy", initial_tensors())
        site = self.shards.client("busy")
        site.hello("base-1")
        site.pull()
        site.start_round(1, {k: np.ones_like(v) for k, v in initial_tensors().items()},
                         tokens=1, overlap=True)
        with self.assertRaises(RuntimeError) as cm:
            site.pull()
        self.assertIn("round 1 is in flight", str(cm.exception))
        out = site.wait_round()
        self.assertEqual(out["round"], 1)
        self.assertTrue(out["pushed"])
        np.testing.assert_array_equal(out["pulled"]["b"], np.ones(4, dtype=np.float32))
        self.assertEqual(site.round_state(), "idle")
        self.assertIsNone(site.wait_round())


class StalenessTest(unittest.TestCase):
    def test_a_site_too_far_ahead_waits_then_reports_the_wan(self):
        # A synced shard whose only peer never answers: nothing commits, so after
        # max_rounds_ahead rounds the site must wait.
        with tempfile.TemporaryDirectory() as d:
            pub = isthmus.write_keypair(os.path.join(d, "peer"))
            self.assertEqual(len(pub), 40)
            port = harness.free_port()
            shards = harness.Site(
                shards=1, peer_listen=True, peer_pubs=[f"{d}/peer.pub"], extra_config=(
                '[sync]\nsite = "A"\nmax_rounds_ahead = 1\n'
                f'peers = ["B=tcp://127.0.0.1:{port}={d}/peer.pub"]\n'))
            try:
                shards.create_job("stale", initial_tensors())
                site = shards.client("stale")
                torch.manual_seed(0)
                model = Tiny()
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                rank = isthmus.torch.SiteRank(site, model.named_job_parameters(),
                                              steps_per_round=1, base_hash="base-1",
                                              staleness_timeout_s=0.5, overlap=False)
                rank.start()
                train_step(model, opt, 0)
                self.assertTrue(rank.step())  # round 1: one ahead, within the limit
                st = site.check_staleness()
                self.assertEqual((st["too_far_ahead"], st["rounds_ahead"], st["limit"]),
                                 (False, 1, 1))
                train_step(model, opt, 1)
                with self.assertRaises(RuntimeError) as cm:  # round 2: two ahead
                    rank.step()
                self.assertIn("did not catch up", str(cm.exception))
                self.assertIn("2 rounds ahead of the last commit (limit 1)", str(cm.exception))
                st = site.wait_within_staleness(timeout_s=0.2)
                self.assertTrue(st["too_far_ahead"])
            finally:
                shards.close()


if __name__ == "__main__":
    unittest.main()
