#!/usr/bin/python3
"""The run report of a two-site training: PNG plots and a one-page summary embedding them.

Reads a run folder as deploy/two-site.sh leaves it (its --out), every file optional:
  summary.json            the run's final figures (two-site.sh: committed rounds, final
                          validation losses, wire and payload bytes, digests agree)
  events-<site>.jsonl     rank 0's `isthmus-worker train --events` (rounds, validations)
  top-<site>.jsonl        `isthmusctl top --json` of the site's shards (committed rounds,
                          per link wire and payload counters, lag, bandwidth, codecs)
  worker-<site>-0.json    rank 0's `isthmus-worker train --json-summary`
and writes into --out (default RUN/report):
  validation.png  validation loss per site and set against rounds and against wall time
  wan-bytes.png   wire bytes (and payload bytes) each site sent each peer, per round
  lag.png         lag in rounds per link over time, and the sites' local/committed rounds
  bandwidth.png   each shard link's bandwidth estimate over time, and its codec pipelines
  training.png    mean training loss and tokens/s per round per site
  chrf.png        with translation sets (isthmus-worker train --translate-set): chrF of
                  each site's translations per language by round (NLTK's chrF, as
                  deploy/chrf.py), drawn only when the events name translations
  index.html, report.md   the page: the run's figures, each plot with how to read it, and
                          what was missing
  report.json     the series drawn (per-round bytes per link, ...) for scripts
A plot whose data is missing is not drawn; the page says which file or site lacked it.

Usage: deploy/report.py --run DIR [--out DIR] [--job NAME]
Exit codes: 0 report written, 1 nothing to report (none of the files above), 2 bad usage.
"""
import argparse
import glob
import html
import json
import math
import os
import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 (after the backend is chosen)
from matplotlib.ticker import FuncFormatter, MaxNLocator  # noqa: E402

THOUSANDS = FuncFormatter(lambda v, _: f"{v:,.0f}")

STYLES = ["-", "--", ":", "-."]


def read_jsonl(path, notes):
    """The objects of a JSON Lines file; lines that do not parse (a line cut short when its
    writer was stopped) or carry no time are skipped and counted in the notes."""
    rows, bad = [], 0
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                row = None
            if isinstance(row, dict) and isinstance(row.get("time"), (int, float)):
                rows.append(row)
            else:
                bad += 1
    if bad:
        notes.append(f"{os.path.basename(path)}: {bad} line(s) skipped (not JSON, or no time)")
    return rows


def read_json(path, notes):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        notes.append(f"{os.path.basename(path)} could not be read: {e}")
        return None


def site_of(path, prefix):
    return os.path.basename(path)[len(prefix):].rsplit(".", 1)[0]


class Run:
    """What the run folder holds, and what it lacks (notes)."""

    def __init__(self, folder, job):
        self.folder, self.notes = folder, []
        p = os.path.join(folder, "summary.json")
        self.summary = read_json(p, self.notes) if os.path.exists(p) else None
        if self.summary is None and not os.path.exists(p):
            self.notes.append("summary.json is missing: no final figures (two-site.sh writes it "
                              "after the last round has committed)")
        self.events = {site_of(p, "events-"): read_jsonl(p, self.notes)
                       for p in sorted(glob.glob(os.path.join(folder, "events-*.jsonl")))}
        self.top = {site_of(p, "top-"): read_jsonl(p, self.notes)
                    for p in sorted(glob.glob(os.path.join(folder, "top-*.jsonl")))}
        self.workers = {}
        for p in sorted(glob.glob(os.path.join(folder, "worker-*-0.json"))):
            w = read_json(p, self.notes)
            if w is not None:
                self.workers[site_of(p, "worker-")[:-2]] = w
        names = set(self.events) | set(self.top) | set(self.workers)
        if self.summary:
            names |= set(self.summary.get("sites", {}))
        self.sites = sorted(names)
        for s in self.sites:
            if not self.events.get(s):
                self.notes.append(f"site {s}: no worker events (events-{s}.jsonl missing or empty; "
                                  "isthmus-worker train --events)")
            if not self.top.get(s):
                self.notes.append(f"site {s}: no shard samples (top-{s}.jsonl missing or empty; "
                                  "isthmusctl top --json)")
        self.job = job or self._job()
        starts = [e["time"] for ev in self.events.values() for e in ev if e.get("event") == "start"]
        samples = [t["time"] for tp in self.top.values() for t in tp]
        # Wall time is counted from the first worker start (the training's start); without
        # events, from the first shard sample.
        self.t0 = min(starts) if starts else (min(samples) if samples else 0.0)
        self.t0_what = "the first worker's start" if starts else "the first shard sample"

    def empty(self):
        return (self.summary is None and not any(self.events.values())
                and not any(self.top.values()) and not self.workers)

    def _job(self):
        for ev in self.events.values():
            for e in ev:
                if e.get("event") == "start" and e.get("job"):
                    return e["job"]
        jobs = sorted({j["job"] for tp in self.top.values() for t in tp for sh in t.get("shards", [])
                       for j in ((sh.get("sync") or {}).get("jobs") or [])})
        if len(jobs) > 1:
            self.notes.append(f"the shards hold several jobs ({', '.join(jobs)}): "
                              f"reporting {jobs[0]} (--job to choose)")
        return jobs[0] if jobs else None


