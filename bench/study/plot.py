#!/usr/bin/python3
"""Plots and a markdown table of the loss-versus-bytes study (bench/study/run.sh).

Reads the study's results.jsonl (one JSON object per point) and writes, next to it,
  loss-vs-bytes.png   mean validation loss vs kernel-counted WAN bytes (log x), one colour
                      per codec, one marker per H, one line style per outer optimiser and
                      sync.max_rounds_ahead K (filled markers: K = 0, synchronous rounds);
                      the centralised loss and dense per-step sync / 1000 as reference lines
  per-language.png    relative loss vs centralised per language: the 3 points closest to
                      centralised, and the 3 closest among those with >= 1000x fewer bytes
  defaults.png        the defaults against the old defaults and centralised training, per
                      data-order seed (written when the results hold both: the old
                      defaults are the point default/50/lr1m0.5 at K = 2 without overlap,
                      the defaults the point defaults/80/defaults with the default merge
                      policy; with a three-site results file too, its defaults beside them)
  table.md            what --table prints
With --table it also prints the table: one row per point, then the best point that meets
the goal (within 1% of centralised on every language, >= 1000x fewer wire bytes than dense
per-step sync), or the closest point on each criterion when none does.

Usage: bench/study/plot.py [--results demo-out/study/results.jsonl] [--table]
"""
import argparse
import json
import os
import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 (after the backend is chosen)

LANGS = ["en", "fr", "de", "es"]
CODECS = ["dense", "int8+zstd", "int4+zstd", "int2+zstd", "topk:0.1+int8+zstd", "default",
          "topk:0.01+int2+zstd", "topk:0.002+int2+zstd", "adaptive"]
LABEL = {"default": "old default (topk:0.05+int2+zstd)",
         "adaptive": "adaptive (dense to topk:0.002+int2+zstd, 200kbit)",
         "defaults": "defaults (int2:256+zstd, adaptive)"}
MARKER = {10: "o", 20: "s", 50: "^", 80: "v", 100: "D", 200: "P"}
GAP_GOAL_PCT, BYTES_GOAL_X = 1.0, 1000.0


def load(paths):
    """The points of one or more results files (e.g. a K = 0 and a K = 2 study); the first
    centralised baseline found is the reference, and a point key seen twice counts once."""
    rows, seen = [], set()
    for path in paths:
        for line in open(path):
            if not line.strip():
                continue
            r = json.loads(line)
            ident = (r["key"], r.get("max_rounds_ahead"))
            if ident not in seen:
                seen.add(ident)
                rows.append(r)
    steps = max(r["steps"] for r in rows)  # one study length; take the longest if mixed
    rows = [r for r in rows if r["steps"] == steps]
    central = next((r for r in rows if r["kind"] == "centralised"), None)
    points = [r for r in rows if r["kind"] == "two-site"]
    load.centrals = [r for r in rows if r["kind"] == "centralised"]  # one per data seed
    return central, points


def meets(r):
    return r["worst_rel_gap_pct"] <= GAP_GOAL_PCT and r["x_fewer_than_dense_per_step"] >= BYTES_GOAL_X


def setting_of(p):
    """What a point ran, its data-order seed left out: points of several seeds repeat it."""
    return (p["codec"], p["H"], p["outer_lr"], p["outer_momentum"], k_of(p), bool(p.get("overlap")),
            bool(p.get("swapped")))


def settings_meeting(points):
    """Settings whose every seed meets the goal: [(setting, [its points])]."""
    groups = {}
    for p in points:
        groups.setdefault(setting_of(p), []).append(p)
    return [(s, ps) for s, ps in groups.items() if all(meets(p) for p in ps)]


