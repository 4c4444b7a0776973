"""Loop timing and safety statistics: preallocated ring buffers + counters, snapshot per window.

Single writer (the real-time loop thread) for every field; a reporting thread calls `snapshot()`.
`record()` does no allocation (float stores into preallocated float64 rings). A snapshot taken
while the loop writes can include a sample from the cycle in progress; counters are Python ints
updated by the one writer, read atomically under the GIL.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kestrel_control.core.miss_cause import CAUSES as MISS_CAUSES

_NAN = float("nan")


class Ring:
    """Preallocated float64 ring of the last `capacity` samples."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"parameter 'capacity' = {capacity!r}: must be >= 1")
        self.buf = np.zeros(int(capacity), dtype=np.float64)
        self.capacity = int(capacity)
        self.count = 0  # samples pushed since creation (or reset)

    def push(self, value: float) -> None:
        self.buf[self.count % self.capacity] = value
        self.count += 1

    def since(self, start_count: int, end_count: int | None = None) -> np.ndarray:
        """Copy of the samples pushed in [start_count, end_count) (default end: now), at most
        the last `capacity` of them, oldest first."""
        cap = self.capacity
        end = self.count if end_count is None else end_count
        n = min(end - start_count, cap)
        if n <= 0:
            return np.empty(0)
        idx = np.arange(end - n, end) % cap
        return self.buf[idx]  # fancy indexing copies

    def reset(self) -> None:
        self.count = 0


def window_end_ns(node_now_ns: int, mono_now_ns: int, last_wake_ns: int) -> int:
    """Node-clock time of a window's last cycle: `node_now_ns` (node clock) and `mono_now_ns`
    (time.monotonic_ns) read back to back, `last_wake_ns` the loop's monotonic wake-up of that
    cycle (LoopStats.window_end_wake_ns after the snapshot; 0 = none -> `node_now_ns`).

    Why not the node clock at publication: the reporter reads the counters and then stamps the
    message; a stall in between (the executor thread preempted or waiting for the GIL) would
    pair the counters of one moment with the time of a later one. Seen in CI: a 6 s stall made
    the cycle rate computed from consecutive stamps 2,309 Hz on a 500 Hz loop.
    """
    if last_wake_ns <= 0:
        return node_now_ns
    return node_now_ns - max(0, mono_now_ns - last_wake_ns)


def _pct(samples: np.ndarray, q: float) -> float:
    return float(np.percentile(samples, q)) if samples.size else _NAN


@dataclass
class LoopStatsSnapshot:
    """One reporting window; fields match kestrel_interfaces/msg/LoopStatistics (minus header).

    Times in s. Percentiles over the window's samples (NaN when the window had none).
    Counters are totals since activation (`reset()`).
    """

    period_target: float
    cycles_window: int
    cycles_total: int
    period_p50: float
    period_p99: float
    period_p999: float
    period_max: float
    wake_error_p50: float
    wake_error_p99: float
    wake_error_p999: float
    wake_error_max: float
    step_latency_p50: float
    step_latency_p99: float
    step_latency_p999: float
    step_latency_max: float
    deadline_misses: int
    stale_inputs: int
    rejected_nonfinite: int
    clamped_actions: int
    misses_preempted: int
    misses_blocked: int
    misses_late_wake: int
    misses_slow_step: int
    rejected_implausible: int = 0


