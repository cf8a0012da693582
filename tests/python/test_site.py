"""The Python package against real isthmus-server shards on loopback with CURVE: hello,
pull, push rounds, idempotent retries, staleness, refusals of bad input (with the shard
unchanged), and zero-copy in both directions."""

import unittest

import numpy as np

import harness
import isthmus

A0 = np.arange(32, dtype=np.float32).reshape(4, 8)
B0 = np.array([0.5, -1.0, 2.0], dtype=np.float32)


class SiteTest(harness.ShardsTestCase):
    def fresh_job(self, name):
        self.shards.create_job(name, {"a": A0, "b": B0}, base_hash="base-1")
        return self.shards.client(name)

    def test_hello_pull_push_and_retry(self):
        site = self.fresh_job("basic")
        hellos = site.hello("base-1")
        self.assertEqual(len(hellos), 2)
        self.assertEqual(sum(h["tensor_count"] for h in hellos), 2)
        self.assertEqual({h["local_round"] for h in hellos}, {0})
        # A plain job takes large pushes in parts of the shard's storage.push_part_bytes.
        self.assertEqual({h["push_part_bytes"] for h in hellos}, {1 << 20})

        pulled = site.pull()
        self.assertEqual(sorted(pulled), ["a", "b"])
        np.testing.assert_array_equal(pulled["a"], A0)
        np.testing.assert_array_equal(pulled["b"], B0)
        self.assertEqual(pulled["a"].dtype, np.float32)
        # The two tensors sit on different shards, and the client knows where.
        self.assertEqual(sorted(site.placement.values()), [0, 1])

        da = np.full((4, 8), 0.25, dtype=np.float32)
        db = np.array([1, 2, 3], dtype=np.float32)
        pushed = site.push_round(1, {"a": da, "b": db}, tokens=512, compute_ms=40)
        self.assertEqual([p["shard"] for p in pushed], [0, 1])
        self.assertFalse(any(p["duplicate"] for p in pushed))
        self.assertEqual(sum(p["tensors"] for p in pushed), 2)
        self.assertEqual(pushed[0]["key"], site.push_key(1, 0))
        self.assertEqual(pushed[0]["key"], "basic/site/r1/s0")

        after = site.pull()
        np.testing.assert_array_equal(after["a"], A0 + da)
        np.testing.assert_array_equal(after["b"], B0 + db)

        # A retried round (same idempotency keys) is applied at most once.
        again = site.push_round(1, {"a": da, "b": db}, tokens=512, compute_ms=40)
        self.assertTrue(all(p["duplicate"] for p in again))
        np.testing.assert_array_equal(site.pull()["a"], A0 + da)

        # Each tensor changed once: the first push, not its retry.
        self.assertEqual({t["name"]: t["version"] for t in self.shards.describe("basic")},
                         {"a": 2, "b": 2})

        # No cross-site sync here: nothing to wait for.
        st = site.check_staleness()
        self.assertFalse(st["too_far_ahead"])
        self.assertFalse(site.wait_within_staleness(timeout_s=1)["too_far_ahead"])

    def test_wrong_base_and_unknown_job_raise_with_the_shards_code(self):
        site = self.fresh_job("refusals")
        with self.assertRaises(isthmus.ShardError) as cm:
            site.hello("another-base")
        self.assertEqual(cm.exception.code, "FailedPrecondition")
        self.assertIn("another base model", cm.exception.message)
        self.assertIn("shard 0", cm.exception.message)
        with self.assertRaises(isthmus.ShardError) as cm:
            self.shards.client("no-such-job").hello("base-1")
        self.assertEqual(cm.exception.code, "NotFound")

    def test_bad_input_raises_and_leaves_the_shards_unchanged(self):
        site = self.fresh_job("badinput")
        site.hello("base-1")
        site.pull()
        before = self.shards.describe("badinput")
        good_b = np.zeros(3, dtype=np.float32)

        with self.assertRaises(TypeError) as cm:  # wrong dtype
            site.push_round(1, {"a": np.zeros((4, 8)), "b": good_b})
        self.assertIn("float32", str(cm.exception))
        with self.assertRaises(ValueError) as cm:  # not contiguous
            site.push_round(1, {"a": np.zeros((8, 4), dtype=np.float32).T, "b": good_b})
        self.assertIn("contiguous", str(cm.exception))
        with self.assertRaises(TypeError):  # no buffer at all
            site.push_round(1, {"a": [0.0] * 32, "b": good_b})
        with self.assertRaises(isthmus.ShardError) as cm:  # unknown name
            site.push_round(1, {"zz": np.zeros(3, dtype=np.float32)})
        self.assertEqual(cm.exception.code, "NotFound")
        self.assertIn("'zz'", cm.exception.message)
        with self.assertRaises(isthmus.ShardError) as cm:  # wrong shape for the job
            site.push_round(1, {"a": np.zeros((8, 4), dtype=np.float32), "b": good_b})
        self.assertNotEqual(cm.exception.code, "Ok")
        nan_a = np.zeros((4, 8), dtype=np.float32)
        nan_a[1, 2] = np.nan
        with self.assertRaises(isthmus.ShardError) as cm:  # NaN
            site.push_round(1, {"a": nan_a, "b": good_b})
        self.assertEqual(cm.exception.code, "InvalidArgument")
        self.assertIn("not finite", cm.exception.message)

        # A round that leaves out a tensor (issue 27 item 4: shard 0 took "a", shard 1 never
        # saw the round, and a retry with "b" was a "duplicate") is refused before anything
        # is sent, naming what is missing.
        with self.assertRaises(isthmus.ShardError) as cm:
            site.push_round(1, {"a": np.zeros((4, 8), dtype=np.float32)})
        self.assertEqual(cm.exception.code, "InvalidArgument")
        self.assertIn("(b)", cm.exception.message)
        self.assertIn("nothing was sent", cm.exception.message)

        np.testing.assert_array_equal(site.pull()["a"], A0)
        np.testing.assert_array_equal(site.pull()["b"], B0)
        self.assertEqual(self.shards.describe("badinput"), before)
        # The full round goes through afterwards.
        pushed = site.push_round(1, {"a": np.ones((4, 8), dtype=np.float32), "b": good_b})
        self.assertFalse(any(p["duplicate"] for p in pushed))
        np.testing.assert_array_equal(site.pull()["a"], A0 + 1)

    def test_bad_round_and_counts_raise_value_error_naming_the_argument(self):
        # Issue 27 item 11: a negative round raised pybind11's TypeError, which printed
        # every argument, the arrays included.
        site = self.fresh_job("badround")
        site.hello("base-1")
        site.pull()
        before = self.shards.describe("badround")
        big = {"a": np.zeros((4, 8), dtype=np.float32), "b": np.zeros(3, dtype=np.float32)}
        for kwargs, name in (({"round": -1}, "round"), ({"round": 0}, "round"),
                             ({"round": 1, "tokens": -5}, "tokens"),
                             ({"round": 1, "compute_ms": -1}, "compute_ms"),
                             ({"round": 1, "rank": 2, "world": 2}, "rank"),
                             ({"round": 1, "world": 0}, "world")):
            with self.assertRaises(ValueError, msg=str(kwargs)) as cm:
                site.push_round(deltas=big, **kwargs)
            text = str(cm.exception)
            self.assertTrue(text.startswith(f"{name} must be"), text)
            self.assertNotIn("array(", text)
            self.assertLess(len(text), 200, text)
        with self.assertRaises(ValueError) as cm:
            site.push_round(-1, big)
        self.assertIn("round must be >= 1", str(cm.exception))
        self.assertIn("local_round", str(cm.exception))
        with self.assertRaises(TypeError) as cm:
            site.push_round(1.5, big)
        self.assertIn("round must be an integer", str(cm.exception))
        # The C++ binding refuses them the same way for callers that skip the package.
        with self.assertRaises(ValueError) as cm:
            site._core.push_round(-1, big, 0, 0, 0, 1)
        self.assertIn("round must be >= 1", str(cm.exception))
        self.assertNotIn("array(", str(cm.exception))
        self.assertEqual(self.shards.describe("badround"), before)

    def test_torch_tensors_are_checked_before_anything_is_sent(self):
        import torch
        site = self.fresh_job("torchinput")
        site.hello("base-1")
        site.pull()
        b = torch.zeros(3)
        with self.assertRaises(TypeError):
            site.push_round(1, {"a": torch.zeros(4, 8, dtype=torch.float64), "b": b})
        with self.assertRaises(ValueError):
            site.push_round(1, {"a": torch.zeros(8, 4).t(), "b": b})
        # A CPU float32 tensor crosses via its numpy view.
        site.push_round(1, {"a": torch.ones(4, 8), "b": b})
        np.testing.assert_array_equal(site.pull()["a"], A0 + 1)

    def test_pulled_arrays_point_into_the_received_message(self):
        site = self.fresh_job("zerocopy")
        pulled = site.pull()
        a = pulled["a"]
        self.assertFalse(a.flags["OWNDATA"])
        self.assertEqual(type(a.base).__name__, "PyCapsule")
        # The arrays keep the message alive after everything else is gone.
        del pulled, site
        np.testing.assert_array_equal(a, A0)

    def test_safetensors_round_trip_and_hash(self):
        import os
        import tempfile
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "t.safetensors")
            isthmus.write_safetensors(path, {"a": A0, "b": B0}, {"format": "pt"})
            tensors, meta = isthmus.read_safetensors(path)
            self.assertEqual(meta, {"format": "pt"})
            np.testing.assert_array_equal(tensors["a"], A0)
            np.testing.assert_array_equal(tensors["b"], B0)
            h = isthmus.tensors_hash({"a": A0, "b": B0})
            self.assertEqual(len(h), 64)
            self.assertEqual(isthmus.tensors_hash({"b": B0, "a": A0}), h)  # order-free
            self.assertNotEqual(isthmus.tensors_hash({"a": A0, "b": B0 + 1}), h)
            with open(path, "r+b") as f:
                f.write(b"\xff" * 8)  # a header length beyond the file
            with self.assertRaises(isthmus.ShardError) as cm:
                isthmus.read_safetensors(path)
            self.assertEqual(cm.exception.code, "Corruption")
            with self.assertRaises(TypeError):
                isthmus.write_safetensors(path, {"a": np.zeros(3)})  # float64

    def test_keys_are_written_and_checked(self):
        import os
        import tempfile
        with tempfile.TemporaryDirectory() as d:
            pub = isthmus.write_keypair(os.path.join(d, "k"))
            self.assertEqual(len(pub), 40)
            self.assertEqual(isthmus.load_public_key(os.path.join(d, "k.pub")), pub)
            self.assertEqual(isthmus.load_keypair(os.path.join(d, "k.key"))[0], pub)
            with self.assertRaises(isthmus.ShardError) as cm:  # no overwrite
                isthmus.write_keypair(os.path.join(d, "k"))
            self.assertEqual(cm.exception.code, "AlreadyExists")
            os.chmod(os.path.join(d, "k.key"), 0o644)
            with self.assertRaises(isthmus.ShardError) as cm:
                isthmus.load_keypair(os.path.join(d, "k.key"))
            self.assertEqual(cm.exception.code, "PermissionDenied")


if __name__ == "__main__":
    unittest.main()
