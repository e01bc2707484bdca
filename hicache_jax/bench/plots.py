"""The benchmarks' PNGs (matplotlib, optional: without it no PNG is drawn and the JSON says so).

Every figure: one title (what it shows), the goals' verdict under it where the benchmark has
goals (``goals.plot_note``), the configuration as the subtitle, TTFT on a log
axis (cached and cold requests differ by orders of magnitude), and the no-cache baseline
beside the cached run.
"""

from __future__ import annotations

import os
import textwrap
from typing import Sequence

import numpy as np

COLORS = {
    "no cache": "#7f7f7f",
    "cold": "#7f7f7f",
    "device": "#2ca02c",
    "host": "#1f77b4",
    "storage": "#9467bd",
    "hicache": "#d62728",
    "queue": "#ff7f0e",
    "service": "#1f77b4",
}
TIER_NAMES = {"cold": "cold (prefilled)", "device": "L1 device hit", "host": "L2 host hit", "storage": "L3 storage hit"}


def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        return plt
    except ImportError:
        return None


def _save(fig, plt, path: str, title: str, subtitle: str, note: str | None = None) -> str:
    """Title, subtitle and, when given, ``note`` (the goals' verdict) in red between them. The
    PNG's text chunks carry the title (``Title``) and the note (``Verdict``), so a reader (or a
    test) sees the statement without looking at pixels."""
    fig.suptitle(title, fontsize=13, fontweight="bold", y=0.995)
    top = 0.935
    if note:
        height = fig.get_figheight()
        lines = textwrap.wrap(note, width=int(fig.get_figwidth() * 12))  # ~12 bold 9-pt characters per inch
        fig.text(0.5, 0.945, "\n".join(lines), ha="center", va="top", fontsize=9, fontweight="bold", color="#c00000")
        top = 0.935 - len(lines) * 0.16 / height  # one 9-pt line is ~0.16 in
    fig.text(0.5, top, subtitle, ha="center", va="top", fontsize=8.5, color="#444444", wrap=True)
    fig.tight_layout(rect=(0, 0, 1, top - 0.055))
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    metadata = {"Title": title, "Description": subtitle}
    if note:
        metadata["Verdict"] = note
    fig.savefig(path, dpi=110, metadata=metadata)
    plt.close(fig)
    return os.path.abspath(path)


def _boxes(ax, groups: Sequence[tuple[str, Sequence[float]]], ylabel: str = "TTFT (ms, log scale)") -> None:
    """Boxes of seconds (drawn in ms) per group, points on top, median labelled, log y."""
    groups = [(label, [v * 1e3 for v in vals]) for label, vals in groups if len(vals)]
    if not groups:
        ax.text(0.5, 0.5, "no requests", ha="center", transform=ax.transAxes)
        return
    data = [v for _, v in groups]
    bp = ax.boxplot(
        data,
        tick_labels=[f"{label}\n(n={len(v)})" for label, v in groups],
        patch_artist=True,
        widths=0.55,
        showfliers=False,
    )
    for patch, (label, _) in zip(bp["boxes"], groups):
        key = next((k for k in COLORS if label.startswith(k) or k in label), None)
        patch.set_facecolor(COLORS.get(key, "#cccccc"))
        patch.set_alpha(0.45)
    rng = np.random.default_rng(0)
    for i, v in enumerate(data, 1):
        ax.scatter(i + rng.uniform(-0.12, 0.12, len(v)), v, s=9, color="black", alpha=0.5, zorder=3)
        med = float(np.median(v))
        ax.annotate(f"{med:,.0f} ms" if med >= 10 else f"{med:.2g} ms", (i + 0.3, med), fontsize=8, va="center")
    ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", which="both", alpha=0.25)


def tiers_plot(
    path: str, title: str, subtitle: str, groups: Sequence[tuple[str, Sequence[float]]], note: str | None = None
) -> str | None:
    """One panel: TTFT boxes per group (the baseline first), log scale; ``note``: see ``_save``."""
    plt = _plt()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(8.5, 5.2))
    _boxes(ax, groups)
    ax.set_title("TTFT by the tier that served the prompt's prefix", fontsize=10)
    return _save(fig, plt, path, title, subtitle, note)


