"""One markdown renderer for every kestrel_bench record: a header (benchmark, machine, commit,
command, date, config), one table of the results (latency percentiles, throughput, peak
memory, drift, power, energy, named metrics), the same-run ratios, any extra tables the record
carries ("tables": [{"title", "columns", "rows"}]) and the notes."""

from __future__ import annotations

import json


def _num(v: object, nd: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return f"{v:,}" if abs(v) >= 10_000 else str(v)
    if isinstance(v, float):
        if v != v:  # NaN
            return "-"
        a = abs(v)
        if a == 0:
            return "0"
        if a >= 1000:
            return f"{v:,.0f}"
        if a >= 100:
            return f"{v:.1f}"
        if a >= 0.01:
            return f"{v:.{nd}g}" if a < 1 else f"{v:.{nd}f}".rstrip("0").rstrip(".")
        return f"{v:.2e}"
    return str(v).replace("|", "\\|")


def _machine_line(m: dict) -> str:
    parts = [f"class **{m.get('class', '?')}**"]
    for key in ("gpu", "cpu_model", "cpus", "torch", "cuda", "python", "host", "loadavg_1m"):
        if m.get(key) is not None:
            parts.append(f"{key} {m[key]}")
    return ", ".join(parts)


def _metrics(m: dict | None) -> str:
    if not m:
        return ""
    return "; ".join(f"{k} {_num(v) if not isinstance(v, (dict, list)) else json.dumps(v)}"
                     for k, v in m.items())


def results_table(results: list[dict]) -> list[str]:
    lines = ["| name | role | n | p50 ms | p90 ms | p99 ms | p99.9 ms | max ms | throughput | "
             "peak MiB | drift | power W | energy J/item | metrics |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        head = f"| {r['name']} | {r.get('role', '')} |"
        if "skipped" in r or "error" in r:
            why = f"skipped: {r['skipped']}" if "skipped" in r else f"error: {r['error']}"
            lines.append(head + f" {_num(why[:160])} |" + " |" * 11)
            continue
        lat = r.get("latency_ms") or {}
        thr = r.get("throughput")
        thr_s = f"{_num(thr['value'])} {thr['unit']}" if thr else "-"
        drift = r.get("drift")
        drift_s = "-" if not drift else (
            f"{_num(drift.get('max_abs'))} vs {drift.get('reference', 'fp32')}")
        pw = r.get("power") or {}
        if "skipped" in pw:
            pw_s, e_s = "-", "-"
        else:
            pw_s = _num(pw.get("avg_w"))
            e_s = _num(pw.get("energy_j_per_item"), 3)
            if pw.get("item") and pw.get("energy_j_per_item") is not None:
                e_s += f" /{pw['item']}"
        cells = [_num(lat.get(k)) for k in ("n", "p50", "p90", "p99", "p999", "max")]
        lines.append(head + " " + " | ".join(cells) + f" | {thr_s} | "
                     f"{_num(r.get('peak_memory_mb'), 4)} | {drift_s} | {pw_s} | {e_s} | "
                     f"{_num(_metrics(r.get('metrics')))} |")
    return lines


def markdown(record: dict) -> str:
    """The record as one markdown page."""
    m = record.get("machine", {})
    lines = [f"# {record.get('benchmark', '?')} benchmark ({m.get('class', '?')})", "",
             f"- machine: {_machine_line(m)}",
             f"- commit: `{record.get('commit', '?')}`",
             f"- command: `{record.get('command', '?')}`",
             f"- date: {record.get('date', '?')}",
             f"- config: `{json.dumps(record.get('config', {}), sort_keys=True)}`", "",
             *results_table(record.get("results", []))]
    skipped_power = {(r.get("power") or {}).get("skipped") for r in record.get("results", [])}
    skipped_power.discard(None)
    if skipped_power:
        lines += ["", "Power not measured: " + "; ".join(sorted(skipped_power)) + "."]
    if record.get("ratios"):
        lines += ["", "Same-run ratios (> 1: the optimized path is better):", "",
                  "| ratio | value |", "|---|---|"]
        lines += [f"| {k} | {_num(v)} |" for k, v in record["ratios"].items()]
    for t in record.get("tables", []) or []:
        cols = t.get("columns", [])
        lines += ["", f"## {t.get('title', '')}", "", "| " + " | ".join(cols) + " |",
                  "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(_num(c) for c in row) + " |" for row in t.get("rows", [])]
    if record.get("notes"):
        lines += ["", "Notes:", ""] + [f"- {n}" for n in record["notes"]]
    return "\n".join(lines) + "\n"
