"""Shared-memory regions between the control node and its loop process (`loop.mode: process`).

One POSIX shared-memory segment holds, at offsets that both sides compute with `ShmLayout`:
  control  int64 [8]   control words (CTRL_*): loop state, clock mode, sim time ns, ...
  aux      float64 [4] compute latency EMA s (child writes, node reads)
  per robot r: joint states [2, n] (positions rad; velocities rad/s), target [n] rad (node
             writes, loop reads) and command [n] rad (loop writes, node's publisher reads), each
             a `SharedLatestValue`;
  stats    the loop's `LoopStats` counters + timing rings (`SharedLoopStats`; loop writes, the
           node's 10 Hz reporter reads).

`SharedLatestValue` is `LatestValueBuffer`'s seqlock across processes: per slot a sequence number
(odd while written), a stamp and a version, plus the published slot index, all int64 in the
segment. One writer process per buffer (threads of that process serialise on a local lock);
the reader retries a read whose slot sequence was odd or changed during the copy, and after
`max_retries` failed tries returns its own last complete value (counted in `failed_reads`):
never a torn value, never a lock shared with the other process. The ordering argument needs
stores seen in program order by the other core (x86-64 TSO, where this runs; numpy element
stores are plain stores); weakly ordered CPUs (ARM) would need fences, not provided here, so
`control_params.resolve_loop_mode` refuses process mode on them (the C tick's own reads and
writes use C11 atomics, but the node's Python writes do not).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import numpy as np

from kestrel_common.shm import Arena as _Arena
from kestrel_common.shm import ShmSegment  # noqa: F401 - re-exported (loop process, tests)

from kestrel_control.core.stats import LoopStats, Ring

# CPUs whose stores other cores see in program order (TSO): the only ones the Python side of
# these seqlocks is correct on (no fences here)
TSO_MACHINES = ("x86_64", "amd64", "i386", "i686", "x86")


def _arch(machine: str | None) -> str:
    import platform

    return (machine or platform.machine()).lower()


def stores_ordered(machine: str | None = None) -> bool:
    """True on a TSO CPU (x86), where this module's Python seqlock writes are safe."""
    return _arch(machine) in TSO_MACHINES


def require_ordered_stores(machine: str | None = None) -> None:
    """ValueError naming loop.mode on a weakly ordered CPU (ARM): see the module docstring."""
    arch = _arch(machine)
    if arch not in TSO_MACHINES:
        raise ValueError(
            f"parameter 'loop_mode' = 'process': its shared-memory buffers rely on x86's store "
            f"ordering and this CPU is {arch}; use loop_mode: thread (or auto)")


# control words (int64)
CTRL_STATE, CTRL_CLOCK_MODE, CTRL_SIM_TIME_NS, CTRL_NO_CLOCK = 0, 1, 2, 3
CTRL_COMMANDS, CTRL_PARENT_PID = 4, 5
STATE_STARTING, STATE_READY, STATE_RUNNING = 0, 1, 2
CLOCK_SYSTEM, CLOCK_SIM = 0, 1  # node clock: time.time_ns() or the last /clock value (shm)
AUX_COMPUTE_LATENCY = 0

