"""Backwards jumps of a node's clock (kestrel_common.time_jump)."""

from __future__ import annotations

import pytest
from kestrel_common.time_jump import ClockJumps

S = 1_000_000_000


def test_a_step_back_beyond_the_threshold_is_one_jump() -> None:
    c = ClockJumps(0.5)
    assert not any(c.observe(t) for t in (10 * S, 11 * S, 12 * S))
    assert c.observe(2 * S)  # a sim restart
    assert c.jumps == 1 and c.last_jump == (12 * S, 2 * S) and c.last_jump_s == 10.0
    assert not c.observe(2 * S) and not c.observe(3 * S)  # the new timeline goes on
    assert c.front_ns == 3 * S


def test_small_steps_back_and_no_clock_are_not_jumps() -> None:
    c = ClockJumps(0.5)
    c.observe(10 * S)
    assert not c.observe(10 * S - S // 4)  # 0.25 s back: within the threshold
    assert not c.observe(0) and not c.observe(-5)  # no /clock yet: says nothing
    assert c.front_ns == 10 * S  # the front stays: small steps add up
    assert c.observe(10 * S - S) and c.jumps == 1


def test_reset_and_bad_threshold() -> None:
    c = ClockJumps(0.5)
    c.observe(10 * S)
    c.reset()
    assert not c.observe(1 * S) and c.jumps == 0
    with pytest.raises(ValueError, match="jump_back_s"):
        ClockJumps(0.0)
