"""`kestrel_bench soak`: the whole stack for a given time, its resource use sampled.

    python -m kestrel_bench soak --duration 3600            # the committed 1-hour run
    python -m kestrel_bench soak --duration 60 --warmup 10   # a quick look

Starts the stack with the launch-free runner (kestrel_bringup.run_stack: same table and YAML
as the launch files) and samples, every --interval seconds, each node's process tree (RSS,
threads, open fds, processes: procstat.py) and the counters the nodes publish on /diagnostics
(deadline misses, drops, rejections). Verdict, after --warmup: every node's RSS grew by less
than --max-rss-growth percent (median of the first vs the last tenth of the samples), and no
node exited or was restarted. Exit status 1 when the verdict fails.
"""

from __future__ import annotations

import argparse
import os
import time

from kestrel_bench.record import Record, add_common_arguments, finish

# counters worth a column in the record (substrings of /diagnostics keys)
COUNTER_WORDS = ("miss", "drop", "reject", "stale", "error", "overrun", "lost")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration", type=float, default=3600.0, help="s of stack run")
    p.add_argument("--interval", type=float, default=10.0, help="s between samples")
    p.add_argument("--warmup", type=float, default=300.0,
                   help="s before the RSS baseline (imports, warm-up, caches filling)")
    p.add_argument("--nodes", default="", help="comma-separated subset (default: the stack)")
    p.add_argument("--max-rss-growth", type=float, default=5.0, help="%% allowed after warm-up")
    p.add_argument("--log-dir", default="", help="each node's output to <dir>/<node>.log")
    add_common_arguments(p)


def _median(values: list[float]) -> float:
    s = sorted(values)
    return s[len(s) // 2] if s else float("nan")


def analyse(samples: list[dict], warmup_s: float, max_growth_pct: float) -> dict:
    """Per-node figures and the verdict from samples [{"t", "nodes": {name: stats|None},
    "restarts": {name: n}, "diagnostics": {name: {key: value}}}]."""
    names = sorted({n for s in samples for n in s["nodes"]})
    after = [s for s in samples if s["t"] >= warmup_s] or samples[-1:]
    tenth = max(1, len(after) // 10)
    nodes, problems = {}, []
    for name in names:
        rss = [s["nodes"][name]["rss_mb"] for s in after if s["nodes"].get(name)]
        head, tail = rss[:tenth], rss[-tenth:]
        start, end = _median(head), _median(tail)
        growth = 100.0 * (end - start) / start if rss and start > 0 else float("nan")
        alive = [s["nodes"][name] for s in samples if s["nodes"].get(name)]
        restarts = max((s["restarts"].get(name, 0) for s in samples), default=0)
        exited = any(s["nodes"].get(name) is None for s in samples)
        diag = {}
        for s in samples:
            for node, values in s.get("diagnostics", {}).items():
                if node.endswith(name):
                    diag.update({k: v for k, v in values.items()
                                 if any(w in k for w in COUNTER_WORDS)})
        nodes[name] = {
            "rss_start_mb": start, "rss_end_mb": end,
            "rss_max_mb": max((a["rss_mb"] for a in alive), default=float("nan")),
            "rss_growth_pct": growth,
            "threads_start": alive[0]["threads"] if alive else 0,
            "threads_end": alive[-1]["threads"] if alive else 0,
            "fds_start": alive[0]["fds"] if alive else 0,
            "fds_end": alive[-1]["fds"] if alive else 0,
            "restarts": restarts, "exited": exited, **diag}
        if not rss:
            problems.append(f"{name}: no sample after warm-up")
        elif growth >= max_growth_pct:
            problems.append(f"{name}: RSS grew {growth:.1f}% (limit {max_growth_pct:g}%)")
        if restarts or exited:
            problems.append(f"{name}: exited ({restarts} restarts)")
    return {"nodes": nodes, "problems": problems, "passed": not problems}


def _sample(runner, t: float, listener) -> dict:  # noqa: ANN001 (StackRunner, listener)
    from kestrel_bench.procstat import tree_stats

    nodes = {p.entry.name: (tree_stats(p.proc.pid) if p.proc.poll() is None else None)
             for p in runner.procs}
    return {"t": t, "nodes": nodes, "restarts": {p.entry.name: p.restarts for p in runner.procs},
            "diagnostics": listener.latest() if listener is not None else {}}


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kestrel_bringup.run_stack import StackRunner
    from kestrel_bringup.stack import STACK

    # a domain of its own, outside the tests' 1..100, unless the caller chose one
    os.environ.setdefault("ROS_DOMAIN_ID", "150")
    names = [n for n in args.nodes.split(",") if n] or None
    log_dir = Path(args.log_dir) if args.log_dir else None
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    # respawn off: a node that exits is a crash to count, not to hide
    runner = StackRunner(names, log_dir=log_dir, echo=False,
                         respawn={e.name: False for e in STACK})
    from kestrel_bench.diagnostics_node import DiagnosticsListener

    listener = DiagnosticsListener()
    samples: list[dict] = []
    t0 = time.monotonic()
    runner.start()
    try:
        while True:
            t = time.monotonic() - t0
            samples.append(_sample(runner, t, listener))
            if t >= args.duration or runner.supervise():
                break
            time.sleep(min(args.interval, max(0.0, args.duration - t)))
    except KeyboardInterrupt:
        pass
    finally:
        codes = runner.stop()
        listener.close()
    verdict = analyse(samples, args.warmup, args.max_rss_growth)
    rec = Record("soak", config={"duration_s": args.duration, "interval_s": args.interval,
                                 "warmup_s": args.warmup, "nodes": [e.name for e in
                                                                    runner.entries],
                                 "max_rss_growth_pct": args.max_rss_growth},
                 argv=getattr(args, "argv", None))
    for name, figures in verdict["nodes"].items():
        rec.add(name, "variant", metrics={**figures, "exit_code": codes.get(name)})
    rec["series"] = {name: [[round(s["t"], 1), *(
        [round(s["nodes"][name]["rss_mb"], 1), s["nodes"][name]["threads"],
         s["nodes"][name]["fds"]] if s["nodes"].get(name) else [None, None, None])]
        for s in samples] for name in verdict["nodes"]}
    rec.note(f"ran {samples[-1]['t'] if samples else 0:.0f} s; verdict: "
             + ("PASS" if verdict["passed"] else "FAIL: " + "; ".join(verdict["problems"])))
    finish(rec, args)
    return 0 if verdict["passed"] else 1