# ---- series from the shard samples (top-<site>.jsonl) ----

def job_row(sync, job):
    return next((j for j in (sync or {}).get("jobs") or [] if j.get("job") == job), None)


def removed_round(row, peer):
    """The first round `peer` no longer merges into the job of `row` (it left or was removed;
    its link may stay configured, carrying nothing), or None while it is a member."""
    if not row or peer in (row.get("members") or []):
        return None
    return (row.get("removed") or {}).get(peer)


def site_series(run, site):
    """Per sample of the site: time, rounds (min over shards; None unless every shard
    answered), per peer the wire/payload counters of every shard, the worst lag (none for a
    peer removed from the job: its lag would only grow), each shard link's bandwidth, the
    site's wire send rate, and each shard's pipelines."""
    out, silent, removed = [], {}, {}
    for t in run.top.get(site, []):
        shards = t.get("shards") or []
        answered = [sh for sh in shards if sh.get("reachable") and sh.get("sync")]
        for sh in shards:
            if sh not in answered:
                silent[sh.get("shard")] = silent.get(sh.get("shard"), 0) + 1
        rows = [job_row(sh["sync"], run.job) for sh in answered]
        complete = bool(shards) and len(answered) == len(shards) and all(rows)
        smp = {"t": t["time"] - run.t0,
               "committed": min(r["committed_round"] for r in rows) if complete else None,
               "local": min(r["local_round"] for r in rows) if complete else None,
               "links": {}, "pipelines": {}}
        for sh in answered:
            idx = sh.get("shard")
            r = job_row(sh["sync"], run.job)
            if r is not None:
                smp["pipelines"][idx] = r.get("pipelines") or {}
            rate_links = (sh.get("rates") or {}).get("links") or {}
            for link in sh["sync"].get("links") or []:
                peer = link["site"]
                d = smp["links"].setdefault(peer, {"wire": {}, "payload": {}, "raw": {}, "lag": None,
                                                   "acked": {}, "outbox": {}, "deltas_sent": {},
                                                   "resends": {}, "bandwidth": {},
                                                   "rate": 0.0, "rate_known": complete})
                d["wire"][idx] = link.get("wire_bytes_sent", 0)
                d["payload"][idx] = link.get("bytes_sent", 0)
                d["raw"][idx] = link.get("raw_bytes_sent", 0)
                d["deltas_sent"][idx] = link.get("deltas_sent", 0)
                d["resends"][idx] = link.get("resends", 0)
                lj = [j for j in link.get("jobs") or [] if j.get("job") == run.job]
                if lj:
                    d["acked"][idx], d["outbox"][idx] = lj[0]["acked_round"], lj[0]["outbox_round"]
                lags = [j["lag_rounds"] for j in lj]
                gone = removed_round(r, peer)
                if gone is not None:
                    removed.setdefault(peer, (gone, smp["t"]))
                    lags = []
                if lags:
                    d["lag"] = max(lags + ([d["lag"]] if d["lag"] is not None else []))
                bw = link.get("bandwidth_bps") or 0
                d["bandwidth"][idx] = bw if bw > 0 else None  # 0: not measured yet
                r_ = (rate_links.get(peer) or {}).get("wire_sent_bytes_per_s")
                if r_ is None:
                    d["rate_known"] = False
                else:
                    d["rate"] += r_
        out.append(smp)
    for peer, (gone, t) in sorted(removed.items()):
        run.notes.append(f"site {site}: peer {peer} is no longer a member of job {run.job} from "
                         f"round {gone} (first seen at {t:.0f} s): its link's lag is not drawn "
                         "from then on")
    for idx, n in sorted(silent.items(), key=lambda kv: str(kv[0])):
        run.notes.append(f"site {site}: shard {idx} did not answer in {n} of {len(out)} samples "
                         "(no rounds for the site then; its bytes are counted when it answers again)")
    return out


