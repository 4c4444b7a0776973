"""Periodic real-time loop on a dedicated thread, with absolute deadlines.

Deadline k is `t0 + k * period` on CLOCK_MONOTONIC (time.monotonic_ns). Each cycle sleeps until
`spin_ns` before the deadline (time.sleep: clock_nanosleep on Linux, Python >= 3.11), then
busy-waits the rest (holding the GIL: other Python threads wait at most `spin_ns`), runs
`step_fn(deadline_ns)` and records wake error, period and step latency into `LoopStats`.
A sleep shorter than MIN_SLEEP_NS is not taken (the loop spins instead): it saves almost no
CPU, and on a virtual machine a short sleep is an idle exit of the virtual CPU plus a timer
wake-up, which makes late wake-ups (docs/benchmarks/control_h200.md).
Overrun: when a cycle ends after the next deadline, the loop skips to the first future deadline
(no catch-up burst) and counts every skipped deadline in `stats.deadline_misses`; so
cycles + deadline_misses == deadlines elapsed. Each miss is also counted by its cause
(preempted / blocked / late wake / slow step, from the loop thread's schedstat: miss_cause.py).

At start the loop thread attempts (each optional, each reported, failures are not fatal):
SCHED_FIFO priority (nice -20 where it is refused) and CPU affinity for itself, mlockall for
the process; then gc.collect(),
gc.freeze() (the warmed-up objects leave the collector's view) and gc.disable(). gc is
process-wide: it stays disabled while the loop runs and is re-enabled on stop (if it was on).
Optionally `sys.setswitchinterval(switch_interval_s)` while running (process-wide, restored on
stop): torch ops release the GIL, and another Python thread that takes it then keeps it up to
the switch interval (5 ms by default) while the loop waits; a shorter interval bounds that
wait.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence

from kestrel_control.core.miss_cause import CAUSES, MissAttributor
from kestrel_control.core.stats import LoopStats

_MCL_CURRENT, _MCL_FUTURE = 1, 2
MIN_SLEEP_NS = 100_000  # shorter sleeps are spun instead (module docstring)
FALLBACK_NICE = -20  # the loop thread's nice value where SCHED_FIFO is refused


def _mlockall() -> str:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.mlockall(_MCL_CURRENT | _MCL_FUTURE) != 0:
        err = ctypes.get_errno()
        return f"failed: {os.strerror(err)} (errno {err})"
    return "applied"


def rt_throttle_check(period_ns: int, spin_ns: int,
                      proc: str = "/proc/sys/kernel") -> str:
    """A SCHED_FIFO loop that sleeps less than the kernel's real-time throttle leaves idle is
    stopped for the rest of every throttle period: with the defaults (sched_rt_runtime_us
    950000 of sched_rt_period_us 1000000) 50 ms in each second: a loop that never sleeps then
    wakes up tens of ms late ("sched: RT throttling activated" in the kernel log). The loop
    sleeps only when more than
    spin_ns + MIN_SLEEP_NS of the period is left after the step, so a spin that leaves less
    than the throttle's idle share (before the step's own time) is flagged here, at start."""
    try:
        with open(f"{proc}/sched_rt_runtime_us") as f:
            runtime = int(f.read())
        with open(f"{proc}/sched_rt_period_us") as f:
            rt_period = int(f.read())
    except (OSError, ValueError):
        return "unknown (sched_rt_runtime_us unreadable)"
    if runtime < 0:
        return "off (sched_rt_runtime_us -1)"
    idle_needed = 1.0 - runtime / rt_period  # share of CPU time the RT class must leave
    # the loop sleeps the whole rest of the period once it exceeds MIN_SLEEP_NS: at most
    # period - spin, minus the step's own time
    rest = period_ns - spin_ns
    idle_max = rest / period_ns if rest > MIN_SLEEP_NS else 0.0
    if idle_max <= idle_needed:
        return (f"warning: spin_s leaves at most {max(idle_max, 0):.0%} of each period to sleep"
                f" and the kernel throttles real-time threads that sleep less than "
                f"{idle_needed:.0%} (sched_rt_runtime_us {runtime} of {rt_period}): expect "
                f"{(rt_period - runtime) / 1e3:.0f} ms stalls; lower spin_s")
    return (f"ok: sleeps up to {idle_max:.0%} of each period minus the step, throttle needs "
            f"{idle_needed:.0%}")


def _eperm_hint(exc: BaseException) -> str:
    """EPERM although the process holds CAP_SYS_NICE: the kernel's real-time group scheduling
    gives the process's cgroup no real-time runtime (a nested cgroup refuses where the cgroup v2
    root accepts). Docker's answer is --cpu-rt-runtime; systemd's, a unit in the root."""
    if not isinstance(exc, PermissionError):
        return ""
    try:
        with open("/proc/self/status") as f:
            caps = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
        with open("/proc/self/cgroup") as f:
            group = f.read().strip().rpartition(":")[2]
    except (OSError, StopIteration, ValueError):
        return ""
    if not caps >> 23 & 1:  # CAP_SYS_NICE
        return " (no CAP_SYS_NICE: grant it, or an rtprio limit)"
    return (f" (CAP_SYS_NICE is held: cgroup {group!r} has no real-time runtime; run the loop "
            "in a cgroup with cpu.rt_runtime_us > 0, e.g. docker --cpu-rt-runtime, or the root)")


def _nice_fallback() -> str:
    """Where SCHED_FIFO is refused, the highest fair-class weight for the calling thread: it
    does not keep a waking task off the CPU as SCHED_FIFO does, but it gives the loop thread
    ~88x a default thread's share of a contended CPU. Needs CAP_SYS_NICE or RLIMIT_NICE too."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), FALLBACK_NICE)
        return f"nice {FALLBACK_NICE} instead: applied"
    except (OSError, AttributeError) as exc:
        return f"nice {FALLBACK_NICE} instead: failed: {exc}"


