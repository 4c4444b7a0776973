"""Detects a time-source mismatch: input stamps on one clock, the node on another.

A stack where the sim stamps in sim time (seconds since its start) while a node runs on wall
time (seconds since 1970), or the reverse, sees every input as hours or decades old or in the
future; without this check the only sign is a stream of "stale input" drops. The check is
pure: the node feeds it each timed input's header stamp and its own clock's now (ns), and
reports its `status()` on /diagnostics as an ERROR that names the fix.

A mismatch is declared once every stamp seen for `window_s` of the node's clock is farther
than `max_offset_s` from now (a bag replayed without /clock, a sim on its own time); one
sample within the offset clears it. So the first report comes about one window after the
first mismatched input, and ordinary latency (ms) or a clock jump (a bag looping, a sim reset:
the stamps follow the clock again within a message) never triggers it.
"""

from __future__ import annotations

FIX = ("start every node with the same use_sim_time: true when the sim or a bag player "
       "publishes /clock (the stack's default), false when sensors stamp in wall time")


class ClockCheck:
    def __init__(self, max_offset_s: float = 300.0, window_s: float = 1.0,
                 use_sim_time: bool = False) -> None:
        if max_offset_s <= 0 or window_s <= 0:
            raise ValueError("max_offset_s and window_s must be > 0")
        self.max_offset_ns = int(max_offset_s * 1e9)
        self.window_ns = int(window_s * 1e9)
        self.use_sim_time = use_sim_time
        self.mismatches = 0            # inputs whose stamp was off by more than max_offset_s
        self._since: int | None = None  # node-clock ns of the first off stamp of this streak
        self._offset_ns = 0            # stamp - now of the latest off stamp
        self.mismatch = False

    def observe(self, stamp_ns: int, now_ns: int) -> bool:
        """Feed one input's stamp; returns whether a mismatch is declared now. A zero stamp
        (an unstamped message) says nothing about the clock and is ignored."""
        if stamp_ns <= 0:
            return self.mismatch
        offset = stamp_ns - now_ns
        if abs(offset) <= self.max_offset_ns:
            self._since, self.mismatch = None, False
            return False
        self.mismatches += 1
        self._offset_ns = offset
        if self._since is None or now_ns < self._since:
            self._since = now_ns
        self.mismatch = now_ns - self._since >= self.window_ns
        return self.mismatch

    def status(self) -> str:
        """'' when the clocks agree, else the ERROR text for /diagnostics."""
        if not self.mismatch:
            return ""
        direction = "behind" if self._offset_ns < 0 else "ahead of"
        clock = "sim time (/clock)" if self.use_sim_time else "wall time"
        return (f"time source mismatch: input stamps are {abs(self._offset_ns) / 1e9:.0f} s "
                f"{direction} this node's clock ({clock}, use_sim_time="
                f"{str(self.use_sim_time).lower()}): {FIX}")
