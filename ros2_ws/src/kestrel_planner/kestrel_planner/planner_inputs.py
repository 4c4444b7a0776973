"""The planner node's input side (executor threads, the subscriptions' mutually exclusive
callback group): the latest camera frame, perception scene, joint positions and end-effector
position, kept under the node's lock for the goals and the execution timer. Inputs are kept
only while the node is configured; a bad message is a counted drop. A scene whose stamp is
ahead of the node clock is refused (core/scene_time.py). A goal takes its inputs through
`_goal_inputs`, which waits (bounded by input_wait) for a frame and a scene it may use.

A mixin of PlannerNode (planner_node.py), which owns the state used here: `core`, `_lock`,
`_image`, `_scene`, `_frame_id`, `_joints`, `_ee`, `_scene_age`, `_scene_time`, and
`_inputs_cond` (a Condition on `_lock`) and `_clock_now` (the node clock, after a backwards
jump has been handled)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

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
            self._inputs_cond.notify_all()

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
                self._inputs_cond.notify_all()
        if why:
            self.drop("perception_stamp_ahead", why)

    def _goal_inputs(self, use_image: bool, t_goal: float,
                     give_up: Callable[[], bool]) -> tuple:
        """(camera frame, scene, its frame id, why the scene may not be planned against ('' when
        it may), whether the goal waited) for a goal that arrived at t_goal (monotonic s). A
        goal that finds no camera frame (use_image False) or a scene it may not plan against
        waits for them, up to input_wait s from its arrival or until give_up() (a cancel, the
        node stopping); woken by each kept frame or scene, and every 0.1 s for the clock (a
        scene stamped ahead of it, or too old) and give_up."""
        deadline = t_goal + self.params["input_wait"]
        waited = False
        while True:
            now = self._clock_now()  # takes the lock itself
            with self._inputs_cond:
                image, scene, frame = self._image, list(self._scene), self._frame_id
                stale = self._scene_time.refusal(now)
                left = deadline - time.monotonic()
                if ((use_image or image is not None) and not stale) or left <= 0.0 \
                        or give_up():
                    return image, scene, frame, stale, waited
                waited = True
                self._inputs_cond.wait(min(left, 0.1))

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
