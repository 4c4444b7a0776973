"""Property-based tests of the control core's input paths (hypothesis): whatever joint states,
stamps and targets arrive, a tick never raises, a command sent is finite and within the joint
limits, and every input it refuses is counted; the target speed limit never runs ahead."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kestrel_control.core.policy_runner import PolicyRunner, RunnerConfig
from kestrel_control.core.safety import SafetyCounters, SafetyStatus
from kestrel_control.core.target_limit import TargetRamp, speed_limit, step_toward
from kestrel_models.control.policy import PolicyConfig

N = 6
LOWER, UPPER = np.full(N, -2.0), np.full(N, 2.0)
MS = 1_000_000
NOW = 10_000 * MS

values = st.floats(allow_nan=True, allow_infinity=True, width=64)
rows = st.lists(values, min_size=N, max_size=N)
# stamps: fresh, stale, from the future, zero, far off (another clock)
stamps = st.one_of(st.integers(NOW - 50 * MS, NOW + 5 * MS), st.just(0),
                   st.integers(-(2**62), 2**62))
RUNNER_SETTINGS = settings(max_examples=200, deadline=None,
                           suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def runner() -> tuple[PolicyRunner, SafetyCounters]:
    counters = SafetyCounters()
    cfg = RunnerConfig(joint_lower=LOWER, joint_upper=UPPER, seed=5, warmup_steps=1,
                       policy=PolicyConfig.tiny(obs_dim=32, num_actions=8), action_scale=0.1,
                       obs_position_margin=0.5, max_obs_velocity=100.0)
    return PolicyRunner(cfg, counters=counters), counters


def _refused(c: SafetyCounters) -> int:
    return c.stale_inputs + c.rejected_nonfinite + c.rejected_implausible


@RUNNER_SETTINGS
@given(pos=rows, vel=rows, stamp=stamps, target=rows, reset=st.booleans())
def test_any_joint_state_and_target_is_refused_counted_or_commanded_within_limits(
        runner, pos, vel, stamp, target, reset) -> None:
    r, counters = runner
    if reset:  # an activation in between: nothing from before is used
        r.reset()
    r.joint_states.write(np.array([pos, vel]), stamp)
    r.target.write(np.array(target), stamp)
    before = _refused(counters)
    command, info = r.step(NOW)  # never raises
    q, v, tgt = np.array(pos), np.array(vel), np.array(target)
    bad = not (np.isfinite(q).all() and np.isfinite(v).all() and np.isfinite(tgt).all())
    stale = not abs(NOW - stamp) * 1e-9 <= 0.02
    implausible = not bad and (np.any(q < LOWER - 0.5) or np.any(q > UPPER + 0.5)
                               or np.any(np.abs(v) > 100.0))
    if bad or stale or implausible:  # refused, and counted once
        assert info.status is not SafetyStatus.OK
        assert _refused(counters) == before + 1, (info.status, pos, vel, stamp)
    if info.valid:  # whatever was sent: finite, within the limits
        assert np.isfinite(command).all() and np.all(command >= LOWER) and \
            np.all(command <= UPPER), command


@settings(max_examples=300, deadline=None)
@given(cur=rows, goal=rows, step=st.floats(0.0, 10.0))
def test_step_toward_never_moves_a_joint_more_than_the_step(cur, goal, step) -> None:
    c, g = np.nan_to_num(np.array(cur)), np.nan_to_num(np.array(goal))
    c, g = np.clip(c, -1e6, 1e6), np.clip(g, -1e6, 1e6)
    out = step_toward(c, g, step)
    assert np.all(np.abs(out - c) <= step * (1 + 1e-12) + 1e-9)
    # toward the goal, never past it
    assert np.all(np.abs(g - out) <= np.abs(g - c) + 1e-9)


@settings(max_examples=300, deadline=None)
@given(start=rows, goal=rows, speed=st.floats(allow_nan=True, allow_infinity=True),
       dts=st.lists(st.floats(-1.0, 1.0), min_size=1, max_size=30))
def test_target_ramp_never_outruns_its_speed(start, goal, speed, dts) -> None:
    limit = speed_limit(speed)
    ramp = TargetRamp(N)
    g = np.array(goal)
    if limit is None or not np.isfinite(g).all():
        return  # the node drops a negative / NaN speed; a NaN goal is the safety filter's
    ramp.set_goal(g, limit)
    q = np.clip(np.nan_to_num(np.array(start)), -1e3, 1e3)
    last = ramp.advance(0.0, q)
    assert last is not None
    for dt in dts:
        nxt = ramp.advance(dt, None)
        if nxt is None:
            assert not ramp.active and np.array_equal(last, g)
            break
        if limit != math.inf:  # (float64 rounding of the positions aside)
            ulps = 1e-12 * max(np.abs(last).max(), np.abs(nxt).max())
            assert np.all(np.abs(nxt - last) <= limit * max(dt, 0.0) * (1 + 1e-9) + 1e-9 + ulps)
        last = nxt
