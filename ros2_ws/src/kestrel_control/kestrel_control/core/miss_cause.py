"""Why a late cycle was late: the loop thread's own scheduler statistics around it.

A deadline miss has three kinds of cause, and each has a different fix:
- **preempted**: another task of this OS had the loop's CPU while the loop thread was runnable
  (it waited on the run queue). Fix: SCHED_FIFO (`rt_priority`), a shielded CPU.
- **late wake**: the thread woke late without waiting on a run queue in this OS: the time was
  taken without a context switch (interrupt handlers, or the hypervisor not running the
  virtual CPU: steal), or the sleep's timer fired late. No scheduler setting in the guest fixes
  it; on a VM it is the host's.
- **slow step**: the step itself outlasted the period: its work, a blocking wait inside it, or
  time lost while it ran.

Source: /proc/thread-self/schedstat of the loop thread (`run_delay`: ns spent runnable but not
running, cumulative; CONFIG_SCHED_INFO, on in mainstream kernels). One pread per cycle (~1 us on
the dev CPU, taken before the sleep, so outside the step's timing) into a preallocated buffer;
it is parsed only when a cycle is late. The pread goes through ctypes.PyDLL, which keeps the
GIL: os.pread releases and retakes it every cycle, and a loop that spins the whole period then
starves every other thread of the interpreter (a waiting thread only forces a switch after
5 ms without one; measured here: loop.start() returned after 22 s instead of 0.09 s).
The rule: a miss is "preempted" when the run-queue wait during the cycle is at least the
overrun (without the wait the deadline would have been met), else "late wake" when the wake
error is at least the overrun, else "slow step". The three counters add up to
`deadline_misses`.
"""

from __future__ import annotations

import ctypes
import os

__all__ = ["MissAttributor", "CAUSES"]

CAUSES = ("misses_preempted", "misses_late_wake", "misses_slow_step")
_SCHEDSTAT = "/proc/thread-self/schedstat"
_BUF = 128  # schedstat is three decimal integers: < 64 bytes


def _pread_keeping_gil():
    libc = ctypes.PyDLL(None, use_errno=True)  # PyDLL: no GIL release (module docstring)
    fn = libc.pread
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_long]
    fn.restype = ctypes.c_ssize_t
    return fn


class MissAttributor:
    """Created and used on the loop thread (the file names the thread that opens it)."""

    def __init__(self, path: str = _SCHEDSTAT) -> None:
        self._fd = -1
        self.status = "unavailable"
        self._mark = ctypes.create_string_buffer(_BUF)  # at cycle start
        self._now = ctypes.create_string_buffer(_BUF)  # at a miss
        try:
            self._pread = _pread_keeping_gil()
            fd = os.open(path, os.O_RDONLY)
        except (OSError, AttributeError) as exc:
            self.status = f"unavailable: {path} ({exc})"
            return
        self._fd = fd
        try:
            if self._pread(fd, self._mark, _BUF - 1, 0) <= 0:
                raise OSError(ctypes.get_errno(), "pread failed")
            _run_delay(self._mark)
        except (OSError, ValueError, IndexError) as exc:
            self.close()
            self.status = f"unavailable: {path} ({exc!r})"
            return
        self.status = f"on ({path} run_delay)"

    @property
    def available(self) -> bool:
        return self._fd >= 0

    def mark(self) -> None:
        """Cycle start (before the sleep): remember the thread's cumulative run-queue wait.
        Never raises (the loop calls it): a failed read keeps the previous mark, so the wait is
        over-counted, never missed."""
        self._pread(self._fd, self._mark, _BUF - 1, 0)

    def cause(self, wake_error_ns: int, overrun_ns: int) -> int:
        """Index into CAUSES for the cycle since `mark()`, which ended `overrun_ns` (> 0) after
        its next deadline and woke `wake_error_ns` after its own."""
        try:
            if self._pread(self._fd, self._now, _BUF - 1, 0) <= 0:
                raise OSError("pread of schedstat failed")
            waited = _run_delay(self._now) - _run_delay(self._mark)
        except (OSError, ValueError, IndexError):
            waited = 0
        if waited >= overrun_ns:
            return 0
        if wake_error_ns >= overrun_ns:
            return 1
        return 2

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _run_delay(buf: ctypes.Array) -> int:
    """schedstat = 'sum_exec_runtime run_delay pcount' (ns, ns, count). A shorter read leaves
    the end of a longer one behind its newline: the first two fields are always this read's."""
    return int(buf.value.split()[1])