def per_round_bytes(series, peer, counter):
    """Bytes of `counter` ("wire" or "payload") sent to `peer`, attributed to the job's
    rounds. Per shard and per pair of consecutive samples, the counter's increase goes to
    the rounds whose deltas the link transmitted in between: a link sends its outbox in
    round order, so the deltas_sent counter's increase n names the next n rounds after the
    last one sent, capped at the highest round in the outbox (after a reconnect, counted by
    resends, or a restart it sends everything above what the peer holds again: the last n
    rounds up to the outbox's, none at or below the round acknowledged before); the
    increase is split evenly among them. An interval in which no delta went out (handshakes,
    keep-alives, acks of the peer's rounds) is counted apart. A counter that went down
    belongs to a restarted shard and counts from zero. deltas_sent counts every job's
    deltas: with several jobs on a link this is approximate.
    Returns ({round: bytes}, bytes sent with no delta going out, total)."""
    rounds, other, total, last = {}, 0.0, 0.0, {}
    for smp in series:
        d = smp["links"].get(peer)
        if not d:
            continue
        for idx, v in d[counter].items():
            prev_v, prev_acked, prev_n, prev_res, sent = last.get(idx, (None, 0, 0, 0, 0))
            n, res = d["deltas_sent"].get(idx, prev_n), d["resends"].get(idx, prev_res)
            restarted = prev_v is not None and (v < prev_v or n < prev_n)
            inc = v if prev_v is None or restarted else v - prev_v
            dn = n if restarted else n - prev_n
            acked = d["acked"].get(idx, prev_acked)
            outbox = d["outbox"].get(idx, 0)
            if restarted or res > prev_res:  # it resent everything above what the peer held
                first = max(prev_acked + 1, outbox - dn + 1)
            else:
                first = sent + 1
            to = range(first, min(first + dn, outbox + 1)) if dn > 0 else range(0)
            if dn > 0 and not len(to):  # more deltas than rounds we know of: the unacked ones
                to = range(prev_acked + 1, outbox + 1)
            total += inc
            if len(to):
                for r in to:
                    rounds[r] = rounds.get(r, 0.0) + inc / len(to)
                sent = max(sent, to[-1])
            else:
                other += inc
            last[idx] = (v, acked, n, res, sent)
    return rounds, other, total


def peers_of(series):
    return sorted({p for smp in series for p in smp["links"]})


# ---- plots ----

def save(fig, path):
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_by_round_and_time(run, path, lines, levels, xlabel, ylabel, title):
    """Two panels sharing the y axis: each line's points (round, t, y) by round on the left
    and by wall time on the right; lines are (points, style, colour, label) and levels
    (y, colour, label) dotted horizontal references on both (labelled once)."""
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    for pts, style, colour, label in lines:
        for a, x in ((a1, 0), (a2, 1)):
            a.plot([p[x] for p in pts], [p[2] for p in pts], style, marker="o", ms=3,
                   color=colour, label=label)
    for y, colour, label in levels:
        for a in (a1, a2):
            a.axhline(y, color=colour, linestyle=":", linewidth=1.6, alpha=0.9,
                      label=label if a is a2 else None)
    a1.set_xlabel(xlabel)
    a1.xaxis.set_major_locator(MaxNLocator(integer=True))
    a2.set_xlabel(f"wall time, s since {run.t0_what}")
    a1.set_ylabel(ylabel)
    a1.set_title(title)
    a2.set_title("... and by wall time")
    for a in (a1, a2):
        a.grid(True, alpha=0.3)
    a2.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    save(fig, path)


def plot_validation(run, path):
    # (site, set) -> [(round, t, loss)]. A round may have several: the site's own set is
    # also validated every --val-every steps (labelled with the round in progress, on the
    # local model) and once at the end (the last round again); the evaluation after the
    # round's pull comes after the former, so the last one per round is the one kept.
    last = {}
    for s in run.sites:
        for e in run.events.get(s, []):
            if (e.get("event") == "validation" and e.get("loss") is not None
                    and e.get("round") is not None and e.get("set")):
                last[(s, e["set"], e["round"])] = (e["time"] - run.t0, e["loss"])
    series = {}
    for (s, name, r), (t, loss) in sorted(last.items()):
        series.setdefault((s, name), []).append((r, t, loss))
    # The references (summary.json "reference", two-site.sh --reference): the loss before
    # round 1 starts each set's line at round 0; centralised training is a dotted level.
    reference = (run.summary or {}).get("reference") or {}
    before, central = reference.get("before") or {}, reference.get("centralised") or {}
    for (s, name), pts in series.items():
        if name in before and pts and pts[0][0] > 0:
            pts.insert(0, (0, 0.0, before[name]))
    if not series:
        return None, ("no validation events: the workers evaluated no round "
                      "(isthmus-worker train --eval-every-rounds N, two-site.sh --eval-every-rounds)")
    # One colour per data set: "site" is a different set at each site (its own data).
    colour_of = sorted({f"site {s}" if n == "site" else n for s, n in series},
                       key=lambda n: (not n.startswith("site "), n))
    lines = []
    for (s, name), pts in sorted(series.items(), key=lambda kv: (kv[0][0], kv[0][1] != "site", kv[0][1])):
        colour = f"C{colour_of.index(f'site {s}' if name == 'site' else name) % 10}"
        style = STYLES[run.sites.index(s) % len(STYLES)]
        lines.append((pts, style, colour,
                      f"{s}: {'own validation data' if name == 'site' else name}"))
    levels = [(loss, f"C{colour_of.index(name) % 10}", f"centralised: {name}")
              for name, loss in sorted(central.items()) if name in colour_of]
    plot_by_round_and_time(
        run, path, lines, levels,
        "round (after its pull: the merged model; 0: before round 1)" if before
        else "round (after its pull: the merged model)",
        "validation loss (nats per token)", "Validation loss per site and set, by round")
    return {f"{s}/{n}": [{"round": p[0], "t": p[1], "loss": p[2]} for p in pts]
            for (s, n), pts in series.items()}, None


