"""Why a late cycle was late: the loop thread's own scheduler statistics around it.

A deadline miss has four kinds of cause, and each has a different fix:
- **preempted**: another task of this OS had the loop's CPU while the loop thread was runnable
  (it waited on the run queue). Fix: SCHED_FIFO (`rt_priority`), a shielded CPU.
- **blocked**: the loop thread left its CPU on its own beyond its sleep: waiting for the GIL
  held by another Python thread of the process, a lock, a blocking wait in the step, a stop.
  Fix: loop.mode process (the loop in its own interpreter), a shorter loop.gil_switch_interval_us.
- **late wake**: the thread woke late without either: the time was taken without a context
  switch (interrupt handlers, or the hypervisor not running the virtual CPU: steal), or the
  sleep's timer fired late. No scheduler setting in the guest fixes it; on a VM it is the
  host's.
- **slow step**: the step itself outlasted what the period left: its work, or time lost while
  it ran without a context switch.

Sources, both cumulative, for the loop thread: `run_delay` in /proc/thread-self/schedstat (ns
spent runnable but not running; CONFIG_SCHED_INFO, on in mainstream kernels; it runs on the
run queue's clock, so steal while the thread is queued counts as preempted, steal while it runs
does not) and `ru_nvcsw` of getrusage(RUSAGE_THREAD) (voluntary context switches: a sleep, a
futex wait for the GIL, a stop; not a preemption, which is `ru_nivcsw`). Both are read into
preallocated buffers right after each cycle's end time (also the next cycle's start, before
the sleep), and run_delay again just before the wake-up time is taken (it delays the step by
the time of that read); parsed only when a cycle is late. The reads go
through ctypes.PyDLL, which keeps the GIL: os.pread releases and retakes it every cycle, and a
loop that spins the whole period then starves every other thread of the interpreter (a waiting
thread only forces a switch after the switch interval without one, so loop.start() could
take seconds to return).

The rule, for a cycle that ended `overrun` after its next deadline:
1. preempted if the run-queue wait that could delay the deadline is at least the overrun: the
   wait during the step, plus the wait before the wake-up up to the wake error (a wait during
   the spin that still woke on time cost nothing);
2. else blocked if the thread switched out voluntarily more often than its sleep explains
   during the cycle;
3. else late wake if the wake error is at least the overrun, else slow step.
The four counters add up to `deadline_misses`.
"""

from __future__ import annotations

import ctypes
import os
from resource import RUSAGE_THREAD

__all__ = ["MissAttributor", "CAUSES"]

CAUSES = ("misses_preempted", "misses_blocked", "misses_late_wake", "misses_slow_step")
_SCHEDSTAT = "/proc/thread-self/schedstat"
_BUF = 128  # schedstat is three decimal integers: < 64 bytes
_RU_LONGS = 18  # struct rusage on 64-bit Linux: 2 timevals + 14 longs = 144 bytes
_RU_NVCSW = 16  # ru_nvcsw: the 13th long after the two timevals (byte 128)


def _libc_keeping_gil():
    """PyDLL: calls keep the GIL (module docstring). No argtypes: the loop passes prebuilt
    ctypes arguments (cheaper per call than converting Python ints)."""
    libc = ctypes.PyDLL(None, use_errno=True)
    libc.pread.restype = ctypes.c_ssize_t
    libc.getrusage.restype = ctypes.c_int
    return libc


