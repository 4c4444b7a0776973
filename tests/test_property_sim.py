"""Property-based tests of the sim core's input paths (hypothesis): whatever joint targets,
gripper targets and ResetWorld seeds arrive, SimWorld applies a value within the limits or
refuses it with a typed error (JointCommandError / ValueError) and keeps its previous state;
the physics stays finite."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kestrel_sim.core.world import JointCommandError, SimWorld, SimWorldConfig

SETTINGS = settings(max_examples=200, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])
FLOATS = st.floats(allow_nan=True, allow_infinity=True)


@pytest.fixture(scope="module")
def world() -> SimWorld:
    return SimWorld(SimWorldConfig(min_objects=1, max_distractors=2))


@SETTINGS
@given(q=st.lists(FLOATS, max_size=9), gripper=FLOATS)
def test_any_joint_or_gripper_target_is_applied_in_limits_or_refused(world, q, gripper) -> None:
    before = world.joint_targets()
    lower, upper = world.joint_limits
    try:
        applied = world.set_joint_targets(q)
    except JointCommandError:
        assert len(q) != 6 or not all(math.isfinite(v) for v in q)
        assert np.array_equal(world.joint_targets(), before)  # nothing applied
    else:
        assert len(q) == 6 and np.all(applied >= lower) and np.all(applied <= upper)
    g_before = world.gripper_target()
    try:
        g = world.set_gripper_target(gripper)
    except JointCommandError:
        assert not math.isfinite(gripper) and world.gripper_target() == g_before
    else:
        assert 0.0 <= g <= world.info.finger_travel
    world.step(2)
    positions, velocities = world.gripper_state()
    assert np.isfinite(positions).all() and np.isfinite(velocities).all()


@SETTINGS
@given(seed=st.one_of(st.integers(0, 2**32 - 1), st.integers(-(2**63), -1)))
def test_any_reset_seed_gives_a_world_or_a_typed_refusal(world, seed) -> None:
    try:
        world.reset(seed)
    except ValueError:
        assert seed < 0
        return
    assert world.seed == seed
    assert np.isfinite(world.joint_targets()).all()
