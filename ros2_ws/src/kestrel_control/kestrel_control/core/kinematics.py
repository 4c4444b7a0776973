"""Arm kinematics from the robot description (URDF) with Pinocchio (no rclpy).

The same URDF the simulator attaches (kestrel_description's kestrel_arm.urdf) is read here with
`pinocchio.buildModelFromXML`; the gripper's finger joints are locked open
(`pinocchio.buildReducedModel`), so the model has exactly the arm's joints, in `joint_names`
order. Pinocchio is what ros2_control's kinematics_interface_pinocchio uses.

Usage (training environments, evaluators, controllers):

    from kestrel_control.core.kinematics import ArmKinematics
    kin = ArmKinematics.from_default()            # or ArmKinematics(urdf_xml_text)
    kin.joint_names                               # ('shoulder_pan', ..., 'wrist_3')
    kin.lower, kin.upper, kin.velocity_limit      # [6] rad, rad/s (URDF <limit>)
    pos, rot = kin.forward(q)                     # tcp position (3,) m, rotation (3, 3), world
    jac = kin.jacobian(q)                         # (6, 6): rows vx vy vz wx wy wz (world axes)
    kin.gripper_travel                            # m, finger position when closed

`forward` and `jacobian` return arrays owned by the instance (overwritten by the next call):
copy them to keep them. Frames: the URDF's root (robot_base) is the world frame (the simulator
mounts the arm at the world origin). Units: m, rad.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pinocchio as pin

from kestrel_control.core.description import default_urdf_path

ARM_JOINTS: tuple[str, ...] = (
    "shoulder_pan", "shoulder_lift", "elbow", "wrist_1", "wrist_2", "wrist_3",
)
GRIPPER_JOINT = "finger_left"  # the driven finger; finger_right mimics it
TCP_FRAME = "tcp"


class ArmKinematics:
    """Forward kinematics and Jacobian of the arm's tool centre point (see module docstring)."""

    def __init__(self, urdf_xml: str, joint_names: tuple[str, ...] = ARM_JOINTS,
                 tcp_frame: str = TCP_FRAME) -> None:
        """Raises ValueError (naming the parameter) for a bad URDF, missing joints or frame."""
        try:
            full = pin.buildModelFromXML(urdf_xml)
        except Exception as exc:  # pinocchio raises ValueError/RuntimeError on bad XML
            raise ValueError(f"parameter 'robot_description': cannot parse URDF: {exc}") from exc
        names = list(full.names)
        missing = [j for j in joint_names if j not in names]
        if missing:
            raise ValueError(f"parameter 'robot_description': URDF has no joints {missing}")
        lock = [full.getJointId(n) for n in names[1:] if n not in joint_names]
        self.gripper_travel = 0.0
        if GRIPPER_JOINT in names:
            jid = full.getJointId(GRIPPER_JOINT)
            self.gripper_travel = float(full.upperPositionLimit[full.joints[jid].idx_q])
        # the locked joints (fingers) at their reference: 0 = open; the arm's tcp frame does
        # not depend on them
        model = pin.buildReducedModel(full, lock, pin.neutral(full)) if lock else full
        order = [model.getJointId(n) for n in joint_names]
        if any(model.joints[j].nq != 1 for j in order):
            raise ValueError("parameter 'robot_description': arm joints must be 1-DoF")
        if [model.joints[j].idx_q for j in order] != list(range(len(joint_names))):
            raise ValueError(f"parameter 'joint_names' = {list(joint_names)}: must be the "
                             "URDF's chain order")
        if not model.existFrame(tcp_frame):
            raise ValueError(f"parameter 'tcp_frame' = '{tcp_frame}': no such URDF link/frame")
        self.model = model
        self.data = model.createData()
        self.frame_id = model.getFrameId(tcp_frame)
        self.joint_names = tuple(joint_names)
        self.n = len(joint_names)
        self.lower = np.array(model.lowerPositionLimit, dtype=np.float64)
        self.upper = np.array(model.upperPositionLimit, dtype=np.float64)
        self.velocity_limit = np.array(model.velocityLimit, dtype=np.float64)
        self._q = np.zeros(self.n)
        self._pos = np.zeros(3)
        self._rot = np.zeros((3, 3))
        self._jac = np.zeros((6, self.n))

    @classmethod
    def from_file(cls, path: str | Path, **kwargs) -> ArmKinematics:  # noqa: ANN003
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"parameter 'urdf_file' = '{path}': file not found")
        return cls(p.read_text(), **kwargs)

    @classmethod
    def from_default(cls, **kwargs) -> ArmKinematics:  # noqa: ANN003
        """The packaged robot description (kestrel_description)."""
        return cls.from_file(default_urdf_path(), **kwargs)

    def _set_q(self, q: np.ndarray) -> np.ndarray:
        np.copyto(self._q, q)
        return self._q

    def forward(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """tcp pose at q [n] rad: (position (3,) m, rotation (3, 3)), world frame."""
        q = self._set_q(q)
        pin.framesForwardKinematics(self.model, self.data, q)
        placement = self.data.oMf[self.frame_id]
        np.copyto(self._pos, placement.translation)
        np.copyto(self._rot, placement.rotation)
        return self._pos, self._rot

    def jacobian(self, q: np.ndarray) -> np.ndarray:
        """(6, n) tcp Jacobian at q, world-aligned axes at the tcp: rows (v m/s, w rad/s)."""
        q = self._set_q(q)
        jac = pin.computeFrameJacobian(self.model, self.data, q, self.frame_id,
                                       pin.ReferenceFrame.LOCAL_WORLD_ALIGNED)
        np.copyto(self._jac, jac)
        return self._jac

    def forward_and_jacobian(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(position, rotation, jacobian) at q with one kinematics pass (the controller's)."""
        q = self._set_q(q)
        pin.computeJointJacobians(self.model, self.data, q)  # also the joint placements
        pin.updateFramePlacement(self.model, self.data, self.frame_id)
        placement = self.data.oMf[self.frame_id]
        np.copyto(self._pos, placement.translation)
        np.copyto(self._rot, placement.rotation)
        jac = pin.getFrameJacobian(self.model, self.data, self.frame_id,
                                   pin.ReferenceFrame.LOCAL_WORLD_ALIGNED)
        np.copyto(self._jac, jac)
        return self._pos, self._rot, self._jac
