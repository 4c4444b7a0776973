"""The Markdown report of scripts/bench_control.py (step latency per backend, then the loops
with ROS I/O live) from its JSON result, and the loop traces' tail analysis it records."""

from __future__ import annotations

import json

import numpy as np


def markdown(report: dict) -> str:
    lines = [f"# Control benchmark: {report['label']}", "",
             f"- machine: {json.dumps(report['machine'])}",
             f"- commit: {report['commit']}", f"- command: `{report['command']}`",
             f"- note: {report['note']}", "",
             "## Step latency (reference policy, batch 1, 6 joints), us", "",
             "| backend | tick p50 | tick p99 | tick p99.9 | tick max | backend-step p50 | "
             "build s |", "|---|---|---|---|---|---|---|"]
    for name, r in report["steps"].items():
        if "skipped" in r:
            lines.append(f"| {name} | skipped: {r['skipped']} | | | | | |")
            continue
        t, b = r["tick_us"], r["backend_step_us"]
        lines.append(f"| {name} | {t['p50']:.1f} | {t['p99']:.1f} | {t['p999']:.1f} | "
                     f"{t['max']:.1f} | {b['p50']:.1f} | {r['build_s']:.1f} |")
    win = report.get("window_form_graph", {})
    if "backend_step_us" in win:
        b = win["backend_step_us"]
        lines.append(f"| window form, {win['history']} LSTM steps, CUDA graph (reference) | | | "
                     f"| | {b['p50']:.1f} (p99.9 {b['p999']:.1f}) | |")
    if report.get("eventfd_write_us"):
        e = report["eventfd_write_us"]
        lines += ["", f"os.eventfd_write (the process-mode loop's notification): p50 "
                  f"{e['p50']:.2f} us, p99.9 {e['p999']:.2f} us, max {e['max']:.1f} us."]
    lines += ["", "## Loop with ROS I/O live (JointState in from another process, commands "
              "out), us", "",
              "| backend | mode | rate Hz | cycles | deadline misses (preempted / blocked / late "
              "wake / slow step) | stale | step p50 | "
              "step p99 | step p99.9 | step max | wake p50 | wake p99.9 | wake max | "
              "period jitter p99.9 | delivery p50 / p99.9 |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["loops"]:
        if "skipped" in r:
            lines.append(f"| {r.get('spec')} | skipped: {r['skipped']} |" + " |" * 13)
            continue
        s, w, p = r["step_latency_us"], r["wake_error_us"], r["period_jitter_us"]
        d = r.get("delivery_us") or {}
        dcol = f"{d['p50']:.1f} / {d['p999']:.1f}" if d else ""
        # preempted / blocked / late wake / slow step (miss_cause.py; session 14's first runs
        # had no 'blocked': 0 there)
        mc = r.get("miss_causes") or {}
        misses = str(r["deadline_misses"])
        if mc and r["deadline_misses"]:
            misses += " ({} / {} / {} / {})".format(*(mc.get(k, 0) for k in (
                "misses_preempted", "misses_blocked", "misses_late_wake", "misses_slow_step")))
        lines.append(f"| {r['backend']} | {r.get('loop_mode', 'thread')} | {r['rate_hz']:g} | "
                     f"{r['cycles']} | {misses} | {r['stale_inputs']} | "
                     f"{s['p50']:.1f} | {s['p99']:.1f} | {s['p999']:.1f} | {s['max']:.1f} | "
                     f"{w['p50']:.1f} | {w['p999']:.1f} | {w['max']:.1f} | {p['p999']:.1f} | "
                     f"{dcol} |")
    return "\n".join(lines) + "\n"


def tail_pattern(lat: np.ndarray, wake: np.ndarray, rate: float) -> dict:
    """When the slow cycles happen: for steps above the run's p99 and wake-ups later than 200 us,
    how many, and the most common spacings between them in cycles (a periodic disturbance, e.g.
    a 10 Hz timer, shows up as a spacing of rate/10), plus the cycle indices of the 10 latest
    wake-ups (the deadline misses)."""
    out: dict = {}
    if lat.size == 0:
        return out
    for name, idx in (("slow_steps", np.flatnonzero(lat > np.percentile(lat, 99))),
                      ("late_wakes", np.flatnonzero(wake > 200e-6))):
        gaps = np.diff(idx)
        vals, counts = np.unique(gaps, return_counts=True) if gaps.size else ([], [])
        top = sorted(zip(counts, vals, strict=True), reverse=True)[:5]
        out[name] = {"count": int(idx.size),
                     "common_spacing_cycles": [[int(v), int(c)] for c, v in top],
                     "median_spacing_ms": float(np.median(gaps)) * 1e3 / rate if gaps.size
                     else None}
    worst = np.argsort(wake)[-10:][::-1]
    out["latest_wakes"] = [[int(i), float(wake[i]) * 1e6] for i in worst]
    # A once-a-second disturbance (a thread's 1 s timeout) puts the slow steps in one 100 ms
    # bin of the cycle index modulo 1 s; spread evenly, each bin holds ~10 %.
    slow = np.flatnonzero(lat > np.percentile(lat, 99.9))
    per_s = max(1, int(round(rate)))
    bins = np.bincount((slow % per_s) * 10 // per_s, minlength=10)
    out["slowest_0.1pct_by_phase_of_1s"] = [int(b) for b in bins]
    return out
