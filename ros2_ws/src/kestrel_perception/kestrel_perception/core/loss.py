"""Messages lost before the node sees them, per sensor: `received_<sensor>` and
`lost_<sensor>` on /diagnostics, so that received + lost = what the sensor sent.

Pure Python (no rclpy). The sensor subscriptions keep one message (depth 1, SENSOR_QOS): when
the node falls behind, DDS overwrites the unread message, and the node never learns of it.
`InputLoss` counts each message the node takes (`received_<sensor>`) and finds the lost ones
from the publisher's sequence numbers when the rmw gives them, else from the stamps:

Sequence numbers (`SequenceGaps`): every publisher numbers its messages 1, 2, 3, ... (the rmw
message info: publication_sequence_number, per publisher gid); a message numbered k after k'
from the same publisher means k - k' - 1 lost. Exact whatever the rate or load. The first
message of a publisher (a new one, a restarted one, or any after `restart()`) only starts its
count. With receive.mode 'processes' the sequence is the node's ring version of the sensor
(input_rings.py: every message a receiver process published there, so what the node missed in
the ring; a message the receiver dropped as bad is counted there under its reason).

Stamps (`StampGaps`, an rmw without sequence numbers; a ROS 2 Header has none):
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
  stamp is taken before validation, so a bad message counts under its own reason only.
- A sensor that really slowed down looks like a sustained gap: after RELEARN consecutive gaps
  the period is learned again from them (so a loss on every message for that long is then
  taken for a slower sensor). Hence the limit of stamps: a node overloaded from its first
  messages, or for long, learns the period it keeps up with and counts little of what it
  misses (measured over DDS: 1 of 86 camera messages lost at 3x the rate the node keeps up
  with; tests/test_perception_overload_dds.py).
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

WINDOW = 32  # deltas the period is the median of
MIN_DELTAS = 4  # deltas learned before any gap is counted
GAP_FACTOR = 1.5  # a delta longer than this many periods is a gap
RELEARN = 64  # consecutive gaps after which the period is learned from the gaps
MAX_WRITERS = 16  # publishers remembered per sensor (least recently heard of forgotten)


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


class SequenceGaps:
    """Counts the messages lost in one sensor's stream from its publishers' sequence numbers
    (see the module docstring). Thread-safe."""

    def __init__(self, counter: str, count: Callable[[str, int], Any] | None = None) -> None:
        self.counter = counter
        self.lost = 0
        self._count = count or (lambda name, n: None)
        self._last: OrderedDict[bytes, int] = OrderedDict()  # publisher -> last number seen
        self._lock = threading.Lock()

    def restart(self) -> None:
        """Forget every publisher's last number (the node stopped taking messages for a
        while: what was sent meanwhile was not lost)."""
        with self._lock:
            self._last.clear()

    def add(self, seq: int, writer: bytes) -> int:
        """One received message's sequence number from publisher `writer`; returns the
        messages found lost before it. A number at or below the last one seen (a duplicate
        or a late message) is no gap."""
        with self._lock:
            last = self._last.get(writer)
            if last is None:
                self._last[writer] = seq
                if len(self._last) > MAX_WRITERS:
                    self._last.popitem(last=False)
                return 0
            self._last.move_to_end(writer)
            if seq <= last:
                return 0
            self._last[writer] = seq
            lost = seq - last - 1
            if lost:
                self.lost += lost
                self._count(self.counter, lost)
            return lost


class InputLoss:
    """One sensor's `received_<name>` and `lost_<name>` counts (see the module docstring):
    lost from sequence numbers when a message has one, else from stamp gaps."""

    def __init__(self, name: str, max_gap_s: float,
                 count: Callable[[str, int], Any] | None = None) -> None:
        self._count = count or (lambda name, n: None)
        self.stamps = StampGaps(name, max_gap_s, count)
        self.counter = self.stamps.counter
        self.received_counter = f"received_{name}"
        self.sequence = SequenceGaps(self.counter, count)
        self.received = 0

    @property
    def lost(self) -> int:
        return self.stamps.lost + self.sequence.lost

    def restart(self) -> None:
        """No gap across a time the node took no messages (deactivated)."""
        self.stamps.restart()
        self.sequence.restart()

    def add(self, stamp_ns: int, seq: int | None = None, writer: bytes | None = None) -> int:
        """One message taken: its stamp, and its publisher's sequence number and id when the
        rmw gives them. Returns the messages found lost before it."""
        self.received += 1
        self._count(self.received_counter, 1)
        if seq is not None and seq > 0 and writer:
            return self.sequence.add(int(seq), writer)
        return self.stamps.add(stamp_ns)


def message_sequence(info: Any) -> tuple[int | None, bytes | None]:
    """(publication sequence number, publisher id) from rclpy's message info (a dict), or
    (None, None) when the rmw gives none."""
    if not info:
        return None, None
    seq = info.get("publication_sequence_number")
    gid = info.get("publisher_gid")
    writer = gid.get("data") if isinstance(gid, dict) else None
    if not seq or not writer:
        return None, None
    return int(seq), bytes(writer)


def ring_sequence(ticket: tuple | None) -> tuple[int | None, bytes | None]:
    """(sequence number, publisher id) of a message from a receiver process: its ring version
    (ticket[2]; input_rings.py) and the ring as its one publisher; (None, None) for no ticket."""
    return (int(ticket[2]), b"ring") if ticket is not None else (None, None)