def translation_files(run):
    """(site, language) -> [(round, t, path)] of the workers' translations events; a path
    that is not found as written is looked for beside the run's events files."""
    out = {}
    for s in run.sites:
        for e in run.events.get(s, []):
            if e.get("event") != "translations" or not e.get("file"):
                continue
            f = e["file"]
            if not os.path.exists(f):
                f = os.path.join(run.folder, os.path.basename(os.path.dirname(f)),
                                 os.path.basename(f))
            out.setdefault((s, e.get("language", "?")), []).append(
                (e.get("round"), e["time"] - run.t0, f))
    return out


def plot_chrf(run, path):
    try:
        from nltk.translate.chrf_score import corpus_chrf
    except ImportError:
        return None, "NLTK is missing (apt-get install python3-nltk): chrF cannot be computed"
    series = {}
    for (s, lang), files in sorted(translation_files(run).items()):
        for r, t, f in files:
            try:
                rows = [json.loads(line) for line in open(f, encoding="utf-8") if line.strip()]
            except (OSError, ValueError) as e:
                run.notes.append(f"site {s}: translations {f} unreadable: {e}")
                continue
            rows = [x for x in rows if isinstance(x.get("reference"), str)]
            if rows:
                score = 100.0 * corpus_chrf([x["reference"] for x in rows],
                                            [x.get("translation", "") for x in rows])
                series.setdefault((s, lang), []).append((r, t, score))
    if not series:
        return None, "no readable translations with references"
    langs = sorted({lang for _, lang in series})
    lines = []
    for (s, lang), pts in sorted(series.items()):
        pts.sort()
        lines.append((pts, STYLES[run.sites.index(s) % len(STYLES)],
                      f"C{langs.index(lang) % 10}", f"{s}: en->{lang}"))
    plot_by_round_and_time(run, path, lines, [], "round (after its pull: the merged model)",
                           "chrF (character 1-6-grams, beta 3) x 100",
                           "chrF of held-out translations per site and language, by round")
    return {f"{s}/{lang}": [{"round": p[0], "t": p[1], "chrf": p[2]} for p in pts]
            for (s, lang), pts in series.items()}, None


def plot_wan_bytes(run, series, path):
    links = [(s, p) for s in run.sites for p in peers_of(series.get(s, []))]
    data = {}
    for s, p in links:
        wire, wire_other, wire_total = per_round_bytes(series[s], p, "wire")
        pay, pay_other, pay_total = per_round_bytes(series[s], p, "payload")
        data[f"{s}->{p}"] = {"wire": wire, "payload": pay, "wire_no_delta_sent": wire_other,
                             "payload_no_delta_sent": pay_other, "wire_total": wire_total,
                             "payload_total": pay_total}
    rounds = sorted({r for d in data.values() for r in d["wire"]})
    if not rounds:
        return data, ("no delta was sent in the shard samples (top-<site>.jsonl): "
                      "nothing to attribute bytes to")
    fig, ax = plt.subplots(figsize=(13, 5))
    n = len(data)
    width = 0.8 / (2 * n)
    for i, (name, d) in enumerate(data.items()):
        xs = [r - 0.4 + width * (2 * i + 0.5) for r in rounds]
        ax.bar(xs, [d["wire"].get(r, 0) for r in rounds], width, color=f"C{i}",
               label=f"{name}: wire ({d['wire_total']:,.0f} B in all, "
                     f"{d['wire_no_delta_sent']:,.0f} B while no delta went out)")
        ax.bar([x + width for x in xs], [d["payload"].get(r, 0) for r in rounds], width,
               color=f"C{i}", alpha=0.45, hatch="//",
               label=f"{name}: payload ({d['payload_total']:,.0f} B in all)")
    ax.set_xticks(rounds)
    ax.set_xlabel("round (the bytes a link sent in the sample intervals in which it transmitted "
                  "the round's delta)")
    ax.set_ylabel("bytes sent to the peer (all shards)")
    ax.yaxis.set_major_formatter(THOUSANDS)
    ax.set_title("WAN bytes per round per link: wire (every message, framing, CURVE, handshakes) "
                 "and payload (encoded deltas)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    save(fig, path)
    return data, None


def plot_lag(run, series, path):
    drawn = {}
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(13, 7), sharex=True)
    i = 0
    for s in run.sites:
        for p in peers_of(series.get(s, [])):
            pts = [(smp["t"], smp["links"][p]["lag"]) for smp in series[s]
                   if p in smp["links"] and smp["links"][p]["lag"] is not None]
            if pts:
                a1.step([x for x, _ in pts], [y for _, y in pts], where="post", color=f"C{i}",
                        label=f"{s}->{p}")
                drawn[f"{s}->{p}"] = [{"t": x, "lag": y} for x, y in pts]
            i += 1
    for k, s in enumerate(run.sites):
        for key, style in (("local", "--"), ("committed", "-")):
            pts = [(smp["t"], smp[key]) for smp in series.get(s, []) if smp[key] is not None]
            if pts:
                a2.step([x for x, _ in pts], [y for _, y in pts], style, where="post",
                        color=f"C{k}", label=f"{s} {key}")
    if not drawn:
        plt.close(fig)
        return drawn, "no link lag in the shard samples (top-<site>.jsonl)"
    a1.set_ylabel("lag, rounds")
    a1.set_title("Lag per link: this site's highest round minus the round the peer acknowledged "
                 "(worst shard)")
    a2.set_ylabel("round")
    a2.set_title("Rounds per site: closed locally (dashed) and committed (solid), "
                 "lowest over the site's shards")
    a2.set_xlabel(f"wall time, s since {run.t0_what}")
    for a in (a1, a2):
        a.grid(True, alpha=0.3)
        a.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    a1.yaxis.get_major_locator().set_params(integer=True)
    a2.yaxis.get_major_locator().set_params(integer=True)
    save(fig, path)
    return drawn, None


