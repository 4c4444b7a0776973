"""The report's plots (matplotlib, Agg backend), each from kestrel_bench/1 records:

  latency_cdf.png            latency distribution per benchmark: each result's percentiles
                             (p50 .. p99.9, max) on a "nines" axis, or its histogram's CDF
  baseline_vs_optimized.png  p50 and p99 of the baseline and optimized paths per record
  control_histogram.png      the control loop's step latencies with the deadline (1 / rate)
  radar.png                  optimized vs baseline per record on latency, throughput, memory,
                             energy and accuracy (> 1 = the optimized path is better)
Each function returns the file it wrote, or None when the records hold no data for it.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

QUANTILES = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("p999", 0.999))
DPI = 70
RADAR_AXES = ("latency", "throughput", "memory", "energy", "accuracy")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt



def label(rec: dict) -> str:
    return f"{rec['benchmark']} ({rec['machine']['class']})"


def _nines(q: np.ndarray) -> np.ndarray:
    """Quantile -> "nines" (p90 = 1, p99 = 2, ...), capped at p99.99."""
    return -np.log10(np.clip(1.0 - np.asarray(q, dtype=float), 1e-4, 1.0))


def _pair(rec: dict) -> tuple[dict, dict] | None:
    """(baseline, optimized) results with latencies, or None."""
    rs = [r for r in rec.get("results", []) if "latency_ms" in r and r["latency_ms"].get("n")]
    b = next((r for r in rs if r.get("role") == "baseline"), None)
    o = next((r for r in rs if r.get("role") == "optimized"), None)
    return (b, o) if b and o else None


def latency_cdf(records: list[dict], path: Path, max_lines: int = 8) -> Path | None:
    groups: dict[str, list[tuple[str, dict]]] = {}
    for rec in records:
        for r in rec.get("results", []):
            if r.get("latency_ms", {}).get("n"):
                groups.setdefault(rec["benchmark"], []).append((rec["machine"]["class"], r))
    if not groups:
        return None
    plt = _plt()
    from matplotlib.ticker import NullFormatter

    n = len(groups)
    cols = min(n, 2)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 3.1 * rows), squeeze=False)
    for ax, (bench, items) in zip(axes.flat, sorted(groups.items()), strict=False):
        rank = {"optimized": 0, "baseline": 1}
        items = sorted(items, key=lambda it: rank.get(it[1].get("role"), 2))[:max_lines]
        for machine, r in items:
            lat = r["latency_ms"]
            hist = r.get("histogram_us")
            if hist and sum(hist.get("counts", [])):
                counts = np.asarray(hist["counts"], dtype=float)
                last = int(np.nonzero(counts)[0][-1]) + 1  # no flat tail past the maximum
                counts = counts[:last]
                x = np.asarray(hist["edges"][1:last + 1], dtype=float) / 1e3
                y = np.cumsum(counts) / counts.sum()
            else:
                # n samples resolve quantiles up to 1 - 1/n; the maximum sits at 1 - 0.5/n
                n_s = max(int(lat["n"]), 2)
                pts = [(lat[k], q) for k, q in QUANTILES
                       if lat.get(k) is not None and q <= 1.0 - 1.0 / n_s]
                if lat.get("max") is not None:
                    pts.append((lat["max"], 1.0 - 0.5 / n_s))
                x, y = (np.asarray(v, dtype=float) for v in zip(*pts, strict=True))
            ax.plot(x, _nines(y), marker="o", ms=3, lw=1.2,
                    label=f"{r['name']} [{machine}]"[:40])
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # decade labels only: no overlap
        ax.set_yticks(_nines(np.array([0.5, 0.9, 0.99, 0.999, 0.9999])))
        ax.set_yticklabels(["p50", "p90", "p99", "p99.9", "p99.99"])
        ax.set_ylim(0, 4.1)
        ax.set_xlabel("latency, ms")
        ax.set_title(bench, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6, loc="lower right")
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def baseline_vs_optimized(records: list[dict], path: Path) -> Path | None:
    pairs = [(label(rec), *p) for rec in records if (p := _pair(rec))]
    if not pairs:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(6, 1.8 * len(pairs) + 1.5), 4))
    x = np.arange(len(pairs))
    w = 0.2
    for i, (q, role, color) in enumerate((("p50", 1, "#999999"), ("p50", 2, "#1f77b4"),
                                          ("p99", 1, "#cccccc"), ("p99", 2, "#aec7e8"))):
        vals = [p[role]["latency_ms"].get(q) or np.nan for p in pairs]
        name = "baseline" if role == 1 else "optimized"
        ax.bar(x + (i - 1.5) * w, vals, w, color=color, label=f"{name} {q}")
    for xi, (_, b, o) in zip(x, pairs, strict=True):
        speed = b["latency_ms"]["p50"] / o["latency_ms"]["p50"]
        top = max(v for r in (b, o) for k in ("p50", "p99")
                  if (v := r["latency_ms"].get(k)) is not None)
        ax.annotate(f"{speed:.2g}x", (xi, top * 1.15), ha="center", va="bottom", fontsize=8)
    ax.set_yscale("log")
    lo, hi = ax.get_ylim()
    ax.set_ylim(lo, hi * 3)  # room for the speed-up labels
    ax.set_ylabel("latency, ms (log)")
    ax.set_xticks(x)
    ax.set_xticklabels([f"{lab}\n{b['name'][:22]}\nvs {o['name'][:22]}"
                        for lab, b, o in pairs], fontsize=6)
    ax.legend(fontsize=7)
    ax.set_title("baseline vs optimized path (label: p50 speed-up)", fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def control_histogram(records: list[dict], path: Path) -> Path | None:
    loops = [(rec["machine"]["class"], r) for rec in records if rec["benchmark"] == "control"
             for r in rec.get("results", []) if r.get("histogram_us", {}).get("counts")]
    if not loops:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4))
    deadlines = set()
    for machine, r in loops[:6]:
        h = r["histogram_us"]
        edges = np.asarray(h["edges"], dtype=float)
        ax.stairs(np.asarray(h["counts"], dtype=float), edges, lw=1.3,
                  label=f"{r['name']} [{machine}], misses "
                        f"{(r.get('metrics') or {}).get('deadline_misses', '?')}"[:60])
        rate = (r.get("config") or {}).get("rate_hz")
        if rate:
            deadlines.add(1e6 / float(rate))
    for d in sorted(deadlines):
        ax.axvline(d, color="red", ls="--", lw=1.2)
        ax.annotate(f"deadline {d:g} us", (d, 0.5), xycoords=("data", "axes fraction"),
                    color="red", fontsize=8, ha="right", va="center", rotation=90)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("loop step latency, us")
    ax.set_ylabel("cycles")
    ax.set_title("control loop step latency", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def radar_values(b: dict, o: dict) -> dict[str, float | None]:
    """Optimized relative to baseline per axis (> 1 = better), None where a figure is absent:
    latency p50 b/o, throughput o/b, peak memory b/o, energy per item b/o, accuracy
    (1 - drift_o) / (1 - drift_b) with drift the max abs difference from the fp32 reference,
    or where no drift is measured the ratio of metrics.accuracy / metrics.success_rate."""
    def get(r: dict, *path: str) -> float | None:
        for p in path:
            r = r.get(p) if isinstance(r, dict) else None
        return float(r) if isinstance(r, (int, float)) and r > 0 else None

    def ratio(a: float | None, c: float | None) -> float | None:
        return a / c if a and c else None

    db = get(b, "drift", "max_abs") or 0.0
    do = get(o, "drift", "max_abs")
    if do is not None:
        accuracy = max(0.0, 1.0 - do) / max(1e-9, 1.0 - db)
    else:  # task outcomes where a record measures them
        accuracy = next((ratio(get(o, "metrics", k), get(b, "metrics", k))
                         for k in ("accuracy", "success_rate")
                         if get(o, "metrics", k) and get(b, "metrics", k)), None)
    return {"latency": ratio(get(b, "latency_ms", "p50"), get(o, "latency_ms", "p50")),
            "throughput": ratio(get(o, "throughput", "value"), get(b, "throughput", "value")),
            "memory": ratio(get(b, "peak_memory_mb"), get(o, "peak_memory_mb")),
            "energy": ratio(get(b, "power", "energy_j_per_item"),
                            get(o, "power", "energy_j_per_item")),
            "accuracy": accuracy}


def radar(records: list[dict], path: Path) -> Path | None:
    items = [(label(rec), radar_values(*p)) for rec in records if (p := _pair(rec))]
    if not items:
        return None
    plt = _plt()
    n = len(items)
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    angles = np.linspace(0, 2 * np.pi, len(RADAR_AXES), endpoint=False)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.2 * rows), squeeze=False,
                             subplot_kw={"projection": "polar"})
    for ax, (lab, vals) in zip(axes.flat, items, strict=False):
        # radius 1 + log10(factor): 0.1x -> 0, equal -> 1 (dashed), 10x -> 2, 100x -> 3
        r = np.array([max(0.0, 1.0 + math.log10(vals[a])) if vals[a] else 0.0
                      for a in RADAR_AXES])
        top = max(2.0, float(np.nanmax(r)) * 1.1)
        ax.plot(np.append(angles, angles[0]), np.append(r, r[0]), color="#1f77b4")
        ax.fill(angles, r, alpha=0.25, color="#1f77b4")
        ax.plot(np.linspace(0, 2 * np.pi, 100), np.ones(100), color="gray", ls="--", lw=0.8)
        ax.set_xticks(angles)
        ax.set_xticklabels([f"{a}\n{vals[a]:.2g}x" if vals[a] is not None else f"{a}\nn/a"
                            for a in RADAR_AXES], fontsize=7)
        ax.set_ylim(0, top)
        ax.set_yticklabels([])
        ax.set_title(lab, fontsize=9, pad=14)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle("optimized vs baseline (dashed: equal; radius log10, > 1 better)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path
