"""The planner node's input side (executor threads, the subscriptions' mutually exclusive
callback group): the latest camera frame, perception scene, joint positions and end-effector
position, kept under the node's lock for the goals and the execution timer. Inputs are kept
only while the node is configured; a bad message is a counted drop. A scene whose stamp is
ahead of the node clock is refused (core/scene_time.py).

A mixin of PlannerNode (planner_node.py), which owns the state used here: `core`, `_lock`,
`_image`, `_scene`, `_frame_id`, `_joints`, `_ee`, `_scene_age`, `_scene_time`, and
`_clock_now` (the node clock, after a backwards jump has been handled)."""

from __future__ import annotations

import math
import time

from geometry_msgs.msg import PointStamped
from kestrel_interfaces.msg import PerceptionResult
from sensor_msgs.msg import Image, JointState

from kestrel_common.conversions import (ConversionError, detection_arrays, image_to_numpy,
                                         stamp_to_ns)
from kestrel_planner.core.scene import scene_from_detections


class PlannerInputs:
    """PlannerNode's subscription callbacks (see the module docstring)."""

    def _on_image(self, msg: Image) -> None:
        if self.core is None:  # not configured (cleaned up): inputs are not kept
            return
        try:
            arr = image_to_numpy(msg)
        except ConversionError as exc:
            self.drop(f"image_{exc.reason}", str(exc))
            return
        with self._lock:
            self._image = arr

    def _on_scene(self, msg: PerceptionResult) -> None:
        if self.core is None:  # not configured (cleaned up): inputs are not kept
            return
        self._scene_age.add((self.get_clock().now().nanoseconds
                             - stamp_to_ns(msg.header.stamp)) * 1e-9)
        self.counters.inc("perception_results")
        try:
            d = detection_arrays(msg)
        except ConversionError as exc:
            self.drop(exc.reason, str(exc))
            return
        objects, skipped = scene_from_detections(list(msg.class_names), d["class_index"],
                                                 d["score"], d["position_source"],
                                                 d["position"])
        for reason, n in skipped.items():
            if n:
                self.drop(reason, f"{n} detection(s) in the perception result")
        now = self._clock_now()
        with self._lock:
            why = self._scene_time.take(stamp_to_ns(msg.header.stamp), now)
            if not why:
                self._scene, self._frame_id = objects, msg.header.frame_id
        if why:
            self.drop("perception_stamp_ahead", why)

    def _on_joints(self, msg: JointState) -> None:
        if self.core is None:  # not configured (cleaned up): inputs are not kept
            return
        with self._lock:
            self._joints = (list(msg.position), time.monotonic())

    def _on_ee(self, msg: PointStamped) -> None:
        if self.core is None:  # not configured (cleaned up): inputs are not kept
            return
        p = msg.point
        if not all(math.isfinite(v) for v in (p.x, p.y, p.z)):
            self.drop("ee_nonfinite", f"ee position {p}")
            return
        with self._lock:
            self._ee = ((p.x, p.y, p.z), time.monotonic())