def pipeline_label(p):
    return " | ".join(f"{k} ({v} tensors)" for k, v in sorted(p.items())) if p else ""


def plot_bandwidth(run, series, path):
    bw, codec = {}, {}
    for s in run.sites:
        for smp in series.get(s, []):
            for p, d in smp["links"].items():
                for idx, v in d["bandwidth"].items():
                    bw.setdefault(f"{s}/{idx}->{p}", []).append((smp["t"], v))
            for idx, pl in smp["pipelines"].items():
                codec.setdefault(f"{s}/{idx}", []).append((smp["t"], pipeline_label(pl)))
    measured = any(v is not None for pts in bw.values() for _, v in pts)
    if not bw and not codec:
        return {"bandwidth": bw, "codec": codec}, "no peer link or codec in the shard samples (top-<site>.jsonl)"
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(13, 7), sharex=True,
                                 gridspec_kw={"height_ratios": [3, 1.4]})
    for i, (name, pts) in enumerate(sorted(bw.items())):
        if all(v is None for _, v in pts):
            continue  # never measured: no line, no legend entry
        a1.plot([t for t, _ in pts], [v if v is not None else math.nan for _, v in pts],
                color=f"C{i}", marker=".", ms=3, label=f"{name} estimate")
    k = len(bw)
    for s in run.sites:
        for p in peers_of(series.get(s, [])):
            pts = [(smp["t"], smp["links"][p]["rate"]) for smp in series[s]
                   if p in smp["links"] and smp["links"][p]["rate_known"]]
            if pts:
                a1.plot([t for t, _ in pts], [v if v > 0 else math.nan for _, v in pts], ":",
                        marker=".", ms=3, color=f"C{k % 10}",
                        label=f"{s}->{p} wire sent per s, all shards (gaps: nothing sent)")
            k += 1
    if not measured:
        a1.text(0.5, 0.5, "no bandwidth estimate on any link: a link measures one from the acks\n"
                "of deltas large enough (small compressed deltas give none)",
                transform=a1.transAxes, ha="center", va="center", color="0.3")
    a1.set_yscale("log")
    a1.set_ylabel("bytes per second")
    a1.set_title("Bandwidth estimate per shard link (from acks; gaps: not measured yet) "
                 "and the wire bytes sent per second")
    a1.grid(True, which="both", alpha=0.3)
    a1.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    labels = sorted({lab for pts in codec.values() for _, lab in pts if lab})
    steps = sorted(b[0] - a[0] for pts in codec.values() for a, b in zip(pts, pts[1:]))
    step = steps[len(steps) // 2] if steps else 1.0
    rows = sorted(codec)
    for y, name in enumerate(rows):
        pts = codec[name]
        for j, (t, lab) in enumerate(pts):
            if not lab:
                continue
            end = pts[j + 1][0] if j + 1 < len(pts) else t + step
            a2.broken_barh([(t, end - t)], (y - 0.4, 0.8), color=f"C{labels.index(lab) % 10}")
    for i, lab in enumerate(labels):
        a2.bar(0, 0, color=f"C{i % 10}", label=lab)  # legend entries only
    a2.set_yticks(range(len(rows)))
    a2.set_yticklabels(rows)
    a2.set_ylim(-0.6, len(rows) - 0.4)
    a2.set_title("Codec pipelines of the last round each shard closed (blank: none closed yet)")
    a2.set_xlabel(f"wall time, s since {run.t0_what}")
    if labels:
        a2.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    save(fig, path)
    changes = {n: sum(1 for a, b in zip(p, p[1:]) if a[1] and b[1] and a[1] != b[1])
               for n, p in codec.items()}
    if not measured:
        run.notes.append("no peer link had a bandwidth estimate: bandwidth.png shows the codecs "
                         "and the wire rates only")
    return {"bandwidth": bw, "codec": codec, "codec_changes": changes, "pipelines": labels,
            "measured": measured}, None


def plot_training(run, path):
    per = {s: [e for e in run.events.get(s, []) if e.get("event") == "round" and e.get("round") is not None]
           for s in run.sites}
    per = {s: v for s, v in per.items() if v}
    if not per:
        return None, "no round events: no training loss or tokens/s to draw"
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.5))
    for k, (s, ev) in enumerate(per.items()):
        pts = [(e["round"], e["loss"]) for e in ev if e.get("loss") is not None]
        a1.plot([r for r, _ in pts], [v for _, v in pts], marker="o", ms=3, color=f"C{k}", label=s)
        a2.plot([e["round"] for e in ev], [e.get("tokens_per_s") or math.nan for e in ev],
                marker="o", ms=3, color=f"C{k}", label=s)
    a1.set_title("Mean training loss of the round (site's own batches)")
    a2.set_title("Tokens per second of compute (round tokens / compute seconds)")
    for a in (a1, a2):
        a.set_xlabel("round")
        a.xaxis.set_major_locator(MaxNLocator(integer=True))
        a.grid(True, alpha=0.3)
        a.legend(fontsize=8)
    save(fig, path)
    return {s: [{"round": e["round"], "loss": e.get("loss"), "tokens_per_s": e.get("tokens_per_s"),
                 "wall_s": e.get("wall_s"), "wan_wait_s": e.get("wan_wait_s")} for e in ev]
            for s, ev in per.items()}, None