def apply_realtime_settings(rt_priority: int = 0, cpu_affinity: Sequence[int] | None = None,
                            lock_memory: bool = False) -> dict[str, str]:
    """Try the requested settings for the CALLING thread (mlockall: whole process).

    Returns {'sched_fifo', 'cpu_affinity', 'mlockall'} -> 'applied ...', 'not requested' or
    'failed: <reason>' (a refused SCHED_FIFO tries nice FALLBACK_NICE and says how that went).
    Never raises.
    """
    result: dict[str, str] = {}
    if rt_priority > 0:
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(int(rt_priority)))
            result["sched_fifo"] = f"applied (priority {rt_priority})"
        except (OSError, AttributeError, ValueError) as exc:
            result["sched_fifo"] = f"failed: {exc}{_eperm_hint(exc)}; {_nice_fallback()}"
    else:
        result["sched_fifo"] = "not requested"
    if cpu_affinity:
        try:
            os.sched_setaffinity(0, {int(c) for c in cpu_affinity})
            result["cpu_affinity"] = f"applied (cpus {sorted(os.sched_getaffinity(0))})"
        except (OSError, AttributeError, ValueError) as exc:
            result["cpu_affinity"] = f"failed: {exc}"
    else:
        result["cpu_affinity"] = "not requested"
    if lock_memory:
        try:
            result["mlockall"] = _mlockall()
        except OSError as exc:
            result["mlockall"] = f"failed: {exc}"
    else:
        result["mlockall"] = "not requested"
    return result


