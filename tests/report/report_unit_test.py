#!/usr/bin/python3
"""deploy/report.py on made-up run folders: what it does with partial data, and how it
attributes a link's bytes to rounds (tests/report/report_test.sh runs it on a real run).

Usage: report_unit_test.py (exit 77 without matplotlib, as ctest's SKIP_RETURN_CODE)
"""
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import unittest

if importlib.util.find_spec("matplotlib") is None:
    print("SKIP: /usr/bin/python3 has no matplotlib (apt-get install python3-matplotlib)")
    sys.exit(77)

REPORT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "deploy", "report.py")
spec = importlib.util.spec_from_file_location("report", REPORT)
report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(report)


def link(wire, payload, sent, acked, outbox, resends=0, bw=0):
    return {"site": "B", "endpoint": "tcp://b", "connected": True, "paused": False,
            "jobs": [{"job": "j", "acked_round": acked, "outbox_round": outbox,
                      "lag_rounds": outbox - acked}],
            "bytes_sent": payload, "raw_bytes_sent": payload * 4, "wire_bytes_sent": wire,
            "deltas_sent": sent, "resends": resends, "bandwidth_bps": bw}


def sample(t, *shards, members=None, removed=None):
    """One isthmusctl top --json line of site A; each shard (committed, local, link, pipes)
    or None for a shard that did not answer; `members` and `removed` the job's membership
    (sync status --json's fields; left out when None)."""
    rows = []
    for i, sh in enumerate(shards):
        if sh is None:
            rows.append({"shard": i, "endpoint": "x", "reachable": False, "error": "Unavailable",
                         "stats": None, "sync": None, "rates": {"links": {}}})
            continue
        committed, local, l, pipes = sh
        rows.append({"shard": i, "endpoint": "x", "reachable": True, "stats": {},
                     "sync": {"site": "A", "shard_index": i, "links": [l],
                              "jobs": [dict({"job": "j", "committed_round": committed,
                                             "local_round": local, "pipelines": pipes},
                                            **({} if members is None else {"members": members}),
                                            **({} if removed is None else {"removed": removed}))]},
                     "rates": {"links": {"B": {"wire_sent_bytes_per_s": 10.0}}}})
    return {"time": t, "interval_s": 1, "shards": rows}


def read(path):
    with open(path) as f:
        return f.read()


def run_report(folder, *args):
    p = subprocess.run([sys.executable, REPORT, "--run", folder, *args], capture_output=True, text=True)
    return p.returncode, p.stdout, p.stderr


class Attribution(unittest.TestCase):
    def series(self, samples):
        with tempfile.TemporaryDirectory() as d:
            with open(f"{d}/top-A.jsonl", "w") as f:
                for s in samples:
                    f.write(json.dumps(s) + "\n")
            run = report.Run(d, "j")
            return report.site_series(run, "A")

    def test_rounds_queued_before_they_are_sent_get_their_own_bytes(self):
        # Rounds 1 and 2 enter the outbox by t=1, but only round 1 goes out; round 2 goes
        # out with round 3 by t=2. Each delta is 100 bytes.
        ser = self.series([
            sample(0, (0, 0, link(10, 0, 0, 0, 0), {})),
            sample(1, (0, 2, link(110, 100, 1, 0, 2), {"dense": 1})),
            sample(2, (1, 3, link(310, 300, 3, 1, 3), {"dense": 1})),
            sample(3, (3, 3, link(320, 300, 3, 3, 3), {"dense": 1})),
        ])
        rounds, other, total = report.per_round_bytes(ser, "B", "payload")
        self.assertEqual(rounds, {1: 100, 2: 100, 3: 100})
        rounds, other, total = report.per_round_bytes(ser, "B", "wire")
        self.assertEqual((other, total), (20, 320))  # the handshake and the last ack
        self.assertEqual(rounds, {1: 100, 2: 100, 3: 100})

    def test_a_reconnect_resends_from_the_acknowledged_round(self):
        ser = self.series([
            sample(0, (0, 2, link(200, 200, 2, 0, 2), {})),
            # reconnect: rounds 1 and 2 sent again (resends counted), then round 3
            sample(1, (2, 3, link(500, 500, 5, 2, 3, resends=1), {})),
        ])
        rounds, _, _ = report.per_round_bytes(ser, "B", "payload")
        self.assertEqual(rounds, {1: 200, 2: 200, 3: 100})

    def test_a_restarted_shard_counts_from_zero_and_a_silent_one_later(self):
        ser = self.series([
            sample(0, (0, 1, link(100, 100, 1, 0, 1), {}), (0, 1, link(100, 100, 1, 0, 1), {})),
            sample(1, None, (1, 2, link(200, 200, 2, 1, 2), {})),
            sample(2, (1, 2, link(200, 200, 2, 1, 2), {}), (2, 2, link(200, 200, 2, 2, 2), {})),
            sample(3, (2, 3, link(100, 100, 1, 2, 3), {}), (2, 3, link(300, 300, 3, 2, 3), {})),
        ])
        self.assertEqual([s["committed"] for s in ser], [0, None, 1, 2])  # None: a shard silent
        rounds, _, total = report.per_round_bytes(ser, "B", "payload")
        self.assertEqual(total, 100 + 100 + 100 + 100 + 100 + 100)
        self.assertEqual(rounds, {1: 200, 2: 200, 3: 200})


