"""The sim node's timing helpers (no rclpy): how often each output goes out in sim time, and
how often it went out in wall time for /diagnostics."""

from __future__ import annotations

import threading
import time

__all__ = ["Periodic", "RateMeter"]


class RateMeter:
    """Events per wall second over the last report interval (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._n = 0
        self._t = time.monotonic()

    def tick(self, n: int = 1) -> None:
        with self._lock:
            self._n += n

    def rate(self) -> float:
        with self._lock:
            now = time.monotonic()
            r = self._n / max(now - self._t, 1e-6)
            self._n, self._t = 0, now
        return r


class Periodic:
    """Due-ness in sim time: due(now) is true at most once per period (no burst catch-up)."""

    def __init__(self, rate_hz: float) -> None:
        self.period_ns = int(1e9 / rate_hz) if rate_hz > 0 else 0
        self.next_ns = 0

    def due(self, now_ns: int) -> bool:
        if self.period_ns == 0 or now_ns < self.next_ns:
            return False
        self.next_ns = max(self.next_ns + self.period_ns, now_ns - self.period_ns // 2)
        return True
