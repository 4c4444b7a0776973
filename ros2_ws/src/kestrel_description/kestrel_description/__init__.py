"""Kestrel robot description: where the URDF is (no ROS needed).

    from kestrel_description import urdf_path, read_urdf
    urdf_path()   # Path of kestrel_arm.urdf (the installed package's, or the source tree's)
    read_urdf()   # its XML text: what a `robot_description` parameter holds

ROS nodes may also find it as share/kestrel_description/urdf/kestrel_arm.urdf
(ament_index_python.get_package_share_directory("kestrel_description")).
"""

from __future__ import annotations

from pathlib import Path

ROBOT_NAME = "kestrel_arm"


def urdf_path(robot: str = ROBOT_NAME) -> Path:
    """Path of `<robot>.urdf` shipped in this package. Raises FileNotFoundError."""
    path = Path(__file__).resolve().parent / "urdf" / f"{robot}.urdf"
    if not path.is_file():
        raise FileNotFoundError(f"robot description '{robot}': {path} not found")
    return path


def read_urdf(robot: str = ROBOT_NAME) -> str:
    """The URDF XML text of `robot`."""
    return urdf_path(robot).read_text()
