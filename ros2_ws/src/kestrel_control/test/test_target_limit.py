"""The joint-space speed limit of a commanded target (ControlTarget.max_speed, rad/s)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kestrel_control.core.target_limit import TargetRamp, speed_limit, step_toward


def test_step_toward_limits_each_joint() -> None:
    cur, goal = np.array([0.0, 0.0, 1.0]), np.array([1.0, -0.05, 1.0])
    np.testing.assert_allclose(step_toward(cur, goal, 0.1), [0.1, -0.05, 1.0])
    np.testing.assert_array_equal(step_toward(cur, goal, math.inf), goal)
    np.testing.assert_array_equal(step_toward(cur, goal, 0.0), cur)
    assert step_toward(cur, goal, 0.1) is not cur  # pure: a new array
    with pytest.raises(ValueError, match="max_step"):
        step_toward(cur, goal, -1.0)
    with pytest.raises(ValueError, match="differ"):
        step_toward(cur, goal[:2], 0.1)


@pytest.mark.parametrize(("given", "limit"), [(0.0, math.inf), (math.inf, math.inf),
                                              (0.5, 0.5), (-0.1, None), (math.nan, None)])
def test_speed_limit_of_a_message(given: float, limit: float | None) -> None:
    assert speed_limit(given) == limit


def test_ramp_starts_at_the_joints_and_arrives_at_max_speed() -> None:
    ramp = TargetRamp(2)
    ramp.set_goal(np.array([1.0, 0.1]), 0.5)
    assert ramp.advance(0.01, None) is None and ramp.active  # no joint state: nothing yet
    q = np.array([0.0, 0.0])
    np.testing.assert_array_equal(ramp.advance(0.01, q), q)  # the start: where the joints are
    t, last = 0.0, q
    while ramp.active:
        nxt = ramp.advance(0.01, None)
        assert np.all(np.abs(nxt - last) <= 0.5 * 0.01 + 1e-12)  # rad/s x dt, per joint
        last, t = nxt, t + 0.01
    np.testing.assert_array_equal(last, [1.0, 0.1])
    assert t == pytest.approx(2.0, abs=0.011)  # 1 rad at 0.5 rad/s
    assert ramp.advance(0.01, None) is None  # arrived: nothing more to write


def test_new_goal_continues_from_the_last_target_and_reset_forgets_it() -> None:
    ramp = TargetRamp(1)
    ramp.set_goal(np.array([1.0]), 1.0)
    ramp.advance(0.0, np.array([0.0]))
    np.testing.assert_allclose(ramp.advance(0.3, None), [0.3])
    ramp.set_goal(np.array([-1.0]), 1.0)  # reversal: from 0.3, not from the joints
    np.testing.assert_allclose(ramp.advance(0.1, np.array([5.0])), [0.2])
    ramp.reset()
    assert not ramp.active and ramp.current is None
    ramp.set_goal(np.array([1.0]), 1.0)
    np.testing.assert_allclose(ramp.advance(0.0, np.array([5.0])), [5.0])  # joints again


def test_non_finite_target_restarts_from_the_joints() -> None:
    ramp = TargetRamp(1)
    ramp.current = np.array([math.nan])  # a NaN target was sent without a limit
    ramp.set_goal(np.array([1.0]), 1.0)
    np.testing.assert_allclose(ramp.advance(0.1, np.array([0.5])), [0.5])
    np.testing.assert_allclose(ramp.advance(0.1, None), [0.6])


def test_bad_goal_or_speed_fails_named() -> None:
    ramp = TargetRamp(2)
    with pytest.raises(ValueError, match="shape"):
        ramp.set_goal(np.zeros(3), 1.0)
    with pytest.raises(ValueError, match="max_speed"):
        ramp.set_goal(np.zeros(2), 0.0)