# SharedLatestValue header (int64)
_H_PUB, _H_VER, _H_SEQ, _H_STAMP, _H_SLOTVER, _H_RETRIES, _H_FAILED = 0, 1, 2, 4, 6, 8, 9
_HEADER = 10
class SharedLatestValue:
    """Newest-value double buffer in shared memory, float64 of a fixed shape, with a stamp."""

    def __init__(self, header: np.ndarray, slots: np.ndarray, *, max_retries: int = 64) -> None:
        if max_retries < 1:
            raise ValueError(f"parameter 'max_retries' = {max_retries!r}: must be >= 1")
        self._h = header  # int64 [_HEADER], in the segment
        # the hot paths (write, read_into) index the header through a memoryview: plain
        # int64 loads/stores, cheaper than numpy scalar access
        self._hv = memoryview(header).cast("B").cast("q")
        self._slots = (slots[0], slots[1])  # float64 [*shape] each, in the segment
        self._max_retries = int(max_retries)
        self._good = np.zeros_like(slots[0])  # this reader's last complete value (private)
        # its (version, stamp): int64 [2], so that the loop process's C tick (native_tick.c),
        # which reads through the same fallback, keeps them current too
        self._good_vs = np.zeros(2, dtype=np.int64)
        self._gvs = memoryview(self._good_vs).cast("B").cast("q")
        self._write_lock = threading.Lock()  # writer threads of ONE process

    @property
    def shape(self) -> tuple[int, ...]:
        return self._slots[0].shape

    @property
    def dtype(self) -> np.dtype:
        return self._slots[0].dtype

    @property
    def version(self) -> int:
        return self._hv[_H_VER]

    @property
    def read_retries(self) -> int:
        return int(self._h[_H_RETRIES])

    @property
    def locked_reads(self) -> int:
        """Reads that gave up and returned the reader's previous value (name as in
        LatestValueBuffer's diagnostics)."""
        return int(self._h[_H_FAILED])

    def clear(self) -> None:
        """Zero everything: version 0 again, as never written, and this reader's fallback
        value (in place: the C tick holds their addresses). Only while no reader or writer
        runs (start-up; activation, before the loop starts and the callbacks write)."""
        with self._write_lock:
            self._h[:] = 0
            self._slots[0][...] = 0.0
            self._slots[1][...] = 0.0
            self._good.fill(0.0)
            self._good_vs.fill(0)

    # ---- writer ------------------------------------------------------------------------------
    def write(self, value: np.ndarray, stamp_ns: int = 0) -> int:
        # the loop process's tick writes every command here: `_finish`'s stores are inlined
        # (a call is a noticeable share of the write)
        with self._write_lock:
            h = self._hv
            idx = 1 - h[_H_PUB]
            seq = h[_H_SEQ + idx]
            h[_H_SEQ + idx] = seq + 1  # odd: being written
            self._slots[idx][...] = value  # unsafe casting, as np.copyto(..., "unsafe")
            version = h[_H_VER] + 1
            h[_H_STAMP + idx] = stamp_ns
            h[_H_SLOTVER + idx] = version
            h[_H_SEQ + idx] = seq + 2  # even: complete
            h[_H_PUB] = idx
            h[_H_VER] = version
            return version

    def write_with(self, fill, stamp_ns: int = 0) -> int:
        """`fill(slot)` writes the value in place; if it raises nothing is published."""
        with self._write_lock:
            h = self._hv
            idx = 1 - h[_H_PUB]
            h[_H_SEQ + idx] += 1
            try:
                fill(self._slots[idx])
            except BaseException:
                h[_H_SEQ + idx] += 1
                raise
            return self._finish(idx, stamp_ns)

    def _finish(self, idx: int, stamp_ns: int) -> int:
        """Publish slot `idx` (written, its sequence odd): stamp, version, then even again."""
        h = self._hv
        version = h[_H_VER] + 1
        h[_H_STAMP + idx] = int(stamp_ns)
        h[_H_SLOTVER + idx] = version
        h[_H_SEQ + idx] += 1  # even: complete
        h[_H_PUB] = idx
        h[_H_VER] = version
        return version

    # ---- reader ------------------------------------------------------------------------------
    def read_into(self, out: np.ndarray) -> tuple[int, int]:
        """Copy the newest complete value into `out`; (version, stamp_ns). No lock, no
        allocation; version 0 = never written."""
        h, slots = self._hv, self._slots
        item = h.__getitem__  # int64 element -> int (memoryview: no numpy scalar)
        for _ in range(self._max_retries):
            idx = item(_H_PUB)
            s1 = item(_H_SEQ + idx)
            if s1 & 1:
                h[_H_RETRIES] += 1
                continue
            out[...] = slots[idx]
            version = item(_H_SLOTVER + idx)
            stamp = item(_H_STAMP + idx)
            if item(_H_SEQ + idx) == s1:
                self._good[...] = out
                gvs = self._gvs
                gvs[0] = version
                gvs[1] = stamp
                return version, stamp
            h[_H_RETRIES] += 1
        h[_H_FAILED] += 1  # the writer outpaced every try: the previous complete value
        np.copyto(out, self._good)
        return self._gvs[0], self._gvs[1]

    def read(self) -> tuple[np.ndarray, int, int]:
        out = np.empty_like(self._slots[0])
        version, stamp = self.read_into(out)
        return out, version, stamp


class _SharedRing(Ring):
    """Ring whose samples and count live in the segment."""

    def __init__(self, buf: np.ndarray, counts: np.ndarray, index: int) -> None:
        self.buf, self.capacity = buf, int(buf.shape[0])
        self._counts, self._index = counts, index

    @property
    def count(self) -> int:  # type: ignore[override]
        return int(self._counts[self._index])

    @count.setter
    def count(self, value: int) -> None:
        self._counts[self._index] = value


def _counter(i: int) -> property:
    def get(self) -> int:
        return int(self._ints[i])

    def set_(self, value: int) -> None:
        self._ints[i] = value

    return property(get, set_)


