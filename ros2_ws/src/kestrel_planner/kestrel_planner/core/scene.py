"""The planner's scene from a perception result's detection arrays (pure Python + numpy; the
node shell turns the message into arrays with `kestrel_common.conversions.detection_arrays`).

One SceneObject per class name: the detection with a 3D position first, then the highest
score. Items that cannot become scene objects are counted, never silently dropped.
"""

from __future__ import annotations

import math

import numpy as np

from kestrel_planner.core.plan import SceneObject
from kestrel_planner.core.skills import NAME_RE

POSITION_NONE = 0  # PerceptionResult.POSITION_NONE


def scene_from_detections(class_names: list[str], class_index: np.ndarray, score: np.ndarray,
                          position_source: np.ndarray, position: np.ndarray
                          ) -> tuple[list[SceneObject], dict[str, int]]:
    """class_index, score, position_source: [D]; position: [D, 3] m. Returns the scene
    objects and the counts of skipped items: perception_bad_name (class index outside
    class_names or a name the plan grammar cannot refer to) and perception_nonfinite_position
    (a position that claims a source but is not finite; that detection still counts, without
    a position)."""
    best: dict[str, tuple[tuple[bool, float], SceneObject]] = {}
    skipped = {"perception_bad_name": 0, "perception_nonfinite_position": 0}
    for k, s, src, p in zip(class_index.tolist(), score.tolist(), position_source.tolist(),
                            position.tolist(), strict=True):
        name = class_names[k] if k < len(class_names) else ""
        if not NAME_RE.match(name):
            skipped["perception_bad_name"] += 1
            continue
        pos = None
        if src != POSITION_NONE:
            if all(math.isfinite(v) for v in p):
                pos = (p[0], p[1], p[2])
            else:
                skipped["perception_nonfinite_position"] += 1
        key = (pos is not None, float(s))
        if name not in best or key > best[name][0]:
            best[name] = (key, SceneObject(name, name, pos))
    return [obj for _, obj in best.values()], skipped
