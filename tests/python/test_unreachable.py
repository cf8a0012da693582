"""A shard that is dead or stopped, seen from Python with the default options (issue 27
item 8): a call to a killed shard fails within the documented bound, (1 + retries) x
connect_timeout_ms = 15 s, with ShardError "Unavailable" naming the shard and what to
check (it used to wait 90 s); Ctrl-C (SIGINT) interrupts a call that waits on a stopped
shard, and a wait for the WAN, within a few seconds with KeyboardInterrupt (it used to be
held until the call returned); and the client works again afterwards."""

import os
import signal
import tempfile
import threading
import time
import unittest

import numpy as np

import harness
import isthmus

A0 = np.arange(32, dtype=np.float32).reshape(4, 8)
B0 = np.array([0.5, -1.0, 2.0], dtype=np.float32)


def interrupt_after(seconds):
    """Sends SIGINT to this process (what Ctrl-C does) after `seconds`, from a thread."""
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    return timer


class UnreachableShardTest(unittest.TestCase):
    def setUp(self):
        self.shards = harness.Site(shards=2)
        self.shards.create_job("j", {"a": A0, "b": B0}, base_hash="base-1")

    def tearDown(self):
        for p in self.shards.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
        self.shards.close()

    def test_a_killed_shard_fails_the_call_within_the_bound_naming_it(self):
        site = self.shards.client("j")  # the defaults
        self.assertEqual(len(site.hello("base-1")), 2)
        self.shards.procs[1].kill()
        self.shards.procs[1].wait()
        t0 = time.monotonic()
        with self.assertRaises(isthmus.ShardError) as cm:
            site.hello("base-1")
        elapsed = time.monotonic() - t0
        print(f"killed shard: ShardError after {elapsed:.1f} s: {cm.exception}")
        self.assertEqual(cm.exception.code, "Unavailable", cm.exception.message)
        self.assertIn("shard 1", cm.exception.message)
        self.assertIn(self.shards.worker_eps[1], cm.exception.message)
        self.assertIn("is isthmus-server running there", cm.exception.message)
        self.assertLess(elapsed, 20.0, "documented: (1 + retries) x connect_timeout_ms = 15 s")
        # A shard that never existed: the same, from the first call.
        port = harness.free_port()
        dead = isthmus.Site(f"tcp://127.0.0.1:{port}", job="j", key=self.shards.worker_key,
                            server_keys=self.shards.server_pubs[0], connect_timeout_ms=500)
        t0 = time.monotonic()
        with self.assertRaises(isthmus.ShardError) as cm:
            dead.pull()
        self.assertEqual(cm.exception.code, "Unavailable")
        self.assertIn(f"127.0.0.1:{port}", cm.exception.message)
        self.assertLess(time.monotonic() - t0, 6.0)

    def test_ctrl_c_interrupts_a_call_to_a_stopped_shard(self):
        site = self.shards.client("j")
        site.hello("base-1")
        self.shards.procs[1].send_signal(signal.SIGSTOP)
        timer = interrupt_after(1.0)
        t0 = time.monotonic()
        try:
            with self.assertRaises(KeyboardInterrupt):
                site.hello("base-1")  # would wait timeout_ms (30 s) per attempt
        finally:
            timer.cancel()
        elapsed = time.monotonic() - t0
        print(f"stopped shard: KeyboardInterrupt after {elapsed:.2f} s")
        self.assertGreater(elapsed, 0.9)
        self.assertLess(elapsed, 4.0)
        # The client is usable again once the shard runs again.
        self.shards.procs[1].send_signal(signal.SIGCONT)
        self.assertEqual(len(site.hello("base-1")), 2)

    def test_bad_arguments_to_the_site_raise_value_error_naming_them(self):
        with self.assertRaises(ValueError) as cm:
            self.shards.client("j", connect_timeout_ms=0)
        self.assertIn("connect_timeout_ms", str(cm.exception))
        with self.assertRaises(TypeError) as cm:
            self.shards.client("j", timeout_ms="30")
        self.assertIn("timeout_ms", str(cm.exception))


class InterruptedWaitTest(unittest.TestCase):
    def test_ctrl_c_interrupts_a_wait_for_the_wan(self):
        # A synced shard whose only peer never answers: after one round the site is too far
        # ahead (max_rounds_ahead = 0) and wait_within_staleness() would wait an hour.
        with tempfile.TemporaryDirectory() as d:
            isthmus.write_keypair(os.path.join(d, "peer"))
            port = harness.free_port()
            shards = harness.Site(
                shards=1, peer_listen=True, peer_pubs=[f"{d}/peer.pub"], extra_config=(
                '[sync]\nsite = "A"\nmax_rounds_ahead = 0\n'
                f'peers = ["B=tcp://127.0.0.1:{port}={d}/peer.pub"]\n'))
            try:
                shards.create_job("stale", {"a": A0, "b": B0})
                site = shards.client("stale")
                site.hello("base-1")
                site.pull()
                site.push_round(1, {"a": np.ones_like(A0), "b": np.ones_like(B0)})
                self.assertTrue(site.check_staleness()["too_far_ahead"])
                timer = interrupt_after(1.0)
                t0 = time.monotonic()
                try:
                    with self.assertRaises(KeyboardInterrupt):
                        site.wait_within_staleness()  # timeout_s=3600 by default
                finally:
                    timer.cancel()
                elapsed = time.monotonic() - t0
                print(f"wait for the WAN: KeyboardInterrupt after {elapsed:.2f} s")
                self.assertLess(elapsed, 4.0)
                self.assertTrue(site.check_staleness()["too_far_ahead"])  # still usable
            finally:
                shards.close()


if __name__ == "__main__":
    unittest.main()