class RemovedPeer(unittest.TestCase):
    def test_a_removed_peers_lag_is_not_drawn_from_its_removal_on(self):
        # B is removed from round 2; its link stays configured and its lag would only grow.
        samples = [
            sample(0, (0, 1, link(10, 10, 1, 0, 1), {}), members=["A", "B"]),
            sample(1, (1, 3, link(20, 20, 2, 1, 3), {}), members=["A", "B"]),
            sample(2, (3, 5, link(20, 20, 2, 1, 5), {}), members=["A"], removed={"B": 2}),
            sample(3, (5, 7, link(20, 20, 2, 1, 7), {}), members=["A"], removed={"B": 2}),
        ]
        with tempfile.TemporaryDirectory() as d:
            with open(f"{d}/top-A.jsonl", "w") as f:
                for s in samples:
                    f.write(json.dumps(s) + "\n")
            run = report.Run(d, "j")
            ser = report.site_series(run, "A")
            self.assertEqual([s["links"]["B"]["lag"] for s in ser], [1, 2, None, None])
            self.assertTrue(any("peer B is no longer a member of job j from round 2" in n
                                for n in run.notes), run.notes)
            drawn, why = report.plot_lag(run, {"A": ser}, f"{d}/lag.png")
            self.assertIsNone(why)
            self.assertEqual([p["lag"] for p in drawn["A->B"]], [1, 2])


class PartialData(unittest.TestCase):
    def test_exit_codes(self):
        with tempfile.TemporaryDirectory() as d:
            self.assertEqual(run_report(d)[0], 1)  # nothing to report
            self.assertEqual(run_report(f"{d}/missing")[0], 2)
            p = subprocess.run([sys.executable, REPORT], capture_output=True)
            self.assertEqual(p.returncode, 2)
            p = subprocess.run([sys.executable, REPORT, "--help"], capture_output=True, text=True)
            self.assertEqual(p.returncode, 0)
            self.assertIn("top-<site>.jsonl", p.stdout)

    def test_missing_files_are_named_and_nothing_is_made_up(self):
        with tempfile.TemporaryDirectory() as d:
            with open(f"{d}/events-A.jsonl", "w") as f:
                f.write(json.dumps({"event": "start", "time": 100, "site": "A", "job": "j"}) + "\n")
                for r in (1, 2):
                    f.write(json.dumps({"event": "round", "time": 100 + r, "round": r, "loss": 3.0 - r,
                                        "tokens_per_s": 50.0}) + "\n")
                    f.write(json.dumps({"event": "validation", "time": 100 + r, "round": r,
                                        "set": "site", "loss": 3.5 - r}) + "\n")
                f.write('{"event": "validation", "time": 1')  # cut short
            with open(f"{d}/top-B.jsonl", "w") as f:
                f.write("")
            rc, out, err = run_report(d)
            self.assertEqual(rc, 0, err)
            self.assertEqual(out.strip().splitlines()[-1], f"report: {d}/report/index.html")
            page = read(f"{d}/report/index.html")
            for note in ("summary.json is missing", "site B: no worker events",
                         "site A: no shard samples", "site B: no shard samples",
                         "events-A.jsonl: 1 line(s) skipped"):
                self.assertIn(note, page.replace("&#x27;", "'"))
            self.assertNotIn("<table>", page)  # no figures without summary.json
            data = json.loads(read(f"{d}/report/report.json"))
            self.assertEqual(sorted(data["plots"][k] or "" for k in data["plots"]),
                             ["", "", "", "training.png", "validation.png"])
            self.assertEqual(data["series"]["validation"]["A/site"],
                             [{"round": 1, "t": 1, "loss": 2.5}, {"round": 2, "t": 2, "loss": 1.5}])
            for png in ("wan-bytes.png", "lag.png", "bandwidth.png"):
                self.assertFalse(os.path.exists(f"{d}/report/{png}"))
                self.assertNotIn(f"src='{png}'", page)


if __name__ == "__main__":
    unittest.main()
