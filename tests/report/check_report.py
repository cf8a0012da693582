#!/usr/bin/python3
"""Holds a run report (deploy/report.py) to the run it came from (tests/report/report_test.sh).

Checks, and fails with the first difference:
  - every plot is a non-empty PNG (signature), loads with matplotlib at a plausible size and
    is not a blank canvas;
  - index.html embeds each plot, and each figure of its table (cells marked with their
    summary.json path) is the summary's value as the report formats it; the figures the
    report must show are there; report.md has the same numbers;
  - the run itself: every round committed on both sites, digests agree;
  - report.json: each link's wire and payload bytes attributed to rounds 1..N, every round
    > 0, the same payload for every round (the deltas are dense) unless the link resent, the rounds plus the bytes sent while no delta went out adding up to the counters of the
    last shard sample (read here from top-<site>.jsonl), and at least the summary's count;
    every site's validation curve has every round of every set, equal to the events file
    (the last evaluation of each round), starting at round 0 with the reference's loss
    before round 1; the table shows both references of every set, and centralised training
    lowered every set's loss.

Usage: check_report.py RUN_DIR REPORT_DIR ROUNDS SET...
"""
import html.parser
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.image as mpimg  # noqa: E402

PLOTS = ["validation.png", "wan-bytes.png", "lag.png", "bandwidth.png", "training.png"]


def fail(msg):
    print(f"FAIL: {msg}")
    sys.exit(1)


