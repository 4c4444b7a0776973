"""SafetyFilter: stale -> hold, NaN/inf -> reject + hold, clamp to limits; all counted."""

from __future__ import annotations


import numpy as np
import pytest

from kestrel_control.core.safety import SafetyFilter, SafetyStatus
from kestrel_control.core.stats import LoopStats

LOWER = np.array([-1.0, -2.0, 0.0])
UPPER = np.array([1.0, 2.0, 0.5])


def make() -> SafetyFilter:
    return SafetyFilter(LOWER, UPPER, max_obs_age_s=0.02)


@pytest.mark.parametrize(
    ("lower", "upper", "match"),
    [
        ([0.0, 1.0], [1.0, 0.5], r"'joint_lower' = \[0.0, 1.0\]: joint 1 lower 1.0 > "),
        ([0.0], [1.0, 2.0], "'joint_upper'"),
        ([], [], "'joint_lower'"),
        ([np.nan], [1.0], "'joint_lower'.*finite"),
    ],
)
def test_bad_limits_name_the_parameter(lower: list, upper: list, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SafetyFilter(lower, upper, 0.02)


@pytest.mark.parametrize("age", [0.0, -1.0, float("nan")])
def test_bad_max_age(age: float) -> None:
    with pytest.raises(ValueError, match="'max_obs_age'"):
        SafetyFilter(LOWER, UPPER, age)


def test_fresh_finite_observation_ok() -> None:
    f = make()
    assert f.check_observation(np.zeros(9), 0.019) is SafetyStatus.OK
    assert f.check_observation(np.zeros(9), -0.01) is SafetyStatus.OK  # small clock skew
    assert (f.counters.stale_inputs, f.counters.rejected_nonfinite) == (0, 0)


@pytest.mark.parametrize("age", [0.021, 5.0, -0.5, float("nan")])
def test_stale_counted(age: float) -> None:
    f = make()
    assert f.check_observation(np.zeros(9), age) is SafetyStatus.STALE
    assert f.counters.stale_inputs == 1


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_observation_rejected(bad: float) -> None:
    f = make()
    obs = np.zeros(9, np.float32)
    obs[4] = bad
    assert f.check_observation(obs, 0.0) is SafetyStatus.NONFINITE_OBS
    assert f.counters.rejected_nonfinite == 1


def test_clamp_counted_and_values_exact() -> None:
    f = make()
    out = np.empty(3)
    assert f.filter_command(out, np.array([0.5, 1.0, 0.25]), None) is SafetyStatus.OK
    np.testing.assert_array_equal(out, [0.5, 1.0, 0.25])
    assert f.counters.clamped_actions == 0
    assert f.filter_command(out, np.array([3.0, -7.0, 0.25]), None) is SafetyStatus.OK
    np.testing.assert_array_equal(out, [1.0, -2.0, 0.25])
    assert f.counters.clamped_actions == 1


def test_nonfinite_action_holds_last_safe_command() -> None:
    f = make()
    out = np.empty(3)
    f.filter_command(out, np.array([0.1, 0.2, 0.3]), None)
    out[:] = -9.0
    status = f.filter_command(out, np.array([0.0, np.nan, 0.0]), np.zeros(3))
    assert status is SafetyStatus.NONFINITE_ACTION
    np.testing.assert_array_equal(out, [0.1, 0.2, 0.3])
    assert f.counters.rejected_nonfinite == 1


def test_hold_without_history_uses_clamped_position_or_reports_none() -> None:
    f = make()
    out = np.full(3, 5.0)
    assert f.hold(out, np.array([0.3, 3.0, -1.0]))
    np.testing.assert_array_equal(out, [0.3, 2.0, 0.0])
    out[:] = 5.0
    assert not f.hold(out, np.array([np.nan, 0.0, 0.0]))
    assert not f.hold(out, None)
    np.testing.assert_array_equal(out, [5.0, 5.0, 5.0])  # untouched
    f.filter_command(out, np.zeros(3), None)
    f.reset()
    assert not f.hold(out, None)


def test_never_raises_on_wrong_shapes() -> None:
    f = make()
    out = np.empty(3)
    assert f.filter_command(out, np.zeros(5), None) is SafetyStatus.NONFINITE_ACTION
    assert f.check_observation(None, 0.0) is SafetyStatus.NONFINITE_OBS  # type: ignore[arg-type]
    assert f.internal_errors == 2 and f.counters.rejected_nonfinite == 2


def test_counts_on_loop_stats() -> None:
    stats = LoopStats(1e-3)
    f = SafetyFilter(LOWER, UPPER, 0.02, counters=stats)
    out = np.empty(3)
    f.check_observation(np.zeros(3), 1.0)
    f.check_observation(np.array([np.nan]), 0.0)
    f.filter_command(out, np.array([9.0, 0.0, 0.0]), None)
    snap = stats.snapshot()
    assert (snap.stale_inputs, snap.rejected_nonfinite, snap.clamped_actions) == (1, 1, 1)
