"""What the demo measures and how it judges the run (no rclpy): topic rates, per-node
latency percentiles, control-loop deadline misses, and the end-to-end data-flow verdict.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

import numpy as np

# The chain that must carry data for a run to pass: sim -> perception -> planner -> control -> sim
FLOW_CHAIN: tuple[tuple[str, str], ...] = (
    ("sim -> perception", "/camera/image_raw"),
    ("sim -> perception (LiDAR)", "/lidar/points"),
    ("perception -> planner", "/perception/result"),
    ("planner -> control", "/control/target"),
    ("control -> sim", "/control/joint_command"),
)


@dataclass
class TopicStats:
    """Arrival times (monotonic s) of one topic's messages."""

    count: int = 0
    first: float = math.nan
    last: float = math.nan

    def add(self, t: float) -> None:
        if self.count == 0:
            self.first = t
        self.last = t
        self.count += 1

    def rate(self) -> float:
        """Mean rate over the span between first and last message, Hz."""
        if self.count < 2 or self.last <= self.first:
            return 0.0
        return (self.count - 1) / (self.last - self.first)


@dataclass
class StackReport:
    """Collected by the monitor node's callbacks (thread-safe)."""

    topics: dict[str, TopicStats] = field(default_factory=dict)
    latencies: dict[str, list[float]] = field(default_factory=dict)   # name -> samples, s
    loop_stats: object | None = None      # latest kestrel_interfaces/LoopStatistics
    counters: dict[str, dict[str, str]] = field(default_factory=dict)  # node -> diag values
    plans: dict[str, int] = field(default_factory=dict)  # accepted / rejected / error / failed
    sim_applied_commands: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def on_message(self, topic: str, t: float) -> None:
        with self.lock:
            self.topics.setdefault(topic, TopicStats()).add(t)

    def on_latency(self, name: str, seconds: float) -> None:
        if math.isfinite(seconds):
            with self.lock:
                self.latencies.setdefault(name, []).append(seconds)

    def on_plan(self, status: str) -> None:
        with self.lock:
            self.plans[status] = self.plans.get(status, 0) + 1

    def count(self, topic: str) -> int:
        with self.lock:
            stats = self.topics.get(topic)
            return stats.count if stats else 0

    # ---- verdict -----------------------------------------------------------------------------
    def flow_failures(self, plans: bool = True) -> list[str]:
        """What did not flow. plans=False: the links that need an accepted plan (the planner's
        targets) are not asked for (the stack before its first goal)."""
        failures = [f"{link}: no messages on {topic}" for link, topic in FLOW_CHAIN
                    if self.count(topic) == 0 and (plans or topic != "/control/target")]
        if plans and self.plans.get("accepted", 0) == 0:
            failures.append(f"planner: no accepted plan (results: {self.plans or 'none'})")
        if self.sim_applied_commands <= 0:
            failures.append("control -> sim: the simulator applied no joint command")
        return failures

    # ---- table -------------------------------------------------------------------------------
    def table(self, duration: float) -> str:
        lines = [f"Kestrel stack demo: {duration:.1f} s", "",
                 f"{'topic':<28} {'msgs':>7} {'rate Hz':>9}"]
        with self.lock:
            for topic in sorted(self.topics):
                st = self.topics[topic]
                lines.append(f"{topic:<28} {st.count:>7} {st.rate():>9.1f}")
            lat = {k: list(v) for k, v in self.latencies.items()}
        lines += ["", f"{'latency (ms)':<34} {'n':>6} {'p50':>8} {'p99':>8} {'max':>8}"]
        for name in sorted(lat):
            arr = np.asarray(lat[name]) * 1e3
            p50, p99 = np.percentile(arr, [50, 99])
            lines.append(f"{name:<34} {arr.size:>6} {p50:>8.2f} {p99:>8.2f} {arr.max():>8.2f}")
        ls = self.loop_stats
        if ls is not None:
            lines += ["", "control loop (whole run)",
                      f"  target period {ls.period_target * 1e3:.3f} ms, cycles {ls.cycles_total}, "
                      f"deadline misses {ls.deadline_misses} "
                      f"({100.0 * ls.deadline_misses / max(1, ls.cycles_total):.2f} %; "
                      f"preempted {getattr(ls, 'misses_preempted', 0)}, blocked "
                      f"{getattr(ls, 'misses_blocked', 0)}, late wake "
                      f"{getattr(ls, 'misses_late_wake', 0)}, slow step "
                      f"{getattr(ls, 'misses_slow_step', 0)})",
                      f"  step latency p50 {ls.step_latency_p50 * 1e6:.0f} us, p99 "
                      f"{ls.step_latency_p99 * 1e6:.0f} us, p99.9 {ls.step_latency_p999 * 1e6:.0f}"
                      f" us, max {ls.step_latency_max * 1e6:.0f} us (last window)",
                      f"  wake error p99 {ls.wake_error_p99 * 1e6:.0f} us; stale inputs "
                      f"{ls.stale_inputs}, rejected non-finite {ls.rejected_nonfinite}, "
                      f"implausible {getattr(ls, 'rejected_implausible', 0)}, clamped "
                      f"{ls.clamped_actions}"]
        lines += ["", f"plans: {self.plans or 'none'}; sim applied joint commands: "
                      f"{self.sim_applied_commands}"]
        if self.counters:
            lines += ["", "drop/diagnostic counters (non-zero)"]
            for node in sorted(self.counters):
                nz = {k: v for k, v in self.counters[node].items()
                      if _nonzero_count(k, v)}
                if nz:
                    text = ", ".join(f"{k}={v}" for k, v in sorted(nz.items()))
                    lines.append(f"  {node}: {text}")
        return "\n".join(lines)


def _nonzero_count(key: str, value: str) -> bool:
    try:
        return float(value) != 0 and float(value).is_integer()
    except ValueError:
        return False
