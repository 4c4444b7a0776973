"""The arm in the MuJoCo world: the robot description's URDF, read by MuJoCo, plus simulator
settings, attached at the world's `robot_mount` site (no rclpy).

The URDF (kestrel_description, the one robot description) gives the kinematics, joint ranges,
damping, inertials and collision shapes. MuJoCo reads it (its `<mujoco><compiler>` block) into an
MjSpec; this module then adds what a URDF cannot say and a real robot's driver provides:
position actuators per joint (gains below; both fingers get the gripper's one target, as the
URDF's `<mimic>` says), contact classes (robot geoms collide with objects, table and bin but not
with each other), gravity compensation (the arm's controller holds its own weight), friction
of the finger pads, colours, and the `end_effector` site at the URDF's `tcp` link.
Worlds without a `robot_mount` site are used as they are (an MJCF with its own arm).
"""

from __future__ import annotations

from pathlib import Path

import mujoco

# kestrel_description's kestrel_arm.urdf: the one robot description the control node reads too
from kestrel_description import urdf_path as default_urdf_path

MOUNT_SITE = "robot_mount"
TCP_LINK = "tcp"
EE_SITE = "end_effector"
ARM_JOINTS: tuple[str, ...] = (
    "shoulder_pan", "shoulder_lift", "elbow", "wrist_1", "wrist_2", "wrist_3",
)
FINGER_JOINTS: tuple[str, ...] = ("finger_left", "finger_right")  # right mimics left
# Position servo stiffness per arm joint, N m / rad (critically damped: dampratio 1).
ARM_KP: tuple[float, ...] = (400.0, 400.0, 300.0, 100.0, 100.0, 50.0)
# Fingers: stiffness N/m and force limit N. Closed target with a 5 cm cube between the fingers
# leaves 2.5 cm of servo error per finger: the force limit (the squeeze) is reached, 40 N per
# finger; with friction 1.5 that holds a 0.1 kg cube far beyond its weight (1 N).
FINGER_KP = 2000.0
FINGER_FORCE = 40.0
FINGER_FRICTION = (1.5, 0.02, 0.001)  # sliding, torsional, rolling (MuJoCo takes the max)
ARMATURE = 0.05  # kg m^2, reflected rotor inertia of the arm joints
FINGER_ARMATURE = 0.01
ROBOT_CONTYPE, ROBOT_CONAFFINITY = 2, 0  # objects/static have conaffinity 3: they touch these
GEOM_SOLREF = (0.004, 1.0)  # the world's contact softness (tabletop.xml's default)
GEOM_SOLIMP = (0.95, 0.99, 0.001, 0.5, 2.0)
LINK_RGBA = (0.82, 0.82, 0.85, 1.0)
DARK_RGBA = (0.3, 0.3, 0.32, 1.0)
DARK_LINKS = ("robot_base", "wrist_1_link", "wrist_3_link", "finger_left_link",
              "finger_right_link")


def robot_spec(urdf: str | Path = "") -> mujoco.MjSpec:
    """MjSpec of the arm: the URDF read by MuJoCo plus the simulator settings above."""
    path = Path(urdf) if str(urdf) else default_urdf_path()
    if not path.is_file():
        raise ValueError(f"parameter 'robot_file' = '{urdf}': file not found")
    try:
        spec = mujoco.MjSpec.from_string(path.read_text())
    except Exception as exc:
        raise ValueError(f"parameter 'robot_file' = '{path}': cannot load URDF: {exc}") from exc
    names = {j.name for j in spec.joints}
    missing = [j for j in (*ARM_JOINTS, *FINGER_JOINTS) if j not in names]
    if missing:
        raise ValueError(f"parameter 'robot_file' = '{path}': no joints {missing}")
    for body in spec.bodies:
        if body.name == "world":
            continue
        body.gravcomp = 1.0
        rgba = DARK_RGBA if body.name in DARK_LINKS else LINK_RGBA
        for geom in body.geoms:
            geom.contype, geom.conaffinity = ROBOT_CONTYPE, ROBOT_CONAFFINITY
            geom.solref, geom.solimp = GEOM_SOLREF, GEOM_SOLIMP
            geom.rgba = rgba
            if body.name.startswith("finger_"):
                geom.friction = FINGER_FRICTION
                geom.condim = 4
    for joint in spec.joints:
        joint.armature = FINGER_ARMATURE if joint.name in FINGER_JOINTS else ARMATURE
    tcp = spec.body(TCP_LINK)
    if tcp is None:
        raise ValueError(f"parameter 'robot_file' = '{path}': no link '{TCP_LINK}'")
    tcp.add_site(name=EE_SITE, size=[0.01, 0.01, 0.01], group=4)
    joints = {j.name: j for j in spec.joints}
    for name, kp in zip(ARM_JOINTS, ARM_KP, strict=True):
        act = spec.add_actuator(name=name, target=name, trntype=mujoco.mjtTrn.mjTRN_JOINT)
        act.set_to_position(kp=kp, dampratio=1.0)
        act.ctrlrange = joints[name].range
        act.ctrllimited = mujoco.mjtLimited.mjLIMITED_TRUE
    for name in FINGER_JOINTS:
        act = spec.add_actuator(name=name, target=name, trntype=mujoco.mjtTrn.mjTRN_JOINT)
        act.set_to_position(kp=FINGER_KP, dampratio=1.0)
        act.ctrlrange = joints[name].range
        act.ctrllimited = mujoco.mjtLimited.mjLIMITED_TRUE
        act.forcerange = (-FINGER_FORCE, FINGER_FORCE)
        act.forcelimited = mujoco.mjtLimited.mjLIMITED_TRUE
    return spec


def attach_robot(world: mujoco.MjSpec, urdf: str | Path = "") -> bool:
    """Attach the arm at the world's `robot_mount` site; False (nothing done) without one."""
    mount = world.site(MOUNT_SITE)
    if mount is None:
        return False
    arm = robot_spec(urdf)
    base = arm.worldbody.first_body()
    frame = world.worldbody.add_frame(pos=mount.pos, quat=mount.quat)
    frame.attach_body(base, "", "")
    return True