class LoopStats:
    """Per-cycle timing rings (period, wake error, step latency; s) and safety counters."""

    # the last four split deadline_misses by cause (core/miss_cause.py; they stay 0 where
    # the loop thread's schedstat is unavailable). The loop adds to deadline_misses first and
    # to a cause second; readers take the causes first, so they never add up to more.
    CAUSES = MISS_CAUSES
    COUNTERS = ("cycles", "deadline_misses", "stale_inputs", "rejected_nonfinite",
                "clamped_actions", "step_errors", *MISS_CAUSES, "rejected_implausible",
                "time_jumps_back")

    def __init__(self, period_target_s: float, capacity: int = 16384) -> None:
        if not period_target_s > 0:
            raise ValueError(f"parameter 'period_target_s' = {period_target_s!r}: must be > 0")
        self.period_target = float(period_target_s)
        self.period = Ring(capacity)  # s between consecutive step starts
        self.wake_error = Ring(capacity)  # s, wake time minus deadline (positive = late)
        self.step_latency = Ring(capacity)  # s, step start to command written
        self.cycles = 0
        self.deadline_misses = 0  # deadlines that passed without a cycle (overruns, late wakes)
        self.stale_inputs = 0  # cycles whose observation was older than max_obs_age
        self.rejected_nonfinite = 0  # cycles with NaN/inf in observation or action
        self.rejected_implausible = 0  # cycles whose observation was out of range (safety.py)
        self.clamped_actions = 0  # cycles where a command was clamped to the joint limits
        self.step_errors = 0  # exceptions raised by the step function (loop kept running)
        self.time_jumps_back = 0  # backwards jumps of the loop's clock (policy_runner.py)
        self.misses_preempted = 0  # misses while another task had the loop's CPU
        self.misses_blocked = 0  # misses while the loop thread waited (GIL, lock) off its CPU
        self.misses_late_wake = 0  # misses from a late wake-up without a switch-out
        self.misses_slow_step = 0  # misses from a step longer than the period allowed
        self.wake_time = Ring(capacity)  # s, time.monotonic() of each cycle's wake-up
        # time.monotonic_ns() of the wake-up of the last cycle in the last snapshot's window
        # (0: none): the end of that window, from the same count as its samples
        self.window_end_wake_ns = 0
        self._win_cycles = 0
        self._win_period = 0
        self._win_wake = 0
        self._win_latency = 0

    def record(self, wake_error_s: float, latency_s: float, period_s: float | None,
               wake_ns: int = 0) -> None:
        """One cycle (loop thread). `period_s` None on the first cycle (no previous start);
        `wake_ns`: the cycle's wake-up, time.monotonic_ns() (0: not known). The wake time is
        pushed first: a cycle counted in step_latency always has its wake time."""
        self.wake_time.push(wake_ns * 1e-9)
        self.wake_error.push(wake_error_s)
        self.step_latency.push(latency_s)
        if period_s is not None:
            self.period.push(period_s)
        self.cycles += 1

    def reset(self) -> None:
        """Zero everything (on activation). Not to be called while the loop runs."""
        for ring in (self.period, self.wake_error, self.step_latency, self.wake_time):
            ring.reset()
        for name in self.COUNTERS:
            setattr(self, name, 0)
        self.window_end_wake_ns = 0
        self._win_cycles = self._win_period = self._win_wake = self._win_latency = 0

    def _window(self, advance: bool) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
        cycles = self.cycles
        counts = (self.period.count, self.wake_error.count, self.step_latency.count)
        period = self.period.since(self._win_period, counts[0])
        wake = self.wake_error.since(self._win_wake, counts[1])
        latency = self.step_latency.since(self._win_latency, counts[2])
        n_window = cycles - self._win_cycles
        if advance:
            self._win_cycles = cycles
            self._win_period, self._win_wake, self._win_latency = counts
            self.window_end_wake_ns = self._wake_ns_of(counts[2] - 1)
        return n_window, period, wake, latency

    def _wake_ns_of(self, cycle: int) -> int:
        """time.monotonic_ns() of cycle `cycle`'s wake-up (0: none, or beyond the ring)."""
        ring = self.wake_time
        if cycle < 0 or cycle < ring.count - ring.capacity:
            return 0
        return int(round(float(ring.buf[cycle % ring.capacity]) * 1e9))

    def snapshot(self, advance_window: bool = True) -> LoopStatsSnapshot:
        """Statistics of the window since the previous snapshot; starts a new window."""
        n_window, period, wake, latency = self._window(advance_window)
        causes = {name: int(getattr(self, name)) for name in self.CAUSES}  # before the total
        return LoopStatsSnapshot(
            period_target=self.period_target,
            cycles_window=n_window,
            cycles_total=self.cycles,
            period_p50=_pct(period, 50), period_p99=_pct(period, 99),
            period_p999=_pct(period, 99.9),
            period_max=float(period.max()) if period.size else _NAN,
            wake_error_p50=_pct(wake, 50), wake_error_p99=_pct(wake, 99),
            wake_error_p999=_pct(wake, 99.9),
            wake_error_max=float(wake.max()) if wake.size else _NAN,
            step_latency_p50=_pct(latency, 50), step_latency_p99=_pct(latency, 99),
            step_latency_p999=_pct(latency, 99.9),
            step_latency_max=float(latency.max()) if latency.size else _NAN,
            deadline_misses=self.deadline_misses,
            stale_inputs=self.stale_inputs,
            rejected_nonfinite=self.rejected_nonfinite,
            clamped_actions=self.clamped_actions,
            **causes,
            rejected_implausible=self.rejected_implausible,
        )

    def percentiles(self, last_n: int | None = None) -> dict[str, float]:
        """p50/p99/p99.9/max of period, wake error and step latency over the last `last_n`
        samples (default: the whole ring), for diagnostics. Keys like 'period_p999', s."""
        out: dict[str, float] = {}
        for name in ("period", "wake_error", "step_latency"):
            ring: Ring = getattr(self, name)
            n = ring.capacity if last_n is None else last_n
            samples = ring.since(max(0, ring.count - n))
            out[f"{name}_p50"] = _pct(samples, 50)
            out[f"{name}_p99"] = _pct(samples, 99)
            out[f"{name}_p999"] = _pct(samples, 99.9)
            out[f"{name}_max"] = float(samples.max()) if samples.size else _NAN
        return out

    def counters(self) -> dict[str, int]:
        """All counters, by name (the causes read before deadline_misses: see COUNTERS)."""
        first = {name: int(getattr(self, name)) for name in self.CAUSES}
        return {name: first[name] if name in first else int(getattr(self, name))
                for name in self.COUNTERS}
