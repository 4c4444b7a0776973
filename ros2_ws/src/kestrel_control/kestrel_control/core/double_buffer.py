"""Latest-value double buffer: one writer thread publishes, one real-time reader takes the newest.

Seqlock over two preallocated numpy slots:
- the writer (a subscription callback) fills the slot that is NOT published, bumping that slot's
  sequence number to odd before and to even after the copy, then publishes the slot index;
- the reader copies the published slot into a caller-provided array and re-checks the slot's
  sequence number: if it changed (the writer came back to this slot during the copy) or was odd,
  the read is retried. No lock and no allocation on the reader's path.

numpy releases the GIL for copies of more than a few hundred elements, so without the sequence
check a reader could see half of one write and half of the next; the stress test shows both.
Writers serialise on a lock (several callback threads may write); the reader never takes it.
After `max_retries` failed optimistic reads (a writer faster than the copy, or one stuck inside
its fill callback) the reader returns its own previous complete value, with that value's
version and stamp (so the age check sees how old it is), and counts it in `locked_reads` (the
diagnostic's historical name). It used to wait for the writer's lock there: the real-time
thread then waited on an executor thread running a Python callback.

Why the slots are plain (pageable) memory, not pinned: the GPU never reads them. Between a slot
and the device sit the checks the loop must make first (stale, finite, plausible), the latency
prediction and the observation layout (policy_io.py), so the loop reads the slot into its own
float64 row (a few hundred bytes) and writes the float32 observation into the backend's
pinned `obs_host`, which the captured graph copies to the device asynchronously. A pinned slot
would save no copy: the GPU would still need the checked, compensated row. (In the loop process
the slots live in POSIX shared memory: shm_control.SharedLatestValue.)
"""

from __future__ import annotations

import threading

import numpy as np


class LatestValueBuffer:
    """Newest-value buffer of a fixed-shape numpy array, with a stamp (int ns)."""

    def __init__(self, shape: int | tuple[int, ...], dtype: np.dtype | type = np.float64,
                 *, max_retries: int = 64) -> None:
        if max_retries < 1:
            raise ValueError(f"parameter 'max_retries' = {max_retries!r}: must be >= 1")
        self._slots = (np.zeros(shape, dtype=dtype), np.zeros(shape, dtype=dtype))
        self._seq = [0, 0]  # per slot: odd while being written
        self._stamps = [0, 0]  # per slot: stamp of the value, int ns
        self._versions = [0, 0]  # per slot: publish count at the time it was written
        self._published = 0  # index of the slot holding the newest complete value
        self._version = 0  # number of published writes; 0 = never written
        self._write_lock = threading.Lock()
        self._max_retries = int(max_retries)
        self.read_retries = 0  # optimistic reads that had to be retried (diagnostic)
        self.locked_reads = 0  # reads that gave up and returned the previous value (diagnostic)
        # the reader's own last complete value, version and stamp (its fallback)
        self._good = np.zeros(shape, dtype=dtype)
        self._good_version = 0
        self._good_stamp = 0

    @property
    def shape(self) -> tuple[int, ...]:
        return self._slots[0].shape

    @property
    def dtype(self) -> np.dtype:
        return self._slots[0].dtype

    @property
    def version(self) -> int:
        """Number of writes published so far (0 = nothing written yet)."""
        return self._version

    def clear(self) -> None:
        """Forget every value: version 0 again, as never written (activation: nothing from
        before may be read). Call while no reader runs; writers wait on the lock."""
        with self._write_lock:
            for slot in self._slots:
                slot.fill(0)
            self._seq[:] = [0, 0]
            self._stamps[:] = [0, 0]
            self._versions[:] = [0, 0]
            self._published = 0
            self._version = 0
            self._good.fill(0)
            self._good_version = self._good_stamp = 0

    # ---- writer side -----------------------------------------------------------------------
    def write(self, value: np.ndarray, stamp_ns: int = 0) -> int:
        """Copy `value` (broadcastable to `shape`) in and publish it. Returns the new version."""
        with self._write_lock:
            idx = 1 - self._published
            self._seq[idx] += 1  # odd: being written
            np.copyto(self._slots[idx], value, casting="unsafe")
            return self._finish(idx, stamp_ns)

    def write_with(self, fill, stamp_ns: int = 0) -> int:
        """Zero-copy write: `fill(slot)` writes the value in place into the unpublished slot.

        If `fill` raises, nothing is published and the exception propagates (the slot is marked
        complete again but stays unpublished).
        """
        with self._write_lock:
            idx = 1 - self._published
            self._seq[idx] += 1
            try:
                fill(self._slots[idx])
            except BaseException:
                self._seq[idx] += 1  # back to even; still not published
                raise
            return self._finish(idx, stamp_ns)

    def _finish(self, idx: int, stamp_ns: int) -> int:
        self._stamps[idx] = int(stamp_ns)
        self._versions[idx] = self._version + 1
        self._seq[idx] += 1  # even: complete
        self._published = idx
        self._version += 1
        return self._version

    # ---- reader side -----------------------------------------------------------------------
    def read_into(self, out: np.ndarray) -> tuple[int, int]:
        """Copy the newest complete value into `out` (shape `shape`). No allocation, no lock,
        no wait.

        Returns (version, stamp_ns) of the value read; version 0 means nothing was ever written
        (then `out` receives the initial zeros). When every try is torn, this reader's previous
        value comes back with its own (older) version and stamp (`locked_reads` counts it).
        """
        slots, seq = self._slots, self._seq
        for _ in range(self._max_retries):
            idx = self._published
            s1 = seq[idx]
            if s1 & 1:  # the writer wrapped around onto this slot already
                self.read_retries += 1
                continue
            np.copyto(out, slots[idx])
            version = self._versions[idx]
            stamp = self._stamps[idx]
            if seq[idx] == s1:
                np.copyto(self._good, out)
                self._good_version, self._good_stamp = version, stamp
                return version, stamp
            self.read_retries += 1
        # Bounded fallback, never a wait: the previous complete value (older stamp, counted).
        self.locked_reads += 1
        np.copyto(out, self._good)
        return self._good_version, self._good_stamp

    def read(self) -> tuple[np.ndarray, int, int]:
        """Allocating convenience read (not for the hot path): (copy, version, stamp_ns)."""
        out = np.empty_like(self._slots[0])
        version, stamp = self.read_into(out)
        return out, version, stamp
