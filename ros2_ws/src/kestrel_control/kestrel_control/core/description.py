"""The robot description (URDF) for the control node, without Pinocchio: where it is and the
limits of a joint (no rclpy). Kinematics: kestrel_control.core.kinematics."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

# kestrel_description's kestrel_arm.urdf: the one robot description the sim reads too
from kestrel_description import urdf_path as default_urdf_path


def read_description(urdf_file: str = "") -> str:
    """URDF text of `urdf_file` ('' = kestrel_description's kestrel_arm.urdf). ValueError
    naming the parameter when it cannot be read."""
    if not urdf_file:
        try:
            return default_urdf_path().read_text()
        except FileNotFoundError as exc:
            raise ValueError(f"parameter 'cartesian.urdf_file' = '': {exc}") from exc
    path = Path(urdf_file)
    if not path.is_file():
        raise ValueError(f"parameter 'cartesian.urdf_file' = '{urdf_file}': file not found")
    return path.read_text()


def joint_limits(urdf: str, joint: str) -> tuple[float, float]:
    """(lower, upper) of `joint`'s <limit> in the URDF text. ValueError naming
    'gripper.joint' when the joint or its limit is missing."""
    try:
        root = ET.fromstring(urdf)
    except ET.ParseError as exc:
        raise ValueError(f"parameter 'cartesian.urdf_file': not XML: {exc}") from exc
    for j in root.iter("joint"):
        if j.get("name") == joint:
            limit = j.find("limit")
            if limit is None or limit.get("upper") is None:
                break
            return float(limit.get("lower", "0")), float(limit.get("upper"))
    raise ValueError(f"parameter 'gripper.joint' = '{joint}': no such joint with a <limit> in "
                     "the robot description")
