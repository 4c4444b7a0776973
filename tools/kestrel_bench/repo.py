"""Where the repository's importable sources are, for runs outside the built environment
(a copy of the tree on a GPU machine): `ensure_paths("models", "kestrel_control")` puts each
missing source folder on sys.path and on PYTHONPATH (child processes import the same)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = {  # top-level package -> its source folder in the repository
    "kestrel_models": "models",
    "kestrel_common": "ros2_ws/src/kestrel_common",
    "kestrel_control": "ros2_ws/src/kestrel_control",
    "kestrel_perception": "ros2_ws/src/kestrel_perception",
    "kestrel_planner": "ros2_ws/src/kestrel_planner",
    "ros_harness": "tests",
    "kestrel_bench": "tools",
}


def ensure_paths(*packages: str) -> None:
    """Make each package importable from the repository's sources if it is not already."""
    for name in packages:
        if importlib.util.find_spec(name) is not None:
            continue
        folder = str(ROOT / SOURCES[name])
        sys.path.insert(0, folder)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [folder] + [p for p in [os.environ.get("PYTHONPATH", "")] if p])
