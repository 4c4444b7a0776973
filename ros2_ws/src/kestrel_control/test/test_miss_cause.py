"""Deadline misses by cause (core/miss_cause.py): the rule on a scripted schedstat, and the
real loop thread preempted by a CPU hog or stopped by a signal (the two causes a VM shows)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kestrel_control.core.miss_cause import CAUSES, MissAttributor
from kestrel_control.core.rt_loop import RealtimeLoop
from kestrel_control.core.stats import LoopStats

HAS_SCHEDSTAT = os.path.exists("/proc/thread-self/schedstat")
needs_schedstat = pytest.mark.skipif(not HAS_SCHEDSTAT,
                                     reason="no /proc/thread-self/schedstat (CONFIG_SCHED_INFO)")


def _write(path: Path, run_delay_ns: int) -> None:
    path.write_text(f"123456 {run_delay_ns} 7\n")


def test_rule_on_a_scripted_schedstat(tmp_path: Path) -> None:
    f = tmp_path / "schedstat"
    _write(f, 1_000)
    causes = MissAttributor(str(f))
    assert causes.available and causes.status.startswith("on")
    # waited 400 us on the run queue, overran by 300 us: preempted (the wait alone explains it)
    causes.mark()
    _write(f, 401_000)
    assert CAUSES[causes.cause(wake_error_ns=900_000, overrun_ns=300_000)] == "misses_preempted"
    # no wait; woke 1.5 ms late, overran by 0.53 ms: late wake (interrupts / hypervisor)
    causes.mark()
    assert CAUSES[causes.cause(wake_error_ns=1_500_000, overrun_ns=530_000)] == "misses_late_wake"
    # a wait shorter than the overrun and an on-time wake: the step
    causes.mark()
    _write(f, 450_000)
    assert CAUSES[causes.cause(wake_error_ns=5_000, overrun_ns=200_000)] == "misses_slow_step"
    causes.close()
    assert not causes.available


def test_unavailable_is_reported_not_raised(tmp_path: Path) -> None:
    missing = MissAttributor(str(tmp_path / "nope"))
    assert not missing.available and missing.status.startswith("unavailable")
    garbage = tmp_path / "garbage"
    garbage.write_text("x\n")
    bad = MissAttributor(str(garbage))
    assert not bad.available and "unavailable" in bad.status


def _loop_child(conn, cpu: int, cycles: int) -> None:
    """Runs the loop at 1 kHz pinned to `cpu`, spinning most of the period, and sends back its
    counters once `cycles` cycles (plus misses) have passed."""
    stats = LoopStats(1e-3, capacity=cycles + 100)
    loop = RealtimeLoop(1e-3, lambda _d: None, stats, spin_s=0.9e-3, cpu_affinity=[cpu])
    applied = loop.start(timeout_s=10.0)
    conn.send(("started", applied))
    limit = time.monotonic() + 60.0
    while stats.cycles + stats.deadline_misses < cycles and time.monotonic() < limit:
        time.sleep(0.02)  # progress poll of a bounded wait
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


@needs_schedstat
def test_a_stopped_loop_thread_is_counted_as_late_wake() -> None:
    """SIGSTOP takes the CPU from the spinning thread without a run-queue wait: what a VM's
    hypervisor does when it deschedules the virtual CPU."""
    def stop_three_times(pid: int, _cpu: int) -> None:
        for _ in range(3):
            os.kill(pid, signal.SIGSTOP)
            time.sleep(0.02)  # the injected 20 ms stop, not a synchronisation
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.1)

    c = _run_child(1500, stop_three_times)
    assert c["deadline_misses"] >= 3 * 15, c
    assert sum(c[k] for k in CAUSES) == c["deadline_misses"], c
    assert c["misses_late_wake"] >= 3 * 15, c
