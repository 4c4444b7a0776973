"""kestrel_bench soak: the verdict from samples, /proc sampling of a process tree."""

from __future__ import annotations

import subprocess
import sys

from kestrel_bench.procstat import tree_stats
from kestrel_bench.soak import analyse


def _samples(rss_end: float, exit_at: float | None = None) -> list[dict]:
    out = []
    for i in range(100):
        t = float(i * 10)
        rss = 100.0 + (rss_end - 100.0) * i / 99
        alive = exit_at is None or t < exit_at
        out.append({"t": t, "restarts": {"a": 0},
                    "nodes": {"a": {"rss_mb": rss, "threads": 5, "fds": 9, "processes": 1}
                              if alive else None},
                    "diagnostics": {"/a": {"deadline_misses": 2.0, "frames": 7.0}}})
    return out


def test_verdict_passes_a_flat_run_and_fails_growth_and_crashes() -> None:
    ok = analyse(_samples(102.0), warmup_s=100.0, max_growth_pct=5.0)
    assert ok["passed"], ok["problems"]
    assert ok["nodes"]["a"]["deadline_misses"] == 2.0 and "frames" not in ok["nodes"]["a"]
    grown = analyse(_samples(120.0), warmup_s=100.0, max_growth_pct=5.0)
    assert not grown["passed"] and "RSS grew" in grown["problems"][0]
    crashed = analyse(_samples(100.0, exit_at=500.0), warmup_s=100.0, max_growth_pct=5.0)
    assert not crashed["passed"] and "exited" in crashed["problems"][-1]


def test_tree_stats_counts_children() -> None:
    code = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', "
            "'import time; time.sleep(30)']); print('up', flush=True); time.sleep(30)")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline().strip() == "up"
        stats = tree_stats(parent.pid)
        assert stats is not None and stats["processes"] == 2
        assert stats["rss_mb"] > 1.0 and stats["threads"] >= 2 and stats["fds"] >= 3
    finally:
        for p in subprocess.run(["pgrep", "-P", str(parent.pid)], capture_output=True,
                                text=True).stdout.split():
            subprocess.run(["kill", p])
        parent.kill()
        parent.wait()
    assert tree_stats(parent.pid) is None