class SharedLoopStats(LoopStats):
    """LoopStats whose counters and rings live in the segment: the loop process records, the
    node's reporter takes windows and percentiles (its window marks are its own)."""

    # counters, then the four ring counts (period, wake_error, step_latency, wake_time)
    _N_INTS = len(LoopStats.COUNTERS) + 4

    def __init__(self, period_target_s: float, ints: np.ndarray, rings: np.ndarray) -> None:
        if not period_target_s > 0:
            raise ValueError(f"parameter 'period_target_s' = {period_target_s!r}: must be > 0")
        self.period_target = float(period_target_s)
        self._ints = ints
        k = len(LoopStats.COUNTERS)
        self.period = _SharedRing(rings[0], ints, k)
        self.wake_error = _SharedRing(rings[1], ints, k + 1)
        self.step_latency = _SharedRing(rings[2], ints, k + 2)
        self.wake_time = _SharedRing(rings[3], ints, k + 3)
        self.window_end_wake_ns = 0  # reader side (this view's snapshots)
        self._win_cycles = self._win_period = self._win_wake = self._win_latency = 0
        # record(): element access through memoryviews (plain stores) instead of
        # numpy scalar indexing behind properties (a third of the cost per cycle)
        self._iv = memoryview(ints).cast("B").cast("q")
        self._rv = [memoryview(rings[i]).cast("B").cast("d") for i in range(4)]
        self._cap = int(rings.shape[1])
        self._k = k
        self._ci = LoopStats.COUNTERS.index("cycles")

    def record(self, wake_error_s: float, latency_s: float, period_s: float | None,
               wake_ns: int = 0) -> None:
        """LoopStats.record on the segment: the same stores in the same order (samples, then
        their counts, then cycles)."""
        iv, k, cap = self._iv, self._k, self._cap
        c = iv[k + 3]
        self._rv[3][c % cap] = wake_ns * 1e-9  # wake_time first (see LoopStats.record)
        iv[k + 3] = c + 1
        c = iv[k + 1]
        self._rv[1][c % cap] = wake_error_s
        iv[k + 1] = c + 1
        c = iv[k + 2]
        self._rv[2][c % cap] = latency_s
        iv[k + 2] = c + 1
        if period_s is not None:
            c = iv[k]
            self._rv[0][c % cap] = period_s
            iv[k] = c + 1
        iv[self._ci] += 1

    def release(self) -> None:
        """Drop the memoryviews (before the segment's mmap is closed)."""
        self._iv.release()
        for v in self._rv:
            v.release()

    def _window(self, advance: bool) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
        # The writer is another process (no GIL between us): a snapshot can fall between its
        # ring pushes and `cycles += 1`. Count the window's cycles by its step-latency samples
        # (one per cycle) so a window never reports cycles without samples.
        n_window, period, wake, latency = super()._window(advance)
        return latency.shape[0], period, wake, latency

    def reset_window(self) -> None:
        """Reader side: start windows from the current (just reset) counts."""
        self._win_cycles = self.cycles
        self._win_period, self._win_wake, self._win_latency = (
            self.period.count, self.wake_error.count, self.step_latency.count)


for _i, _name in enumerate(LoopStats.COUNTERS):
    setattr(SharedLoopStats, _name, _counter(_i))


@dataclass(frozen=True)
class ShmLayout:
    """Sizes that fix the segment's layout (both processes build the same views)."""

    num_robots: int
    num_joints: int
    period_s: float
    stats_capacity: int = 16384

    def __post_init__(self) -> None:
        for name in ("num_robots", "num_joints", "stats_capacity"):
            if getattr(self, name) < 1:
                raise ValueError(f"parameter '{name}' = {getattr(self, name)!r}: must be >= 1")
        if not (math.isfinite(self.period_s) and self.period_s > 0):
            raise ValueError(f"parameter 'period_s' = {self.period_s!r}: must be > 0")

    def _build(self, arena: _Arena) -> dict:
        n = self.num_joints
        views: dict = {"control": arena.take(8, np.int64), "aux": arena.take(4, np.float64),
                       "js": [], "target": [], "command": []}
        for _ in range(self.num_robots):
            for key, shape in (("js", (2, n)), ("target", (n,)), ("command", (n,))):
                views[key].append((arena.take(_HEADER, np.int64),
                                   arena.take((2, *shape), np.float64)))
        views["stats_ints"] = arena.take(SharedLoopStats._N_INTS, np.int64)
        views["stats_rings"] = arena.take((4, self.stats_capacity), np.float64)
        return views

    @property
    def size(self) -> int:
        arena = _Arena()
        self._build(arena)
        return arena.offset


class ShmViews:
    """The typed views of one segment (`buf`: a writable buffer of at least `layout.size`)."""

    def __init__(self, buf, layout: ShmLayout) -> None:
        self.layout = layout
        v = layout._build(_Arena(buf))
        self.control: np.ndarray = v["control"]  # int64 [8], CTRL_*
        self.aux: np.ndarray = v["aux"]  # float64 [4], AUX_*
        self.joint_states = [SharedLatestValue(h, s) for h, s in v["js"]]  # [2, n] each
        self.targets = [SharedLatestValue(h, s) for h, s in v["target"]]  # [n] rad each
        self.commands = [SharedLatestValue(h, s) for h, s in v["command"]]  # [n] rad each
        self.stats = SharedLoopStats(layout.period_s, v["stats_ints"], v["stats_rings"])
        self._arrays = [self.control, self.aux, v["stats_ints"], v["stats_rings"]]

    def clear(self) -> None:
        for arr in self._arrays:
            arr[...] = 0
        for buf in (*self.joint_states, *self.targets, *self.commands):
            buf.clear()

    def release(self) -> None:
        """Drop every view (needed before the segment's mmap can be closed)."""
        if self.stats is not None:
            self.stats.release()
        for name in ("control", "aux", "joint_states", "targets", "commands", "stats",
                     "_arrays"):
            setattr(self, name, None)