# ---- the page ----

def fmt_int(v):
    return f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else "n/a"


def fmt_loss(v):
    return f"{v:.4f}" if isinstance(v, (int, float)) and not isinstance(v, bool) else "n/a"


def fmt_ratio(v):
    return f"{v:.1f}x" if isinstance(v, (int, float)) and not isinstance(v, bool) and v else "n/a"


def fmt_yes(v):
    return {True: "yes", False: "NO"}.get(v, "n/a")


def table_rows(run):
    """(label, [(data-key, text)]) rows of the figures table; data-key is the value's path
    in summary.json (or sum(PATH) over the sites), so that a script can hold the page to
    the file."""
    s = run.summary or {}
    sites = s.get("sites", {})
    names = sorted(sites)
    rows = [("rounds committed", [(f"sites.{n}.committed_round", fmt_int(sites[n].get("committed_round")))
                                  for n in names])]
    evals = sorted({d for n in names for d in (sites[n].get("val_loss") or {})})
    for d in evals:
        rows.append((f"final val loss, committed model, on site {d}'s data",
                     [(f"sites.{n}.val_loss.{d}", fmt_loss((sites[n].get("val_loss") or {}).get(d)))
                      for n in names]))
    sets = sorted({d for n in names for d in (sites[n].get("val_loss_sets") or {})})
    for d in sets:
        rows.append((f"final val loss, committed model, on {d}",
                     [(f"sites.{n}.val_loss_sets.{d}",
                       fmt_loss((sites[n].get("val_loss_sets") or {}).get(d))) for n in names]))
    for key, label, f in (("wire_bytes_sent", "wire bytes sent", fmt_int),
                          ("wire_bytes_received", "wire bytes received", fmt_int),
                          ("wire_ratio", "wire ratio (fp32 delta bytes / wire bytes)", fmt_ratio),
                          ("wan_bytes_sent", "payload bytes sent (encoded deltas)", fmt_int),
                          ("compression_ratio", "payload ratio (fp32 / encoded)", fmt_ratio)):
        rows.append((label, [(f"sites.{n}.{key}", f(sites[n].get(key))) for n in names]))
    return names, rows


def run_rows(run):
    s = run.summary or {}
    wire = [v.get("wire_bytes_sent") for v in s.get("sites", {}).values()]
    total = sum(wire) if wire and all(isinstance(v, int) for v in wire) else None
    rows = [("rounds asked", "rounds", fmt_int(s.get("rounds"))),
            ("wire bytes sent, all sites together", "sum(sites.*.wire_bytes_sent)", fmt_int(total)),
            ("training wall time, s", "train_seconds", fmt_int(s.get("train_seconds"))),
            ("committed digests agree across sites", "digests_agree", fmt_yes(s.get("digests_agree"))),
            ("rounds compared per shard", "rounds_verified", fmt_int(s.get("rounds_verified")))]
    if "kernel_wan_bytes" in s:
        rows.append(("WAN bytes the kernel counted (veth, both directions)", "kernel_wan_bytes",
                     fmt_int(s.get("kernel_wan_bytes"))))
    ref = s.get("reference") or {}
    for d in sorted(ref.get("before") or {}):
        rows.append((f"val loss on {d} before round 1 (the starting model)", f"reference.before.{d}",
                     fmt_loss(ref["before"][d])))
    for d in sorted(ref.get("centralised") or {}):
        rows.append((f"val loss on {d}, centralised training on every site's data, same tokens "
                     f"({fmt_int(ref.get('centralised_steps'))} steps of batch "
                     f"{fmt_int(ref.get('centralised_batch'))})", f"reference.centralised.{d}",
                     fmt_loss(ref["centralised"][d])))
    return rows