def plot_loss_vs_bytes(central, points, path):
    fig, ax = plt.subplots(figsize=(13, 6))
    for i, codec in enumerate(c for c in CODECS if any(p["codec"] == c for p in points)):
        colour = f"C{i}"
        styles = ("-", "--", ":", "-.", (0, (5, 1)), (0, (1, 3)), (0, (3, 1, 1, 1)), (0, (8, 2)))
        for (outer, k), style in zip(series(points), styles * 4):
            s = sorted((p for p in points
                        if p["codec"] == codec and p["outer"] == outer and k_of(p) == k),
                       key=lambda p: p["H"])
            if not s:
                continue
            ax.plot([p["kernel_wan_bytes"] for p in s], [p["mean_val_loss"] for p in s], ls=style,
                    color=colour, alpha=0.6,
                    label=f"{LABEL.get(codec, codec)}, {outer_label(s[0])}, {k_label(k)}")
            for p in s:
                ax.plot(p["kernel_wan_bytes"], p["mean_val_loss"], MARKER.get(p["H"], "x"),
                        color=colour, mfc=colour if k == 0 else "white")
    for h, m in MARKER.items():
        ax.plot([], [], m, color="gray", label=f"H = {h}")
    if central:
        ax.axhline(central["mean_val_loss"], color="black", lw=1,
                   label=f"centralised ({central['mean_val_loss']:.4f})")
        ax.axhline(central["mean_val_loss"] * (1 + GAP_GOAL_PCT / 100), color="black", lw=0.8,
                   ls=":", label="centralised + 1%")
    dense = points[0]["dense_per_step_bytes"]
    ax.axvline(dense / BYTES_GOAL_X, color="red", lw=1, ls=":",
               label=f"dense per-step sync / {BYTES_GOAL_X:.0f} ({dense / BYTES_GOAL_X:,.0f} B)")
    # Diverged points (more than 15% over centralised) would flatten the rest: they are
    # named under the axes instead (their figures are in the table).
    far = [p for p in points if p["worst_rel_gap_pct"] > 15]
    near = [p["mean_val_loss"] for p in points if p not in far]
    if far and near:
        low = min(near + ([central["mean_val_loss"]] if central else []))
        ax.set_ylim(low - 0.01, max(near) + 0.02)
    ax.set_xscale("log")
    xlabel = "WAN bytes, kernel-counted on the veth, both directions"
    if far and near:
        loss = [p["mean_val_loss"] for p in far]
        xlabel += (f"\n{len(far)} points above the plot (mean loss {min(loss):.2f}-{max(loss):.2f}): "
                   + "; ".join(sorted({outer_label(p) for p in far})))
    ax.set_xlabel(xlabel)
    ax.set_ylabel("mean validation loss (en, fr, de, es)")
    ax.set_title(f"Loss vs WAN bytes, T = {points[0]['steps']} steps per rank "
                 "(filled: K = 0, synchronous rounds; hollow: K > 0)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_per_language(points, path, n=3):
    # The n points closest to centralised, and the n closest among those that send at least
    # BYTES_GOAL_X fewer bytes than dense per-step sync.
    by_gap = sorted(points, key=lambda p: p["worst_rel_gap_pct"])
    few = [p for p in by_gap if p["x_fewer_than_dense_per_step"] >= BYTES_GOAL_X]
    best = by_gap[:n] + [p for p in few[:n] if p not in by_gap[:n]]
    fig, ax = plt.subplots(figsize=(9, 5))
    width = 0.8 / len(best)
    for i, p in enumerate(best):
        xs = [j + (i - (len(best) - 1) / 2) * width for j in range(len(LANGS))]
        ax.bar(xs, [p["rel_loss_vs_centralised_pct"][l] for l in LANGS], width,
               label=f"{name(p)}: {p['x_fewer_than_dense_per_step']:,.0f}x fewer bytes")
    ax.axhline(0, color="black", lw=1, label="centralised")
    ax.axhline(GAP_GOAL_PCT, color="red", lw=0.8, ls=":", label=f"+{GAP_GOAL_PCT:.0f}%")
    ax.set_xticks(range(len(LANGS)), LANGS)
    ax.set_ylabel("validation loss vs centralised (%)")
    ax.set_title(f"Per-language gap vs centralised: the {n} closest points,\n"
                 f"and the {n} closest with >= {BYTES_GOAL_X:.0f}x fewer bytes than dense per-step")
    ax.legend(fontsize=7)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def old_defaults(p):
    """The defaults before 2026-11-26: topk:0.05+int2+zstd, H 50, lr 1, Nesterov 0.5, K 2,
    serial rounds."""
    return (p["codec"] == "default" and p["H"] == 50 and p["outer_lr"] == 1
            and p["outer_momentum"] == 0.5 and k_of(p) == 2 and not p.get("overlap"))


def new_defaults(p):
    """No codec or outer settings, overlapped, the default merge policy (a tenth of H, no
    wait: the key's /afterM)."""
    return (p["codec"] == "defaults" and p.get("overlap")
            and p["key"].endswith(f"/after{max(1, p['H'] // 10)}"))


def plot_defaults(points, path):
    """Worst-language gap per seed, and mean gap against wire bytes: old defaults, the
    defaults (two sites, and three when given), centralised at 0. False when the results
    do not hold both."""
    groups = [("old defaults (topk:0.05+int2+zstd, H 50, K 2, serial)",
               [p for p in points if old_defaults(p) and p.get("sites", 2) == 2]),
              ("defaults, 2 sites (int2:256+zstd adaptive, H 80, K 1, overlapped)",
               [p for p in points if new_defaults(p) and p.get("sites", 2) == 2]),
              ("defaults, 3 sites", [p for p in points if new_defaults(p) and p.get("sites") == 3])]
    groups = [(label, sorted(ps, key=lambda p: p.get("data_seed", 0))) for label, ps in groups if ps]
    if len(groups) < 2 or not groups[0][0].startswith("old"):
        return False
    seeds = sorted({p.get("data_seed", 0) for _, ps in groups for p in ps})
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    width = 0.8 / len(groups)
    for i, (label, ps) in enumerate(groups):
        by_seed = {p.get("data_seed", 0): p for p in ps}
        xs = [j + (i - (len(groups) - 1) / 2) * width for j, s in enumerate(seeds) if s in by_seed]
        left.bar(xs, [by_seed[s]["worst_rel_gap_pct"] for s in seeds if s in by_seed], width,
                 label=label, color=f"C{i}")
        mean_gap = [sum(p["rel_loss_vs_centralised_pct"][l] for l in LANGS) / len(LANGS) for p in ps]
        right.plot([p["kernel_wan_bytes"] for p in ps], mean_gap, "o", color=f"C{i}", label=label)
    for ax in (left, right):
        ax.axhline(0, color="black", lw=1, label="centralised (same seed, same tokens)")
        ax.grid(True, axis="y", alpha=0.3)
    left.axhline(GAP_GOAL_PCT, color="red", lw=0.8, ls=":", label=f"+{GAP_GOAL_PCT:.0f}% (goal)")
    left.set_xticks(range(len(seeds)), [f"seed {s}" for s in seeds])
    left.set_ylabel("worst language: validation loss vs centralised (%)")
    left.set_title("Worst language, per data-order seed")
    top = max(p["worst_rel_gap_pct"] for _, ps in groups for p in ps)
    left.set_ylim(min(0, left.get_ylim()[0]), max(top, GAP_GOAL_PCT) * 1.6)  # room for the legend
    left.legend(fontsize=7, loc="upper right")
    right.legend(fontsize=7, loc="upper right")
    right.set_ylim(right.get_ylim()[0], right.get_ylim()[1] * 1.5)
    right.set_xscale("log")
    right.set_xlabel("WAN bytes of the run (kernel-counted; 3 sites: the sites' own count)")
    right.set_ylabel("mean over languages of loss vs centralised (%)")
    right.set_title(f"Mean gap vs bytes (dense per-step sync: {points[0]['dense_per_step_bytes']:,} B)")
    fig.suptitle(f"The defaults against the old defaults, T = {points[0]['steps']} steps per rank")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def outers(points):  # plain averaging first
    return sorted({p["outer"] for p in points}, key=lambda o: (o != "avg", o))


def k_of(p):
    """sync.max_rounds_ahead of a point: recorded by run.sh, or the key's /kK suffix."""
    if "max_rounds_ahead" in p:
        return p["max_rounds_ahead"]
    m = re.search(r"/k(\d+)$", p["key"])
    return int(m.group(1)) if m else None


def k_label(k):
    return "K ?" if k is None else ("K 0 (synchronous)" if k == 0 else f"K {k}")


def series(points):  # (outer, K) pairs: plain averaging first, then by K
    return sorted({(p["outer"], k_of(p)) for p in points},
                  key=lambda s: (s[0] != "avg", s[0], -1 if s[1] is None else s[1]))


def outer_label(p):
    lr, m = p["outer_lr"], p["outer_momentum"]
    if lr == 1 and m == 0:
        return "avg"
    return f"lr {lr:g}" + (f", Nesterov {m:g}" if m else "")


def name(p):
    return (f"{p['codec']} H{p['H']} {outer_label(p)} {k_label(k_of(p))}"
            + (" overlapped" if p.get("overlap") else "")
            + (" sites swapped" if p.get("swapped") else ""))


def table(central, points):
    lines = ["| codec | H | outer | K | overlap | seed | en | fr | de | es | mean | worst gap | wire bytes | x fewer than dense per-step |",
             "|---|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in getattr(load, "centrals", [central] if central else []):
        v = c["val_loss"]
        lines.append(f"| centralised (batch 32) | - | - | - | - | {c.get('data_seed', 0)} | "
                     + " | ".join(f"{v[l]:.4f}" for l in LANGS)
                     + f" | {c['mean_val_loss']:.4f} | 0 | 0 | - |")
    if central:
        lines.append("| dense per-step sync (reference: payload only) | 1 | - | - | - | - | | | | | | | "
                     f"{points[0]['dense_per_step_bytes']:,} | 1x |")
    order = {c: i for i, c in enumerate(CODECS)}
    rank = {o: i for i, o in enumerate(outers(points))}
    seen = set()
    def k_sort(p):
        return -1 if k_of(p) is None else k_of(p)

    for p in sorted(points, key=lambda p: (k_sort(p), rank[p["outer"]], order.get(p["codec"], 99),
                                           p["H"])):
        v = p["val_loss"]
        flag = "" if p["digests_agree"] else " (digests differ)"
        setting = setting_of(p) + (p.get("data_seed", 0),)
        if setting in seen:  # the same setting run again (another key, e.g. lr1m0 for avg)
            flag += " (repeat)"
        seen.add(setting)
        if p["codec"] == "adaptive":  # what it chose for the last round
            flag += " -> " + ", ".join(p.get("last_round_codecs", []))
        lines.append(f"| {LABEL.get(p['codec'], p['codec'])}{flag} | {p['H']} | "
                     f"{outer_label(p)} | {'?' if k_of(p) is None else k_of(p)} | "
                     f"{'yes' if p.get('overlap') else 'no'}{' (sites swapped)' if p.get('swapped') else ''} | "
                     f"{p.get('data_seed', 0)} | "
                     + " | ".join(f"{v[l]:.4f}" for l in LANGS)
                     + f" | {p['mean_val_loss']:.4f} | {p['worst_rel_gap_pct']:+.2f}% | "
                     f"{p['kernel_wan_bytes']:,} | {p['x_fewer_than_dense_per_step']:,.0f}x |")
    p0 = points[0]
    lines += ["", f"T = {p0['steps']} steps per rank; dense per-step sync = 2 sites x "
              f"{p0['numel_trainable']:,} trainable numel x 4 B x {p0['steps']} steps = "
              f"{p0['dense_per_step_bytes']:,} payload bytes (a lower bound: no framing). "
              "Worst gap: the largest per-language relative loss vs the centralised run of the "
              "same data-order seed. A setting meets the goal only if every seed it ran meets it.", ""]
    ok = settings_meeting(points)
    if ok:
        worst = lambda ps: max(p["worst_rel_gap_pct"] for p in ps)
        s, ps = min(ok, key=lambda sp: (worst(sp[1]), sp[1][0]["kernel_wan_bytes"]))
        lines.append(f"**Goal met** by {len(ok)} setting(s) on every seed they ran; best (smallest "
                     f"worst gap over its {len(ps)} seed(s)): {name(ps[0])}, worst gap "
                     f"{worst(ps):+.2f}%, {min(p['x_fewer_than_dense_per_step'] for p in ps):,.0f}x "
                     "or more fewer than dense per-step.")
    else:
        g = min(points, key=lambda p: p["worst_rel_gap_pct"])
        x = max(points, key=lambda p: p["x_fewer_than_dense_per_step"])
        enough = [p for p in points if p["x_fewer_than_dense_per_step"] >= BYTES_GOAL_X]
        lines.append(f"**Goal not met.** Smallest worst gap: {name(g)} ({g['worst_rel_gap_pct']:+.2f}%, "
                     f"{g['x_fewer_than_dense_per_step']:,.0f}x fewer bytes). Fewest bytes: {name(x)} "
                     f"({x['x_fewer_than_dense_per_step']:,.0f}x, worst gap {x['worst_rel_gap_pct']:+.2f}%).")
        if enough:
            e = min(enough, key=lambda p: p["worst_rel_gap_pct"])
            lines.append(f"Smallest worst gap among points with >= {BYTES_GOAL_X:.0f}x fewer bytes: "
                         f"{name(e)} ({e['worst_rel_gap_pct']:+.2f}%, "
                         f"{e['x_fewer_than_dense_per_step']:,.0f}x).")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", nargs="+", default=["demo-out/study/results.jsonl"],
                    help="results.jsonl files of bench/study/run.sh (one or more)")
    ap.add_argument("--out", help="folder for the figures and table (default: the first "
                    "results file's folder)")
    ap.add_argument("--table", action="store_true", help="print the markdown table")
    a = ap.parse_args()
    central, points = load(a.results)
    if not points:
        raise SystemExit(f"plot.py: no two-site points in {' '.join(a.results)}")
    if central is None:
        raise SystemExit(f"plot.py: no centralised point in {' '.join(a.results)} "
                         "(run.sh runs it first)")
    out = a.out or os.path.dirname(a.results[0]) or "."
    os.makedirs(out, exist_ok=True)
    plot_loss_vs_bytes(central, points, f"{out}/loss-vs-bytes.png")
    plot_per_language(points, f"{out}/per-language.png")
    wrote = ["loss-vs-bytes.png", "per-language.png"]
    if plot_defaults(points, f"{out}/defaults.png"):
        wrote.append("defaults.png")
    md = table(central, points)
    with open(f"{out}/table.md", "w") as f:
        f.write(md + "\n")
    if a.table:
        print(md)
    print(f"plot.py: wrote {', '.join(f'{out}/{w}' for w in wrote)}, {out}/table.md",
          file=sys.stderr)


if __name__ == "__main__":
    main()