class Page(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.images, self.cells, self._key, self._text = [], {}, None, ""

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "img":
            self.images.append(a.get("src"))
        if tag == "td" and "data-key" in a:
            self._key, self._text = a["data-key"], ""

    def handle_data(self, data):
        if self._key is not None:
            self._text += data

    def handle_endtag(self, tag):
        if tag == "td" and self._key is not None:
            self.cells[self._key] = self._text
            self._key = None


def lookup(d, path):
    if path.startswith("sum(sites.*.") and path.endswith(")"):
        field = path[len("sum(sites.*."):-1]
        return sum(site[field] for site in d["sites"].values())
    for part in path.split("."):
        d = d[part]
    return d


def formatted(key, v):
    """How the report writes a summary value (deploy/report.py's fmt_*)."""
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if v is None:
        return "n/a"
    last = key.rsplit(".", 1)[-1]
    if ".val_loss" in key or key.startswith(("reference.before.", "reference.centralised.")):
        return f"{v:.4f}"
    if last in ("wire_ratio", "compression_ratio"):
        return f"{v:.1f}x"
    return f"{v:,}"


def main():
    run, report, rounds, sets = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
    summary = json.load(open(f"{run}/summary.json"))
    sites = sorted(summary["sites"])
    if sites != ["A", "B"]:
        fail(f"summary.json has sites {sites}")
    for s in sites:
        if summary["sites"][s]["committed_round"] != rounds:
            fail(f"site {s} committed {summary['sites'][s]['committed_round']} rounds, not {rounds}")
    if summary["digests_agree"] is not True:
        fail("the sites' committed digests do not agree")

    for p in PLOTS:
        path = f"{report}/{p}"
        with open(path, "rb") as f:
            head = f.read(8)
            f.seek(0, 2)
            size = f.tell()
        if head != b"\x89PNG\r\n\x1a\n":
            fail(f"{p} is not a PNG (starts {head!r})")
        img = mpimg.imread(path)
        h, w = img.shape[:2]
        if h < 300 or w < 600:
            fail(f"{p} is only {w}x{h} pixels")
        if img[..., :3].std() < 0.01:
            fail(f"{p} is a blank canvas")
        print(f"{p}: {size:,} bytes, {w}x{h} pixels")

    page = Page()
    page.feed(open(f"{report}/index.html").read())
    for p in PLOTS:
        if p not in page.images:
            fail(f"index.html does not embed {p} (it embeds {page.images})")
    md = open(f"{report}/report.md").read()
    for p in PLOTS:
        if f"]({p})" not in md:
            fail(f"report.md does not embed {p}")
    needed = ["digests_agree", "rounds", "sum(sites.*.wire_bytes_sent)"]
    for s in sites:
        needed += [f"sites.{s}.committed_round", f"sites.{s}.wire_bytes_sent", f"sites.{s}.wire_ratio",
                   f"sites.{s}.wan_bytes_sent"]
        needed += [f"sites.{s}.val_loss.{d}" for d in sites]
        needed += [f"sites.{s}.val_loss_sets.{n}" for n in sets if n != "site"]
    reference = summary.get("reference")
    if reference is None:
        fail("summary.json has no reference (two-site.sh --reference)")
    for n in sets:
        if n == "site":
            continue
        needed += [f"reference.before.{n}", f"reference.centralised.{n}"]
        if not 0 < reference["centralised"][n] < reference["before"][n]:
            fail(f"centralised training did not lower the loss on {n}: {reference}")
    for k in needed:
        if k not in page.cells:
            fail(f"the report's table lacks {k}")
    for k, text in page.cells.items():
        want = formatted(k, lookup(summary, k))
        if text != want:
            fail(f"the report's table says {text!r} for {k}, summary.json {want!r}")
        if f" {want} " not in md and f" {want}\n" not in md:
            fail(f"report.md lacks {k}'s {want!r}")
    print(f"table: {len(page.cells)} figures, each equal to summary.json's")

    data = json.load(open(f"{report}/report.json"))
    wan = data["series"]["wan-bytes"]
    for s in sites:
        peer = [t for t in sites if t != s][0]
        link = wan.get(f"{s}->{peer}")
        if link is None:
            fail(f"report.json has no link {s}->{peer}")
        last = None
        for line in open(f"{run}/top-{s}.jsonl"):
            if line.strip():
                last = json.loads(line)
        counters = {"wire": 0, "payload": 0}
        for sh in last["shards"]:
            for l in sh["sync"]["links"]:
                if l["site"] == peer:
                    counters["wire"] += l["wire_bytes_sent"]
                    counters["payload"] += l["bytes_sent"]
        for kind in ("wire", "payload"):
            per = {int(r): v for r, v in link[kind].items()}
            if sorted(per) != list(range(1, rounds + 1)):
                fail(f"{s}->{peer} {kind} bytes are attributed to rounds {sorted(per)}")
            if min(per.values()) <= 0:
                fail(f"{s}->{peer}: a round with no {kind} bytes: {per}")
            total = sum(per.values()) + link[f"{kind}_no_delta_sent"]
            if abs(total - counters[kind]) > 0.5 or abs(link[f"{kind}_total"] - counters[kind]) > 0.5:
                fail(f"{s}->{peer} {kind}: rounds + after = {total}, the last sample says {counters[kind]}")
        # The run's deltas are dense, the same size every round: unless a link resent some
        # (a reconnect), each round's attributed payload is one round's share of the total.
        resends = sum(l["resends"] for sh in last["shards"] for l in sh["sync"]["links"])
        per = {int(r): v for r, v in link["payload"].items()}
        mean = sum(per.values()) / len(per)
        if resends == 0 and any(abs(v - mean) > 0.1 * mean for v in per.values()):
            fail(f"{s}->{peer}: payload per round {per} is not one equal delta per round")
        if counters["wire"] < summary["sites"][s]["wire_bytes_sent"]:
            fail(f"{s}: the last top sample counts {counters['wire']} wire bytes, fewer than the "
                 f"summary's {summary['sites'][s]['wire_bytes_sent']}")
        if counters["payload"] >= counters["wire"]:
            fail(f"{s}->{peer}: payload {counters['payload']} not below wire {counters['wire']}")
        print(f"{s}->{peer}: wire per round {[round(per) for per in map(float, link['wire'].values())]}")

    val = data["series"]["validation"]
    for s in sites:
        events = [json.loads(l) for l in open(f"{run}/events-{s}.jsonl") if l.strip()]
        for n in sets:
            got = val.get(f"{s}/{n}")
            last = {e["round"]: e["loss"] for e in events if e["event"] == "validation" and e["set"] == n}
            want = sorted(last.items())  # the last evaluation of each round (the report's rule)
            if n in reference["before"]:  # round 0: the loss before round 1
                want = [(0, reference["before"][n])] + want
            if not got or [(p["round"], p["loss"]) for p in got] != want:
                fail(f"validation curve {s}/{n} is {got}, the events say {want}")
            if [r for r, _ in want if r > 0] != list(range(1, rounds + 1)):
                fail(f"site {s} evaluated {n} after rounds {[r for r, _ in want]}")
    for k in ("lag", "bandwidth", "training"):
        if not data["series"].get(k):
            fail(f"report.json has no {k} series")
    if data["not_drawn"]:
        fail(f"plots not drawn: {data['not_drawn']}")
    print("report: every check passed")


if __name__ == "__main__":
    main()