READ = {
    "validation": ("Validation loss", "Each line is one site's model after the pull of a round "
                   "(the merged model: committed state plus the uncommitted deltas it knew of) "
                   "evaluated on one set: 'own validation data' is the site's validation split, the "
                   "others are the --eval-set sets (e.g. one per language); one colour per set, one "
                   "line style per site. Left by round, right by wall time; where a round was "
                   "evaluated twice (the final validation repeats the last round's) the last value "
                   "is drawn. Lines of both sites that fall together on a set only one site trains "
                   "on show the exchange carrying what that site learns across. When the run has "
                   "references (deploy/demo.sh measures them), round 0 is the loss before round 1 "
                   "and a dotted level per set is centralised training for the same tokens: what "
                   "the rounds gained, and how far they are from training in one place. The "
                   "per-round points use the workers' --val-batches, the table's final figures "
                   "and references --eval-batches, so the last point and the table can differ a "
                   "little."),
    "wan-bytes": ("WAN bytes per round", "Bars per round and link (sender->peer, all shards "
                  "together): solid the wire bytes, hatched the encoded delta payload within "
                  "them. {attribution} The gap between a pair of bars is the protocol's cost "
                  "(headers, acks, keep-alives, encryption)."),
    "lag": ("Lag", "Top: per link, how many rounds this site is ahead of what the peer "
            "acknowledged (the worst shard); it rises while a round's delta is in flight and "
            "falls to 0 when the peer has it. A lag that keeps growing is a link too slow for "
            "the codec. A peer removed from the job (or that left it) is drawn until then "
            "only: its link stays configured but carries nothing, and the page's notes say "
            "from which round. Bottom: each site's rounds closed locally (dashed) and committed "
            "(solid); the gap between them is bounded staleness at work."),
    "bandwidth": ("Bandwidth and codec", "Top: each shard link's bandwidth estimate (from the "
                  "acks of the deltas it sent; it drives adaptive compression) on a log scale, "
                  "and, dotted, the wire bytes per second the site actually sent the peer. "
                  "Bottom: the codec pipelines each shard used for the last round it closed, "
                  "one colour per pipeline mix; a change of colour is the adaptive codec "
                  "changing its choice."),
    "chrf": ("Translation quality (chrF)", "Each line is one site's model after the pull of a "
             "round translating the first held-out pairs of one language (isthmus-worker train "
             "--translate-set, greedy), scored with NLTK's chrF against the references: one "
             "colour per language, one line style per site. A language only one site trains on "
             "rising at the other site too is what the exchange of rounds carries across."),
    "training": ("Training", "Mean training loss of each round on the site's own batches "
                 "(left) and the site's training throughput (right: tokens of the round per "
                 "second of compute, WAN waits excluded)."),
}

ATTRIBUTION = ("Bytes are attributed to rounds from the shard samples (isthmusctl top, one "
               "per {interval}): for each shard link and each pair of consecutive samples, the "
               "increase of its wire (and payload) counter goes to the rounds whose deltas it "
               "transmitted in between (a link sends its outbox in round order, so the count of "
               "deltas sent names them; after a reconnect it resends from the peer's "
               "acknowledged round), and the shards' shares are added up. Rounds sent in one "
               "interval share its bytes evenly: the attribution is only as fine as the "
               "samples. What a link sent in intervals with no delta (handshakes, keep-alives, "
               "acks of the peer's rounds) is not in the bars; the legend gives it.")


