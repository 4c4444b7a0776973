"""One robot description: the simulator (MuJoCo reading the URDF) and the controllers'
kinematics (Pinocchio reading the same URDF) agree (no ROS)."""

from __future__ import annotations

import mujoco
import numpy as np
import pytest

from kestrel_control.core.kinematics import ARM_JOINTS, ArmKinematics, default_urdf_path
from kestrel_sim.core import SimWorld


@pytest.fixture(scope="module")
def kin() -> ArmKinematics:
    return ArmKinematics.from_default()


@pytest.fixture(scope="module")
def world() -> SimWorld:
    return SimWorld()


def test_model_from_the_urdf(kin: ArmKinematics, world: SimWorld) -> None:
    assert kin.joint_names == ARM_JOINTS == world.joint_names
    assert kin.model.nq == 6  # fingers locked out of the arm model
    lo, hi = world.joint_limits
    np.testing.assert_allclose(kin.lower, lo)
    np.testing.assert_allclose(kin.upper, hi)
    assert np.all(kin.velocity_limit > 0)
    assert kin.gripper_travel == pytest.approx(world.gripper_travel) == pytest.approx(0.045)
    assert "<mujoco>" in default_urdf_path().read_text()  # MuJoCo's URDF compiler block


def test_forward_kinematics_agree_within_1e6(kin: ArmKinematics, world: SimWorld) -> None:
    rng = np.random.default_rng(7)
    for _ in range(200):
        q = rng.uniform(kin.lower, kin.upper)
        world.set_joint_positions(q)
        pos_sim, rot_sim = world.end_effector_pose()
        pos, rot = kin.forward(q)
        assert np.abs(pos - pos_sim).max() < 1e-6
        assert np.abs(rot - rot_sim).max() < 1e-6
    world.reset(0)


def test_jacobian_agrees_with_mujoco(kin: ArmKinematics, world: SimWorld) -> None:
    rng = np.random.default_rng(8)
    jp, jr = np.zeros((3, world.model.nv)), np.zeros((3, world.model.nv))
    dofs = world.info.joint_dof_adr
    for _ in range(50):
        q = rng.uniform(kin.lower, kin.upper)
        world.set_joint_positions(q)
        with world.lock:
            mujoco.mj_jacSite(world.model, world.data, jp, jr, world.info.ee_site_id)
        pos, rot, jac = kin.forward_and_jacobian(q)
        np.testing.assert_allclose(jac[:3], jp[:, dofs], atol=1e-9)
        np.testing.assert_allclose(jac[3:], jr[:, dofs], atol=1e-9)
        np.testing.assert_allclose(pos, kin.forward(q)[0], atol=1e-12)
    world.reset(0)


def test_bad_descriptions_fail_naming_the_parameter() -> None:
    with pytest.raises(ValueError, match="robot_description"):
        ArmKinematics("<robot name='x'><link name='a'/></robot>")
    with pytest.raises(ValueError, match="robot_description"):
        ArmKinematics("not xml")
    with pytest.raises(ValueError, match="tcp_frame"):
        ArmKinematics(default_urdf_path().read_text(), tcp_frame="nope")
    with pytest.raises(ValueError, match="urdf_file"):
        ArmKinematics.from_file("/nonexistent.urdf")
