"""Deadline misses by cause (core/miss_cause.py): the rule on a scripted schedstat, and the
real loop thread preempted by a CPU hog, kept from the GIL by another thread, or stopped by a
signal."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kestrel_control.core.miss_cause import CAUSES, MissAttributor
from kestrel_control.core.rt_loop import RealtimeLoop
from kestrel_control.core.stats import LoopStats

# needs the machine to itself (a CPU hog and preempted threads, timed): run one at a time
pytestmark = pytest.mark.serial

HAS_SCHEDSTAT = os.path.exists("/proc/thread-self/schedstat")
needs_schedstat = pytest.mark.skipif(not HAS_SCHEDSTAT,
                                     reason="no /proc/thread-self/schedstat (CONFIG_SCHED_INFO)")


def _write(path: Path, run_delay_ns: int) -> None:
    path.write_text(f"123456 {run_delay_ns} 7\n")


class _Script:
    """Feeds a MissAttributor scripted readings: schedstat through a file, ru_nvcsw through a
    stand-in for its getrusage."""

    def __init__(self, tmp_path: Path) -> None:
        self.file = tmp_path / "schedstat"
        _write(self.file, 1_000)
        self.nvcsw = 0
        self.causes = MissAttributor(str(self.file))
        assert self.causes.available and self.causes.status.startswith("on")

        def fake_getrusage(_who: int, buf) -> int:
            buf[16] = self.nvcsw
            return 0

        self.causes._getrusage = fake_getrusage

    def cycle(self, at_start: tuple[int, int], at_wake: tuple[int, int],
              at_miss: tuple[int, int], wake_error_ns: int, overrun_ns: int,
              slept: bool = False) -> str:
        """(run_delay ns, voluntary switches) at the cycle's start (the previous cycle's end),
        its wake-up and its end."""
        for (delay, nvcsw), read in zip(
                (at_start, at_wake, at_miss),
                (self.causes.mark_end, self.causes.mark_wake, self.causes.mark_end), strict=True):
            _write(self.file, delay)
            self.nvcsw = nvcsw
            read()
        return CAUSES[self.causes.cause(wake_error_ns, overrun_ns, slept)]


def test_rule_on_scripted_readings(tmp_path: Path) -> None:
    s = _Script(tmp_path)
    us = 1_000
    # waited 400 us on the run queue during the step, overran by 300 us: preempted
    assert s.cycle((0, 5), (0, 5), (400 * us, 5), 5 * us, 300 * us) == "misses_preempted"
    # waited 600 us before the wake-up and woke 600 us late, overran by 500: preempted
    assert s.cycle((0, 5), (600 * us, 6), (600 * us, 6), 600 * us, 500 * us, True) \
        == "misses_preempted"
    # a 5 us wait during the spin that still woke on time cost nothing: the step's 4 us overrun
    assert s.cycle((0, 5), (5 * us, 5), (5 * us, 5), 0, 4 * us) == "misses_slow_step"
    # a short preemption inside a slow step (no voluntary switch): still the step
    assert s.cycle((0, 5), (0, 5), (100 * us, 5), 5 * us, 300 * us) == "misses_slow_step"
    # no wait, no switch; woke 1.5 ms late, overran by 0.53 ms: late wake (IRQ / hypervisor)
    assert s.cycle((0, 5), (0, 5), (0, 5), 1500 * us, 530 * us) == "misses_late_wake"
    # slept (one voluntary switch of its own) and woke late without a wait: still a late wake
    assert s.cycle((0, 5), (1 * us, 6), (1 * us, 6), 1500 * us, 530 * us, True) \
        == "misses_late_wake"
    # voluntary switches beyond the sleep before a late wake-up: it waited (the GIL): blocked
    assert s.cycle((0, 5), (2 * us, 8), (2 * us, 8), 1500 * us, 530 * us, True) \
        == "misses_blocked"
    # the switch fell after the wake-up read (a GIL wait there): blocked
    assert s.cycle((0, 5), (0, 5), (2 * us, 6), 1500 * us, 530 * us) == "misses_blocked"
    # switched out voluntarily during the step (a lock, a blocking wait): blocked
    assert s.cycle((0, 5), (0, 5), (3 * us, 6), 5 * us, 200 * us) == "misses_blocked"
    s.causes.close()
    assert not s.causes.available


def test_unavailable_is_reported_not_raised(tmp_path: Path) -> None:
    missing = MissAttributor(str(tmp_path / "nope"))
    assert not missing.available and missing.status.startswith("unavailable")
    for text in ("x\n", "0 0 0\n", "12 0 0\n"):  # garbage; statistics off (old kernels)
        f = tmp_path / "schedstat"
        f.write_text(text)
        bad = MissAttributor(str(f))
        assert not bad.available and "unavailable" in bad.status, text


def _loop_child(conn, cpu: int, cycles: int) -> None:
    """Runs the loop at 1 kHz pinned to `cpu`, spinning most of the period, and sends back its
    counters once `cycles` cycles (plus misses) have passed. The main thread waits on an event
    the step sets (no polling: it would take the GIL from the loop)."""
    stats = LoopStats(1e-3, capacity=cycles + 100)
    done = threading.Event()

    def step(_deadline_ns: int) -> None:
        if stats.cycles + stats.deadline_misses >= cycles:
            done.set()

    loop = RealtimeLoop(1e-3, step, stats, spin_s=0.9e-3, cpu_affinity=[cpu])
    applied = loop.start(timeout_s=10.0)
    conn.send(("started", applied))
    done.wait(60.0)
    loop.stop(2.0)
    conn.send(("done", stats.counters()))


def _run_child(cycles: int, during) -> dict:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    cpu = max(os.sched_getaffinity(0))
    proc = ctx.Process(target=_loop_child, args=(child, cpu, cycles), daemon=True)
    proc.start()
    try:
        assert parent.poll(60.0), "loop child did not start"
        kind, applied = parent.recv()
        assert kind == "started" and applied["cpu_affinity"].startswith("applied"), applied
        during(proc.pid, cpu)
        assert parent.poll(90.0), "loop child did not finish"
        kind, counters = parent.recv()
        assert kind == "done"
        return counters
    finally:
        proc.join(5.0)
        if proc.is_alive():
            proc.kill()


@pytest.mark.slow
@needs_schedstat
def test_a_cpu_hog_on_the_loop_cpu_is_counted_as_preemption() -> None:
    def hog(_pid: int, cpu: int) -> None:
        code = f"import os,time\nos.sched_setaffinity(0,{{{cpu}}})\nt=time.time()+1.5\n" \
               "while time.time()<t: pass\n"
        subprocess.run([sys.executable, "-c", code], timeout=30, check=True)

    c = _run_child(3000, hog)
    assert c["deadline_misses"] >= 20, c  # 1.5 s sharing one CPU with a spinning process
    assert sum(c[k] for k in CAUSES) == c["deadline_misses"], c
    assert c["misses_preempted"] >= 0.8 * c["deadline_misses"], c


@pytest.mark.slow
@needs_schedstat
def test_a_stopped_loop_is_not_taken_for_a_late_wake() -> None:
    """SIGSTOP takes the CPU from the spinning thread without a run-queue wait, but the thread
    is switched out (and in again): blocked. What the hypervisor does to a virtual CPU leaves
    no switch in the guest at all: that alone is a late wake (scripted above)."""
    def stop_three_times(pid: int, _cpu: int) -> None:
        for _ in range(3):
            os.kill(pid, signal.SIGSTOP)
            time.sleep(0.02)  # the injected 20 ms stop, not a synchronisation
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.1)

    c = _run_child(1500, stop_three_times)
    text = f"{c}"  # the whole dict (pytest's repr of it is cut)
    assert c["deadline_misses"] >= 3 * 15, text
    assert sum(c[k] for k in CAUSES) == c["deadline_misses"], text
    # ~19 misses per stop. Alone, all 3 stops come out blocked (every run). In the full suite
    # on 2 loaded cores, one stop once came out otherwise (57 misses, 38 blocked): after
    # SIGCONT a busy CPU can add a real run-queue wait (preempted). What must never happen is
    # a stop taken for a late wake.
    assert c["misses_blocked"] >= 2 * 15 and c["misses_late_wake"] < 15, text


@pytest.mark.slow
@needs_schedstat
def test_a_python_thread_holding_the_gil_is_counted_as_blocked() -> None:
    """Thread mode: another Python thread of the process keeps the GIL up to the switch
    interval (5 ms). The loop thread then waits off its CPU: blocked, not a late wake (which
    would send the operator to the hypervisor)."""
    stats = LoopStats(1e-3, capacity=2000)
    loop = RealtimeLoop(1e-3, lambda _d: None, stats)
    stop = threading.Event()

    def busy() -> None:
        while not stop.is_set():
            sum(range(1000))  # pure Python: holds the GIL between switch requests

    loop.start(timeout_s=10.0)
    worker = threading.Thread(target=busy, daemon=True)
    worker.start()
    try:
        deadline = time.monotonic() + 30.0
        while stats.deadline_misses < 50 and time.monotonic() < deadline:
            time.sleep(0.05)  # progress poll of a bounded wait
    finally:
        stop.set()
        worker.join(5.0)
        assert loop.stop(2.0)
    c = stats.counters()
    assert c["deadline_misses"] >= 50, c
    assert sum(c[k] for k in CAUSES) == c["deadline_misses"], c
    assert c["misses_blocked"] + c["misses_preempted"] >= 0.8 * c["deadline_misses"], c