def write_page(run, out, plots, data):
    names, rows = table_rows(run)
    intervals = sorted({t.get("interval_s") for tp in run.top.values() for t in tp if t.get("interval_s")})
    interval = " or ".join(f"{i:g} s" for i in intervals) or "refresh"
    title = f"isthmus run report: {os.path.basename(os.path.abspath(run.folder))}"
    h = [f"<!doctype html>\n<html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
         "<style>body{font-family:sans-serif;max-width:1100px;margin:1em auto;padding:0 1em}"
         "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}"
         "td:first-child,th:first-child{text-align:left}img{max-width:100%;border:1px solid #eee}"
         ".note{color:#a40}</style></head><body>", f"<h1>{html.escape(title)}</h1>"]
    md = [f"# {title}", ""]
    job = f"job {html.escape(run.job)}" if run.job else "no job named in the files"
    figures = ("Figures from summary.json (the run's final state, once every round had "
               "committed)." if run.summary is not None else
               "No final figures: summary.json is missing or unreadable.")
    h.append(f"<p>Sites {html.escape(', '.join(run.sites)) or 'none'}; {job}. {figures}</p>")
    md.append(f"Sites {', '.join(run.sites) or 'none'}; job {run.job or 'n/a'}. {figures}")
    md.append("")
    if run.summary is not None:
        h.append("<h2>Figures</h2><table><tr><th></th>" +
                 "".join(f"<th>site {html.escape(n)}</th>" for n in names) + "</tr>")
        md += ["| | " + " | ".join(f"site {n}" for n in names) + " |",
               "|---|" + "---:|" * len(names)]
        for label, cells in rows:
            h.append(f"<tr><td>{html.escape(label)}</td>" + "".join(
                f"<td data-key='{html.escape(k)}'>{html.escape(v)}</td>" for k, v in cells) + "</tr>")
            md.append(f"| {label} | " + " | ".join(v for _, v in cells) + " |")
        h.append("</table><table style='margin-top:.6em'>")
        md.append("")
        for label, k, v in run_rows(run):
            h.append(f"<tr><td>{html.escape(label)}</td><td data-key='{k}'>{html.escape(v)}</td></tr>")
            md.append(f"- {label}: {v}")
        h.append("</table>")
        md.append("")
    for key, png in plots.items():
        head, text = READ[key]
        text = text.format(attribution=ATTRIBUTION.format(interval=interval))
        h.append(f"<h2>{html.escape(head)}</h2>")
        md.append(f"## {head}")
        md.append("")
        if key == "training" and run.workers:
            text += " Rank 0's own summary (--json-summary): " + "; ".join(
                f"{s} {w.get('rounds')} rounds, {w.get('steps')} steps, {fmt_int(w.get('tokens'))} "
                f"tokens in {w.get('seconds') or 0:.1f} s, {w.get('tokens_per_s') or 0:,.0f} tokens/s"
                for s, w in sorted(run.workers.items())) + "."
        if png:
            h.append(f"<p>{html.escape(text)}</p><img src='{png}' alt='{html.escape(head)}'>")
            md += [text, "", f"![{head}]({png})", ""]
        else:
            h.append(f"<p class='note'>Not drawn: {html.escape(data[key])}.</p>")
            md += [f"Not drawn: {data[key]}.", ""]
    if run.notes:
        h.append("<h2>Missing or partial data</h2><ul>" +
                 "".join(f"<li class='note'>{html.escape(n)}</li>" for n in run.notes) + "</ul>")
        md += ["## Missing or partial data", ""] + [f"- {n}" for n in run.notes] + [""]
    files = ", ".join(sorted(os.path.basename(p) for p in glob.glob(os.path.join(run.folder, "*"))
                             if re.match(r"(summary|events-|top-|worker-)", os.path.basename(p))))
    h.append(f"<p style='color:#666;font-size:small'>Read from {html.escape(files) or 'nothing'}; "
             "written by deploy/report.py.</p></body></html>")
    md.append(f"Read from {files or 'nothing'}; written by deploy/report.py.")
    with open(os.path.join(out, "index.html"), "w") as f:
        f.write("\n".join(h) + "\n")
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write("\n".join(md) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\nUsage:")[0],
                                 epilog="Exit codes: 0 written, 1 nothing to report, 2 bad usage. "
                                        "docs/DEPLOY.md, \"Run report\".",
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, help="the run folder (deploy/two-site.sh --out)")
    ap.add_argument("--out", help="where the report goes (default RUN/report)")
    ap.add_argument("--job", help="the job to report (default: the one the workers trained)")
    a = ap.parse_args()
    if not os.path.isdir(a.run):
        print(f"report: {a.run} is not a folder", file=sys.stderr)
        return 2
    run = Run(a.run, a.job)
    if run.empty():
        print(f"report: nothing to report in {a.run} (no summary.json, events-*.jsonl, "
              "top-*.jsonl or worker-*-0.json)", file=sys.stderr)
        return 1
    out = a.out or os.path.join(a.run, "report")
    os.makedirs(out, exist_ok=True)
    for old in ("validation", "wan-bytes", "lag", "bandwidth", "training", "chrf"):
        if os.path.exists(os.path.join(out, old + ".png")):  # not to be taken for this run's
            os.remove(os.path.join(out, old + ".png"))
    series = {s: site_series(run, s) for s in run.sites if run.top.get(s)}
    plots, data, why = {}, {}, {}
    for key, draw in (("validation", lambda p: plot_validation(run, p)),
                      ("wan-bytes", lambda p: plot_wan_bytes(run, series, p)),
                      ("lag", lambda p: plot_lag(run, series, p)),
                      ("bandwidth", lambda p: plot_bandwidth(run, series, p)),
                      ("training", lambda p: plot_training(run, p)),
                      ("chrf", lambda p: plot_chrf(run, p))):
        if key == "chrf" and not translation_files(run):
            continue  # not a translation run
        d, reason = draw(os.path.join(out, key + ".png"))
        data[key] = d
        plots[key] = None if reason else key + ".png"
        if reason:
            why[key] = reason
            print(f"report: {key}.png not drawn: {reason}", file=sys.stderr)
    write_page(run, out, plots, why)
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump({"sites": run.sites, "job": run.job, "t0": run.t0, "plots": plots,
                   "not_drawn": why, "notes": run.notes, "series": data}, f, indent=1)
    for n in run.notes:
        print(f"report: {n}", file=sys.stderr)
    print(f"report: {os.path.join(out, 'index.html')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
