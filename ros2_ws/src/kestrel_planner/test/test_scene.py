"""scene_from_detections: one scene object per class from a perception result's detection
arrays (a 3D position preferred, then the best score), bad items counted."""

from __future__ import annotations

import math

import numpy as np

from kestrel_planner.core.scene import scene_from_detections

NAMES = ["background", "red_cube", "bin", "bad name!"]
NONE, LIDAR, DEPTH = 0, 1, 2


def scene(class_index, score, source, position):  # noqa: ANN001, ANN201
    return scene_from_detections(NAMES, np.array(class_index, np.uint16),
                                 np.array(score, np.float32), np.array(source, np.uint8),
                                 np.array(position, np.float64).reshape(-1, 3))


def test_best_detection_per_class_position_first() -> None:
    nan = math.nan
    objects, skipped = scene(
        [1, 1, 1, 2, 2],
        [0.95, 0.6, 0.7, 0.3, 0.8],
        [NONE, LIDAR, DEPTH, LIDAR, NONE],
        [[nan] * 3, [0.4, 0.0, 0.02], [0.5, 0.1, 0.0], [0.3, 0.3, 0.0], [nan] * 3])
    by_name = {o.name: o for o in objects}
    assert set(by_name) == {"red_cube", "bin"}
    # red_cube: the 0.95 detection has no position; of the positioned ones 0.7 wins
    assert by_name["red_cube"].position == (0.5, 0.1, 0.0)
    assert by_name["bin"].position == (0.3, 0.3, 0.0)  # positioned beats the 0.8 without
    assert skipped == {"perception_bad_name": 0, "perception_nonfinite_position": 0}


def test_bad_names_and_nonfinite_positions_are_counted() -> None:
    objects, skipped = scene(
        [3, 9, 2, 1],  # "bad name!", out of range, bin, red_cube
        [0.9, 0.9, 0.9, 0.5],
        [LIDAR, LIDAR, LIDAR, NONE],
        [[0, 0, 0], [0, 0, 0], [math.inf, 0, 0], [math.nan] * 3])
    assert skipped == {"perception_bad_name": 2, "perception_nonfinite_position": 1}
    by_name = {o.name: o for o in objects}
    assert by_name["bin"].position is None  # kept, without its non-finite position
    assert by_name["red_cube"].position is None  # POSITION_NONE: NaN is not counted


def test_no_detections() -> None:
    assert scene([], [], [], []) == ([], {"perception_bad_name": 0,
                                         "perception_nonfinite_position": 0})