def multiturn_plot(
    path: str, title: str, subtitle: str, base: dict, cached: dict, note: str | None = None
) -> str | None:
    """Three panels: TTFT per round (no cache vs hicache, median and p25-p75), where TTFT goes
    (mean queueing + service), and service time by serving tier beside the no-cache requests;
    ``note``: see ``_save``."""
    plt = _plt()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.4), gridspec_kw={"width_ratios": [1.1, 0.8, 1.3]})
    ax = axes[0]
    for name, s in (("no cache", base), ("hicache", cached)):
        rounds = s["ttft_by_round_s"]
        x = np.arange(len(rounds))
        med = np.array([np.median(r) for r in rounds]) * 1e3
        lo = np.array([np.percentile(r, 25) for r in rounds]) * 1e3
        hi = np.array([np.percentile(r, 75) for r in rounds]) * 1e3
        ax.plot(x, med, marker="o", color=COLORS[name], label=f"{name} (median, p25-p75)")
        ax.fill_between(x, lo, hi, color=COLORS[name], alpha=0.15)
    hit = cached["hit_rate_per_round"]
    ax.set_xticks(range(len(hit)))
    ax.set_xticklabels([f"{i}\nhit {h:.0%}" for i, h in enumerate(hit)])
    ax.set_xlabel("round (hicache hit rate)")
    ax.set_yscale("log")
    ax.set_ylabel("TTFT (ms, log scale)")
    ax.grid(axis="y", which="both", alpha=0.25)
    ax.legend(fontsize=8)
    ax.set_title("TTFT per round", fontsize=10)

    ax = axes[1]
    names = ["no cache", "hicache"]
    q = [base["queue_mean_s"] * 1e3, cached["queue_mean_s"] * 1e3]
    sv = [base["service_mean_s"] * 1e3, cached["service_mean_s"] * 1e3]
    ax.bar(names, sv, color=COLORS["service"], alpha=0.7, label="service (match, load-back, prefill)")
    ax.bar(names, q, bottom=sv, color=COLORS["queue"], alpha=0.7, label="queueing (waiting for admission)")
    for i in range(2):
        ax.text(i, q[i] + sv[i], f"{q[i] + sv[i]:,.0f} ms", ha="center", va="bottom", fontsize=9)
    ratio = (q[1] + sv[1]) / (q[0] + sv[0]) if q[0] + sv[0] else float("nan")
    ax.set_title(f"Mean TTFT = queueing + service (hicache x{ratio:.2f})", fontsize=10)
    ax.set_ylabel("ms")
    ax.set_ylim(0, 1.45 * max(q[0] + sv[0], q[1] + sv[1]))
    ax.legend(fontsize=8, loc="upper center")

    ax = axes[2]
    # Service time (admission -> first token) isolates what the cache changes: queueing depends
    # on the other requests in flight.
    groups = [("no cache", base["service_all_s"])]
    groups += [(TIER_NAMES[t], cached["service_by_tier"][t]) for t in ("cold", "device", "host", "storage")]
    _boxes(ax, groups, ylabel="service time (ms, log scale)")
    ax.set_title("Service time (admission -> first token) by the tier that served most of the prefix", fontsize=10)
    ax.tick_params(axis="x", labelsize=8)
    return _save(fig, plt, path, title, subtitle, note)


def spec_plot(path: str, title: str, subtitle: str, summary: dict, k: int) -> str | None:
    """``bench spec``: accept length per case (linear, k + 1 marked), then TPOT, E2E and TTFT
    per case (ms; a log scale where the values span a decade or more, as a cold prefill and an
    L1 hit of a large model do); points are the prompts, bars their medians."""
    plt = _plt()
    if plt is None:
        return None
    cases = list(summary)
    colors = [COLORS["cold"], COLORS["device"], COLORS["storage"], COLORS["hicache"]]
    fig, axes = plt.subplots(1, 4, figsize=(17, 5.4))
    x = np.arange(len(cases))
    ax = axes[0]
    vals = [summary[c]["accept_length"] for c in cases]
    ax.bar(x, vals, color=colors, alpha=0.7)
    for i, c in enumerate(cases):
        pts = summary[c]["accept_length_per_prompt"]
        ax.scatter(np.full(len(pts), i), pts, s=10, color="black", zorder=3)
        ax.annotate(f"{vals[i]:.2f}", (i, vals[i]), ha="center", va="bottom", fontsize=8)
    ax.axhline(k + 1, ls=":", c="k", lw=0.8)
    ax.text(len(cases) - 0.5, k + 1, f"k + 1 = {k + 1}", ha="right", va="bottom", fontsize=7)
    ax.set_ylim(0, k + 1.6)
    ax.set_ylabel("accept length (tokens per verify step)")
    ax.set_title("Accept length", fontsize=10)
    from matplotlib.ticker import FuncFormatter

    plain = FuncFormatter(lambda v, _: f"{v:g}")
    for ax, key, label in ((axes[1], "tpot", "TPOT"), (axes[2], "e2e", "E2E latency"), (axes[3], "ttft", "TTFT")):
        med = [summary[c][f"{key}_s"] * 1e3 for c in cases]
        ax.bar(x, med, color=colors, alpha=0.7)
        for i, c in enumerate(cases):
            pts = [v * 1e3 for v in summary[c][f"{key}_all_s"]]
            ax.scatter(np.full(len(pts), i + 0.18), pts, s=10, color="black", zorder=3)
            ax.annotate(
                f"{med[i]:,.0f}" if med[i] >= 10 else f"{med[i]:.2g}",
                (i - 0.18, med[i]),
                ha="center",
                va="bottom",
                fontsize=8,
            )
        every = [v * 1e3 for c in cases for v in summary[c][f"{key}_all_s"]]
        if max(every) >= 10 * min(every):  # spans a decade or more: log scale
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(plain)
            ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if str(v)[0] in "25" else ""))
            ax.set_ylabel(f"{label} (ms, log scale; bar: median, dots: prompts)")
        else:
            ax.set_ylim(0, max(every) * 1.15)
            ax.set_ylabel(f"{label} (ms; bar: median, dots: prompts)")
        ax.set_title(label, fontsize=10)
        ax.grid(axis="y", which="both", alpha=0.25)
    for ax in axes:
        ax.set_xticks(x)
        ax.set_xticklabels(cases, rotation=15, fontsize=8)
    return _save(fig, plt, path, title, subtitle)
