"""`kestrel_bench report`: the current results as one markdown page with plots.

Reads every kestrel_bench/1 record in `--dir` (default docs/benchmarks/*.json), writes
`REPORT.md` there and its plots to `plots/` beside it (report_plots.py: latency CDFs per
benchmark, baseline vs optimized, the control loop's step-latency histogram with the deadline,
a radar of latency / throughput / memory / energy / accuracy). Both are regenerated on every
run, never edited by hand; files of another format are listed, not read.

    python -m kestrel_bench report
    python -m kestrel_bench report --dir /tmp/results --out /tmp/results/REPORT.md
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from kestrel_bench import report_plots
from kestrel_bench.record import DEFAULT_DIR, ROOT, SCHEMA

# records that feed the regression gate only (their paths are measured for their own pages):
# listed with their ratios, not plotted
GATE_ONLY = ("paired",)
PLOTS = (("latency_cdf", "Latency distributions", report_plots.latency_cdf),
         ("baseline_vs_optimized", "Baseline vs optimized", report_plots.baseline_vs_optimized),
         ("control_histogram", "Control loop step latency", report_plots.control_histogram),
         ("radar", "Dimensions", report_plots.radar))


def load_records(directory: Path) -> tuple[list[dict], list[str]]:
    """(kestrel_bench/1 records with their file name in "_file", other JSON file names)."""
    records, other = [], []
    for path in sorted(directory.glob("*.json")):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            other.append(path.name)
            continue
        if isinstance(doc, dict) and doc.get("schema") == SCHEMA:
            doc["_file"] = path.name
            records.append(doc)
        else:
            other.append(path.name)
    return records, other


def _ms(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v * 1e3:.1f} us" if v < 1 else f"{v:.3g} ms"


def _num(v: object) -> str:
    return f"{v:.3g}" if isinstance(v, (int, float)) else "-"


def records_table(records: list[dict]) -> list[str]:
    lines = ["| benchmark | machine | commit | date | command | file |",
             "|---|---|---|---|---|---|"]
    for r in records:
        m = r["machine"]
        where = m["class"] + (f" ({m['gpu']})" if m.get("gpu") else f" ({m.get('cpus')} CPUs)")
        cmd = r.get("command", "")
        cmd = cmd if len(cmd) <= 70 else cmd[:67] + "..."
        md = Path(r["_file"]).with_suffix(".md").name
        lines.append(f"| {r['benchmark']} | {where} | `{r.get('commit', '?')}` | "
                     f"{r.get('date', '?')[:10]} | `{cmd}` | [{r['_file']}]({md}) |")
    return lines


def pairs_table(records: list[dict]) -> list[str]:
    lines = ["| benchmark | baseline | optimized | p50 | p99 | p50 speed-up | throughput |",
             "|---|---|---|---|---|---|---|"]
    for rec in records:
        p = report_plots._pair(rec)
        if not p:
            continue
        b, o = p
        thr = o.get("throughput") or {}
        lines.append(
            f"| {report_plots.label(rec)} | {b['name']} | {o['name']} | "
            f"{_ms(b['latency_ms'].get('p50'))} -> {_ms(o['latency_ms'].get('p50'))} | "
            f"{_ms(b['latency_ms'].get('p99'))} -> {_ms(o['latency_ms'].get('p99'))} | "
            f"{b['latency_ms']['p50'] / o['latency_ms']['p50']:.2f}x | "
            + (f"{thr['value']:.4g} {thr['unit']} |" if thr else "- |"))
    return lines if len(lines) > 2 else []


def loops_table(records: list[dict]) -> list[str]:
    lines = ["| machine | loop | cycles | deadline misses | step p50 | step p99.9 |",
             "|---|---|---|---|---|---|"]
    for rec in records:
        if rec["benchmark"] != "control":
            continue
        for r in rec.get("results", []):
            m = r.get("metrics") or {}
            if "deadline_misses" not in m:
                continue
            lat = r.get("latency_ms") or {}
            lines.append(f"| {rec['machine']['class']} | {r['name']} | {m.get('cycles', '-')} "
                         f"| {m['deadline_misses']} | {_ms(lat.get('p50'))} | "
                         f"{_ms(lat.get('p999'))} |")
    return lines if len(lines) > 2 else []


def radar_table(records: list[dict]) -> list[str]:
    lines = ["| record | " + " | ".join(report_plots.RADAR_AXES) + " |",
             "|---|" + "---|" * len(report_plots.RADAR_AXES)]
    for rec in records:
        p = report_plots._pair(rec)
        if p:
            vals = report_plots.radar_values(*p)
            lines.append(f"| {report_plots.label(rec)} | "
                         + " | ".join(f"{vals[a]:.3g}x" if vals[a] is not None else "n/a"
                                      for a in report_plots.RADAR_AXES) + " |")
    return lines if len(lines) > 2 else []


def ratios_table(records: list[dict]) -> list[str]:
    lines = ["| record | ratio | value |", "|---|---|---|"]
    for rec in records:
        for k, v in sorted((rec.get("ratios") or {}).items()):
            lines.append(f"| {report_plots.label(rec)} | {k} | {_num(v)} |")
    return lines if len(lines) > 2 else []


def render(records: list[dict], other: list[str], plots: dict[str, Path | None],
           page: Path, command: str) -> str:
    rel = {k: os.path.relpath(v, page.parent) for k, v in plots.items() if v}
    shown = [r for r in records if r["benchmark"] not in GATE_ONLY]
    out = ["# Kestrel benchmark report", "",
           f"Generated by `{command}` from the kestrel_bench records in this folder; "
           "regenerate it after a benchmark run, do not edit it. Each record's own page (linked "
           "below) has every figure, the exact command and the machine.", "",
           "## Records", "", *records_table(records), ""]
    sections = {
        "latency_cdf": ("Each benchmark's results: percentiles p50 to p99.9 and the maximum "
                        "(from the loop histogram where a record has one).", []),
        "baseline_vs_optimized": ("Baseline and optimized path of each record, same run.",
                                  pairs_table(shown)),
        "control_histogram": ("Step latencies of the control loop with ROS I/O live; the red "
                              "line is the deadline (one period).", loops_table(shown)),
        "radar": ("Optimized relative to baseline on the five dimensions (> 1 = better; "
                  "accuracy: (1 - drift) ratio, drift = max abs difference from the fp32 "
                  "reference, or the ratio of task success where a record measures it; n/a = "
                  "not measured).", radar_table(shown)),
    }
    for key, title, _fn in PLOTS:
        text, table = sections[key]
        out += [f"## {title}", "", text, ""]
        if key in rel:
            out += [f"![{title}]({rel[key]})", ""]
        else:
            out += ["(no data for this plot in the current records)", ""]
        if table:
            out += [*table, ""]
    ratios = ratios_table(records)
    if ratios:
        out += ["## Same-run ratios", "", "What the regression gate (`kestrel_bench gate`) "
                "compares; > 1 = the optimized path is better.", "", *ratios, ""]
    if other:
        out += ["## Other files", "", "Not kestrel_bench/1 records (not in this report): "
                + ", ".join(other) + ".", ""]
    return "\n".join(out)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", default=str(ROOT / DEFAULT_DIR),
                        help="folder of the records (default docs/benchmarks)")
    parser.add_argument("--out", default="", help="the page (default <dir>/REPORT.md)")
    parser.add_argument("--plots", default="", help="plot folder (default <page dir>/plots)")


def run(args: argparse.Namespace) -> int:
    directory = Path(args.dir)
    page = Path(args.out) if args.out else directory / "REPORT.md"
    plot_dir = Path(args.plots) if args.plots else page.parent / "plots"
    records, other = load_records(directory)
    if not records:
        print(f"report: no kestrel_bench/1 record in {directory}")
        return 1
    plot_dir.mkdir(parents=True, exist_ok=True)
    plots = {}
    shown = [r for r in records if r["benchmark"] not in GATE_ONLY]
    for key, _title, fn in PLOTS:
        target = plot_dir / f"{key}.png"
        plots[key] = fn(shown, target) if shown else None
        if plots[key] is None and target.exists():
            target.unlink()  # a plot of data that is gone
    command = "python -m kestrel_bench report"
    page.write_text(render(records, other, plots, page, command))
    print(f"report: {len(records)} records -> {page}, plots: "
          + ", ".join(str(p) for p in plots.values() if p))
    return 0
