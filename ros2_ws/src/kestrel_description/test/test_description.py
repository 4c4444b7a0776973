"""The packaged URDF is found and well formed (no ROS)."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kestrel_description import read_urdf, urdf_path  # noqa: E402


def test_urdf_found_and_complete() -> None:
    assert urdf_path().name == "kestrel_arm.urdf"
    root = ET.fromstring(read_urdf())
    joints = {j.get("name"): j for j in root.iter("joint")}
    arm = ["shoulder_pan", "shoulder_lift", "elbow", "wrist_1", "wrist_2", "wrist_3"]
    assert all(joints[n].get("type") == "revolute" for n in arm)
    assert joints["finger_left"].get("type") == "prismatic"
    assert joints["finger_right"].find("mimic").get("joint") == "finger_left"
    for link in root.iter("link"):  # MuJoCo needs inertials on moving links
        if link.get("name") not in ("tcp",):
            assert link.find("inertial") is not None, link.get("name")
    assert root.find("mujoco/compiler") is not None
