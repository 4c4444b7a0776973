"""Resource use of a process tree from /proc (Linux; no third-party library).

`tree_stats(pid)` sums over the process and every descendant (the control node's loop process,
the perception node's receiver processes): resident memory (MB), threads, open file
descriptors, processes. A process that is gone returns None.
"""

from __future__ import annotations

import os
from pathlib import Path

PROC = Path("/proc")


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for task in (PROC / str(pid) / "task").iterdir():
            text = (task / "children").read_text()
            out += [int(c) for c in text.split()]
    except OSError:
        pass
    return out


def descendants(pid: int) -> list[int]:
    """pid and all its descendants (breadth first)."""
    seen, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        if p in seen:
            continue
        seen.append(p)
        todo += _children(p)
    return seen


def _one(pid: int) -> dict | None:
    try:
        status = (PROC / str(pid) / "status").read_text()
        fds = len(os.listdir(PROC / str(pid) / "fd"))
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    rss_kb = int(fields.get("VmRSS", "0 kB").split()[0]) if "VmRSS" in fields else 0
    return {"rss_mb": rss_kb / 1024.0, "threads": int(fields.get("Threads", "0").strip()),
            "fds": fds}


def tree_stats(pid: int) -> dict | None:
    """{"rss_mb", "threads", "fds", "processes"} summed over the tree; None if pid is gone."""
    if _one(pid) is None:
        return None
    total = {"rss_mb": 0.0, "threads": 0, "fds": 0, "processes": 0}
    for p in descendants(pid):
        s = _one(p)
        if s is None:
            continue
        total["rss_mb"] += s["rss_mb"]
        total["threads"] += s["threads"]
        total["fds"] += s["fds"]
        total["processes"] += 1
    return total
