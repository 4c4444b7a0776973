"""pin_threads: every thread of a process, not only the caller (kestrel_common.affinity)."""

from __future__ import annotations

import os
import threading

from kestrel_common.affinity import pin_threads


def test_every_thread_of_the_process_is_pinned_and_restored() -> None:
    mine = sorted(os.sched_getaffinity(0))
    started, stop = threading.Event(), threading.Event()

    def idle() -> None:  # a thread that exists before the call, as DDS's do
        started.set()
        stop.wait(10.0)

    t = threading.Thread(target=idle, daemon=True)
    t.start()
    assert started.wait(5.0)
    try:
        n = pin_threads(0, {mine[0]})
        tids = os.listdir("/proc/self/task")
        assert n >= 2 and n >= len(tids) - 1  # (a thread may have ended meanwhile)
        assert all(os.sched_getaffinity(int(tid)) == {mine[0]} for tid in tids
                   if int(tid) in (os.getpid(), t.native_id))
    finally:
        pin_threads(0, mine)
        stop.set()
        t.join(5.0)
    assert os.sched_getaffinity(0) == set(mine)


def test_a_process_that_is_gone_pins_nothing() -> None:
    assert pin_threads(2**22 + 12345, {0}) == 0  # beyond pid_max: no such /proc entry
