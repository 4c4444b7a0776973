"""CPU affinity of a whole process (no rclpy): every thread, not only the calling one.

sched_setaffinity(0, ...) pins the calling thread only; threads created later inherit their
creator's mask, but threads that already run (imports start some; DDS starts its own at
rclpy.init) keep theirs. `pin_threads` sets each thread of a process, again while new ones
appear. Used by the perception receivers (`receiver_cpus`) and the benchmarks' --*-cpus.
"""

from __future__ import annotations

import os
from collections.abc import Iterable


def pin_threads(pid: int, cpus: Iterable[int], rounds: int = 10) -> int:
    """Every thread of process `pid` (0: this process) onto `cpus`. Repeats (at most `rounds`
    times) while threads appear: one started meanwhile by a thread not yet pinned would escape.
    Threads that end meanwhile are skipped. Returns the number of threads pinned (0 if the
    process is gone)."""
    mask = set(int(c) for c in cpus)
    root = f"/proc/{pid or os.getpid()}/task"
    done: set[str] = set()
    for _ in range(rounds):
        try:
            tids = set(os.listdir(root)) - done
        except FileNotFoundError:  # the process is gone
            break
        if not tids:
            break
        for tid in tids:
            try:
                os.sched_setaffinity(int(tid), mask)
            except (ProcessLookupError, FileNotFoundError):
                pass  # that thread ended meanwhile
        done |= tids
    return len(done)
