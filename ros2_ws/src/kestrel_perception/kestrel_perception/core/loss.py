"""Messages lost before the node sees them, counted from gaps in each sensor's stamps.

Pure Python (no rclpy). The sensor subscriptions keep one message (depth 1, SENSOR_QOS): when
the node falls behind, DDS overwrites the unread message, and the node never learns of it. A
ROS 2 Header has no sequence number, so the loss is read from the stamps:

- Each sensor's expected period is the median of its last WINDOW stamp deltas (stamp of a
  message - stamp of the previous one received of that sensor), learned from deltas with no
  gap: a delta longer than GAP_FACTOR x the period is a gap and is not learned from. Until
  MIN_DELTAS deltas are learned nothing is counted.
- A gap of k periods (k = round(delta / period)) is k - 1 lost messages, added to the sensor's
  `lost_<sensor>` counter (/diagnostics).
- A delta longer than `max_gap_s` (the node's sync.jump_back) is a discontinuity (the sensor
  was silent, or time jumped forward), and a stamp at or before the previous one is time going
  backwards (or a message out of order): neither is counted, the next delta starts from it.
- What is counted: messages that never reached the node. With receive.mode 'executor' the
  stamp is taken before validation, so a bad message counts under its own reason only; with
  receive.mode 'processes' a message the receiver process dropped as bad (counted there) is
  a gap at the node, so it counts as lost too.
- A sensor that really slowed down looks like a sustained gap: after RELEARN consecutive gaps
  the period is learned again from them (so a loss on every message for that long is then
  taken for a slower sensor; the synchroniser's own counters still show the node falling
  behind).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

WINDOW = 32  # deltas the period is the median of
MIN_DELTAS = 4  # deltas learned before any gap is counted
GAP_FACTOR = 1.5  # a delta longer than this many periods is a gap
RELEARN = 64  # consecutive gaps after which the period is learned from the gaps


class StampGaps:
    """Counts the messages lost in one sensor's stamp sequence. Thread-safe."""

    def __init__(self, name: str, max_gap_s: float,
                 count: Callable[[str, int], Any] | None = None) -> None:
        if not max_gap_s > 0:
            raise ValueError(f"max_gap_s = {max_gap_s}: must be > 0")
        self.counter = f"lost_{name}"
        self.max_gap_ns = int(round(max_gap_s * 1e9))
        self.lost = 0
        self._count = count or (lambda name, n: None)
        self._deltas: deque[int] = deque(maxlen=WINDOW)
        self._gaps: deque[int] = deque(maxlen=RELEARN)  # consecutive gap deltas
        self._period_ns = 0  # 0 = not learned yet
        self._last_ns: int | None = None
        self._lock = threading.Lock()

    @property
    def period_ns(self) -> int:
        """The learned period, ns (0 until MIN_DELTAS deltas are learned)."""
        return self._period_ns

    def restart(self) -> None:
        """Forget the previous stamp (the node stopped taking messages for a while); the
        learned period is kept."""
        with self._lock:
            self._last_ns = None
            self._gaps.clear()

    def add(self, stamp_ns: int) -> int:
        """One received message's stamp; returns the messages found lost before it."""
        with self._lock:
            last, self._last_ns = self._last_ns, stamp_ns
            if last is None or stamp_ns <= last:
                return 0
            dt = stamp_ns - last
            if dt > self.max_gap_ns:
                return 0
            p = self._period_ns
            if p and dt > GAP_FACTOR * p:
                lost = max(round(dt / p) - 1, 1)
                self.lost += lost
                self._count(self.counter, lost)
                self._gaps.append(dt)
                if len(self._gaps) >= RELEARN:
                    self._relearn()
                return lost
            self._gaps.clear()
            self._deltas.append(dt)
            if len(self._deltas) >= MIN_DELTAS:
                self._period_ns = _median(self._deltas)
            return 0

    def _relearn(self) -> None:
        self._deltas = deque(self._gaps, maxlen=WINDOW)
        self._gaps.clear()
        self._period_ns = _median(self._deltas)


def _median(values: deque[int]) -> int:
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) // 2
