"""The checkout's source packages first on sys.path (imported for that effect by the scripts
beside it): a script run from a checkout uses the packages as they are there, with no rebuild
after an edit, and runs with the project's venv alone (no `source scripts/env.sh`)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# kestrel_models, the benchmark harness, and every ROS package of the workspace
PACKAGES = (ROOT / "models", ROOT / "tools",
            *sorted(p for p in (ROOT / "ros2_ws/src").iterdir() if (p / "package.xml").is_file()))
for path in reversed(PACKAGES):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