class MissAttributor:
    """Created and used on the loop thread (the file names the thread that opens it).

    Readings at two moments of each cycle: `mark_end()` right after the cycle's end time (it is
    also the next cycle's start: every instant of the loop falls in exactly one cycle, so a
    switch between a cycle's end and the next cycle's first read is not lost) and `mark_wake()`
    right before its wake-up time. `cause()` compares the three readings of a late cycle."""

    def __init__(self, path: str = _SCHEDSTAT) -> None:
        self._fd = -1
        self.status = "unavailable"
        # schedstat text at: the cycle's start (= the previous cycle's end), its wake-up, its end
        self._start, self._wake, self._end = (ctypes.create_string_buffer(_BUF)
                                              for _ in range(3))
        # struct rusage (ru_nvcsw) at the cycle's start and end only: the wake-up read is the
        # one in the command's path, so it is one pread
        self._ru_start, self._ru_end = ((ctypes.c_long * _RU_LONGS)() for _ in range(2))
        try:
            libc = _libc_keeping_gil()
            self._pread, self._getrusage = libc.pread, libc.getrusage
            fd = os.open(path, os.O_RDONLY)
        except (OSError, AttributeError) as exc:
            self.status = f"unavailable: {path} ({exc})"
            return
        self._fd = fd
        # prebuilt arguments: fd, read size, offset, RUSAGE_THREAD
        self._cfd, self._size = ctypes.c_int(fd), ctypes.c_size_t(_BUF - 1)
        self._off, self._who = ctypes.c_long(0), ctypes.c_int(RUSAGE_THREAD)
        try:
            if self._pread(self._cfd, self._end, self._size, self._off) <= 0:
                raise OSError(ctypes.get_errno(), "pread failed")
            # pcount >= 1 on a running thread where the kernel keeps these statistics (kernels
            # < 5.14 without SCHEDSTATS print zeros). Not sum_exec_runtime: a thread that has
            # not been switched out or ticked yet still shows 0 there (seen on a fresh thread).
            if _fields(self._end)[2] <= 0:
                raise ValueError("pcount 0: scheduler statistics are off")
            if self._getrusage(self._who, self._ru_end) != 0:
                raise OSError(ctypes.get_errno(), "getrusage(RUSAGE_THREAD) failed")
        except (OSError, ValueError, IndexError) as exc:
            self.close()
            self.status = f"unavailable: {path} ({exc!r})"
            return
        self.status = f"on ({path} run_delay, getrusage ru_nvcsw)"

    @property
    def available(self) -> bool:
        return self._fd >= 0

    def mark_end(self) -> None:
        """Right after a cycle's end time (and once before the first cycle, done by __init__):
        this cycle's end and the next one's start. Never raises (the loop calls it): a failed
        read leaves an older reading, which can only hide a cause, not invent one."""
        self._start, self._end = self._end, self._start
        self._ru_start, self._ru_end = self._ru_end, self._ru_start
        self._pread(self._cfd, self._end, self._size, self._off)
        self._getrusage(self._who, self._ru_end)

    def mark_wake(self) -> None:
        """Just before the loop takes its wake-up time (after the spin; it delays the step by the
        time of one read). Never raises."""
        self._pread(self._cfd, self._wake, self._size, self._off)

    def cause(self, wake_error_ns: int, overrun_ns: int, slept: bool) -> int:
        """Index into CAUSES for the cycle just ended (after its `mark_end()`), which ended
        `overrun_ns` (> 0) after its next deadline and woke `wake_error_ns` after its own;
        `slept`: it slept before the spin (one voluntary switch is then its own)."""
        try:
            d0, d1, d2 = (_fields(b)[1] for b in (self._start, self._wake, self._end))
        except (ValueError, IndexError):
            return CAUSES.index("misses_slow_step") if wake_error_ns < overrun_ns else \
                CAUSES.index("misses_late_wake")
        waited = (d2 - d1) + min(d1 - d0, max(wake_error_ns, 0))
        if waited >= overrun_ns:
            return 0
        if self._ru_end[_RU_NVCSW] - self._ru_start[_RU_NVCSW] > int(slept):
            return 1  # switched out on its own beyond its sleep: the GIL, a lock, a stop
        return 2 if wake_error_ns >= overrun_ns else 3

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _fields(buf: ctypes.Array) -> tuple[int, int, int]:
    """schedstat = 'sum_exec_runtime run_delay pcount' (ns, ns, count). A shorter read leaves
    the end of a longer one behind its newline: the first three fields are always this read's."""
    f = buf.value.split()
    return int(f[0]), int(f[1]), int(f[2])