class RealtimeLoop:
    """Runs `step_fn(deadline_ns)` every `period_s` on its own thread (see module docstring).

    step_fn: called once per cycle with the cycle's deadline (time.monotonic_ns). Exceptions it
    raises are counted in `stats.step_errors` (last one in `last_error`) and the loop goes on.
    """

    def __init__(self, period_s: float, step_fn: Callable[[int], object], stats: LoopStats, *,
                 spin_s: float = 200e-6, rt_priority: int = 0,
                 cpu_affinity: Sequence[int] | None = None, lock_memory: bool = False,
                 manage_gc: bool = True, switch_interval_s: float | None = None,
                 miss_attribution: bool = True, name: str = "kestrel-rt-loop",
                 log: Callable[[str], None] | None = None) -> None:
        if not (isinstance(period_s, (int, float)) and 0 < period_s <= 10.0):
            raise ValueError(f"parameter 'period_s' = {period_s!r}: must be in (0, 10] s")
        if not 0 <= spin_s < period_s:
            raise ValueError(f"parameter 'spin_s' = {spin_s!r}: must be in [0, period_s)")
        if switch_interval_s is not None and not 1e-6 <= switch_interval_s <= 0.1:
            raise ValueError(f"parameter 'switch_interval_s' = {switch_interval_s!r}: must be in "
                             "[1e-6, 0.1] s")
        if not 0 <= rt_priority <= 99:
            raise ValueError(f"parameter 'rt_priority' = {rt_priority!r}: must be in [0, 99]")
        self.period_ns = int(round(period_s * 1e9))
        self.spin_ns = int(round(spin_s * 1e9))
        self.step_fn = step_fn
        self.stats = stats
        self.rt_priority = int(rt_priority)
        self.cpu_affinity = list(cpu_affinity or [])
        self.lock_memory = bool(lock_memory)
        self.manage_gc = bool(manage_gc)
        self.switch_interval_s = switch_interval_s
        self.miss_attribution = bool(miss_attribution)  # miss_cause.py: two reads per cycle
        self._old_switch_interval = sys.getswitchinterval()
        self.name = name
        self._log = log or logging.getLogger(__name__).info
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._gc_was_enabled = False
        self.applied: dict[str, str] = {}
        self.last_error: str = ""
        self._causes: MissAttributor | None = None
        self._setup_error = ""  # repr of what _setup raised on the loop thread

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, timeout_s: float = 2.0) -> dict[str, str]:
        """Start the thread; wait (bounded) until it applied its settings. Returns what applied.

        RuntimeError if already running, the thread did not come up within `timeout_s`, or its
        setup raised.
        """
        if self.running:
            raise RuntimeError(f"loop '{self.name}' is already running")
        self._stop.clear()
        self._ready.clear()
        self._setup_error = ""
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            self.stop(timeout_s)
            raise RuntimeError(f"loop '{self.name}' did not start within {timeout_s} s")
        if self._setup_error:
            self.stop(timeout_s)
            raise RuntimeError(f"loop '{self.name}' failed to start: {self._setup_error}")
        return dict(self.applied)

    def stop(self, timeout_s: float = 1.0) -> bool:
        """Ask the thread to stop and join it (bounded). True if it has stopped."""
        self._stop.set()
        thread = self._thread
        if thread is None:
            return True
        thread.join(timeout_s)
        if thread.is_alive():
            self._log(f"loop '{self.name}' did not stop within {timeout_s} s (step stuck?)")
            return False
        self._thread = None
        return True

    # ---- the loop thread --------------------------------------------------------------------
    def _setup(self) -> None:
        applied = apply_realtime_settings(self.rt_priority, self.cpu_affinity, self.lock_memory)
        if applied["sched_fifo"].startswith("applied"):
            applied["rt_throttle"] = rt_throttle_check(self.period_ns, self.spin_ns)
        if self.miss_attribution:
            self._causes = MissAttributor()  # opened on the loop thread: its own schedstat
            applied["miss_attribution"] = self._causes.status
        else:
            self._causes = None
            applied["miss_attribution"] = "off (parameter)"
        if self.manage_gc:
            self._gc_was_enabled = gc.isenabled()
            gc.collect()
            gc.freeze()
            gc.disable()
            applied["gc"] = f"frozen ({gc.get_freeze_count()} objects), disabled"
        else:
            applied["gc"] = "not managed"
        if self.switch_interval_s is not None:
            self._old_switch_interval = sys.getswitchinterval()
            sys.setswitchinterval(self.switch_interval_s)
            applied["gil_switch_interval"] = f"{self.switch_interval_s * 1e6:.0f} us"
        else:
            applied["gil_switch_interval"] = "not changed"
        self.applied = applied
        self._log(f"real-time loop '{self.name}' at {1e9 / self.period_ns:.1f} Hz: " + ", ".join(
            f"{k}: {v}" for k, v in applied.items()))

    def _teardown(self) -> None:
        if self._causes is not None:
            self._causes.close()
        if self.switch_interval_s is not None:
            sys.setswitchinterval(self._old_switch_interval)
        if self.manage_gc:
            gc.unfreeze()
            if self._gc_was_enabled:
                gc.enable()

    def _run(self) -> None:
        try:
            self._setup()
        except Exception as exc:  # start() raises it on the caller's thread
            self._teardown()  # safe on a partial setup: each undo restores the saved state
            self._setup_error = repr(exc)
            return
        finally:
            self._ready.set()
        try:
            self._cycle_until_stopped()
        finally:
            self._teardown()

    def _cycle_until_stopped(self) -> None:
        clock = time.monotonic_ns
        sleep = time.sleep
        period, spin = self.period_ns, self.spin_ns
        stats, step, stop = self.stats, self.step_fn, self._stop
        causes = self._causes
        on = causes is not None and causes.available
        mark_end = causes.mark_end if on else None  # the first cycle's start: read at init
        mark_wake = causes.mark_wake if on else None
        t0 = clock() + period
        k = 0
        prev_wake = -1
        while not stop.is_set():
            deadline = t0 + k * period
            remaining = deadline - clock() - spin
            slept = remaining > MIN_SLEEP_NS
            if slept:
                sleep(remaining * 1e-9)
            while clock() < deadline:
                pass  # busy-wait the last `spin` ns
            if mark_wake is not None:
                mark_wake()  # its cost lands in the wake error rather than in the step
            wake = clock()
            try:
                step(deadline)
            except Exception as exc:  # counted, loop goes on
                stats.step_errors += 1
                self.last_error = repr(exc)
            done = clock()
            if mark_end is not None:
                mark_end()  # run-queue wait and switches: this cycle's end, the next's start
            stats.record((wake - deadline) * 1e-9, (done - wake) * 1e-9,
                         (wake - prev_wake) * 1e-9 if prev_wake >= 0 else None, wake)
            prev_wake = wake
            k += 1
            late = done - (t0 + k * period)
            if late > 0:  # deadline k (and maybe more) passed during this cycle: skip them
                skipped = late // period + 1
                stats.deadline_misses += skipped
                if mark_end is not None:  # after deadline_misses: readers take causes first
                    name = CAUSES[causes.cause(wake - deadline, late, slept)]
                    setattr(stats, name, getattr(stats, name) + skipped)
                k += skipped
