"""ClockCheck: a stack on two clocks is reported within its window, latency never is."""

from __future__ import annotations

import pytest

from kestrel_common.clock_check import ClockCheck

S = 10**9
WALL = 1_760_000_000 * S   # a wall-clock "now"


def test_sim_stamps_on_a_wall_clock_node_are_reported_within_a_second() -> None:
    check = ClockCheck(use_sim_time=False)
    t = WALL
    declared_at = None
    for i in range(300):   # 100 Hz input stamped in sim time (seconds since the sim started)
        if check.observe(12 * S + i * S // 100, t) and declared_at is None:
            declared_at = t
        t += S // 100
    assert declared_at is not None and declared_at - WALL <= S
    text = check.status()
    assert "time source mismatch" in text and "behind" in text and "use_sim_time=false" in text
    assert "same use_sim_time" in text
    assert check.mismatches == 300


def test_latency_jumps_and_unstamped_inputs_are_not_a_mismatch() -> None:
    check = ClockCheck(use_sim_time=True)
    now = 50 * S
    for _ in range(1000):
        assert not check.observe(now - 30_000_000, now)   # 30 ms old
        assert not check.observe(0, now)                   # no stamp
        now += S // 100
    # a looping bag: the clock jumps back, the stamps follow it
    assert not check.observe(2 * S, 2 * S + 1000)
    assert check.status() == "" and check.mismatches == 0


def test_one_agreeing_stamp_clears_the_mismatch() -> None:
    check = ClockCheck(window_s=0.5)
    for k in range(100):
        check.observe(5 * S, WALL + k * S // 100)
    assert check.mismatch
    assert not check.observe(WALL + 2 * S, WALL + 2 * S)
    assert check.status() == ""


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        ClockCheck(max_offset_s=0)
