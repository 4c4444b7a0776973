"""Thread-safe named counters and fixed-size latency windows (no rclpy).

Counters make every dropped or rejected input visible (`/diagnostics`); `LatencyWindow` keeps
the last N samples in a preallocated ring so recording a sample never allocates.
"""

from __future__ import annotations

import threading
from typing import Iterable

import numpy as np


class Counters:
    """Named monotonically increasing counters, safe to bump from any callback thread."""

    def __init__(self, names: Iterable[str] = ()) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, int] = {name: 0 for name in names}

    def inc(self, name: str, n: int = 1) -> int:
        with self._lock:
            value = self._values.get(name, 0) + n
            self._values[name] = value
            return value

    def get(self, name: str) -> int:
        with self._lock:
            return self._values.get(name, 0)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)

    def reset(self) -> None:
        with self._lock:
            for name in self._values:
                self._values[name] = 0


class LatencyWindow:
    """The last `capacity` samples (s) in a preallocated ring buffer.

    add() is O(1) and allocation-free; percentiles() copies the filled part (reporting path).
    """

    def __init__(self, capacity: int = 1024) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity = {capacity}: must be > 0")
        self._buf = np.zeros(capacity, dtype=np.float64)
        self._n = 0
        self._i = 0
        self._lock = threading.Lock()

    def add(self, value: float) -> None:
        with self._lock:
            self._buf[self._i] = value
            self._i = (self._i + 1) % self._buf.shape[0]
            if self._n < self._buf.shape[0]:
                self._n += 1

    def __len__(self) -> int:
        return self._n

    def percentiles(self, qs: Iterable[float] = (50.0, 99.0)) -> dict[str, float]:
        """{'p50': .., 'p99': .., 'max': ..} over the window; NaN when empty."""
        qs = list(qs)
        with self._lock:
            data = self._buf[: self._n].copy()
        out: dict[str, float] = {}
        if data.size == 0:
            for q in qs:
                out[_pname(q)] = float("nan")
            out["max"] = float("nan")
            return out
        values = np.percentile(data, qs)
        for q, v in zip(qs, values, strict=True):
            out[_pname(q)] = float(v)
        out["max"] = float(data.max())
        return out


def _pname(q: float) -> str:
    text = f"{q:g}".replace(".", "")
    return f"p{text}"


class StageTimer:
    """Named LatencyWindows, one per processing stage."""

    def __init__(self, stages: Iterable[str], capacity: int = 512) -> None:
        self.windows = {name: LatencyWindow(capacity) for name in stages}

    def add(self, stage: str, seconds: float) -> None:
        window = self.windows.get(stage)
        if window is None:
            window = self.windows[stage] = LatencyWindow(512)
        window.add(seconds)

    def summary(self, qs: Iterable[float] = (50.0, 99.0)) -> dict[str, dict[str, float]]:
        return {name: w.percentiles(qs) for name, w in self.windows.items()}
