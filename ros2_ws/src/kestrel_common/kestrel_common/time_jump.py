"""Backwards jumps of a node's clock (pure, no rclpy).

A sim restart or a bag played with --loop sends /clock back, and a node on sim time sees its
clock go back with it (a wall clock stepped back does the same). What the node holds from
before the jump (joint states, targets, a scene, a running plan) describes the world before
it, however its stamp compares with the clock now: it must be forgotten, and the jump counted
(`time_jumps_back` on /diagnostics), so that the node goes on with fresh inputs instead of
acting on old ones or holding without saying why.

`ClockJumps.observe(now_ns)` takes every reading of the clock a node acts on; it returns True
once per step back of more than `jump_back_s` from the newest reading (the front), which then
restarts from the new time. A smaller step back is no jump (the front stays, so a clock that
keeps stepping back a little accumulates into one); a zero or negative reading (sim time before
the first /clock) says nothing. Not thread-safe: one reader of the clock, or the caller's lock.
"""

from __future__ import annotations


class ClockJumps:
    """Detects backwards jumps of one clock (see the module docstring)."""

    def __init__(self, jump_back_s: float) -> None:
        if not jump_back_s > 0:
            raise ValueError(f"jump_back_s = {jump_back_s}: must be > 0")
        self.jump_back_ns = int(round(jump_back_s * 1e9))
        self.front_ns: int | None = None  # the newest reading, ns
        self.jumps = 0
        self.last_jump: tuple[int, int] = (0, 0)  # (from front, to now) of the latest, ns

    def observe(self, now_ns: int) -> bool:
        """One reading of the clock, ns; True when it jumped back (counted in `jumps`)."""
        if now_ns <= 0:
            return False
        front = self.front_ns
        if front is not None and now_ns < front - self.jump_back_ns:
            self.jumps += 1
            self.last_jump = (front, now_ns)
            self.front_ns = now_ns
            return True
        if front is None or now_ns > front:
            self.front_ns = now_ns
        return False

    @property
    def last_jump_s(self) -> float:
        """How far the latest jump went back, s (0 before any)."""
        return (self.last_jump[0] - self.last_jump[1]) * 1e-9

    def reset(self) -> None:
        """Forget the front (the next reading starts it again); the count is kept."""
        self.front_ns = None
