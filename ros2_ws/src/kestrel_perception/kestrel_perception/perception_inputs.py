"""The perception node's input side: camera images, CameraInfo, camera poses and LiDAR clouds
from the node's subscriptions (`receive.mode` 'executor', the subscriptions' mutually exclusive
callback group) or from its receiver processes (`receive.mode` 'processes', core/receivers.py:
the `_take_*` methods, called on the receiver thread). Each message is converted and checked
(msg_inputs.py; a bad one is a named drop), counted as received or lost (core/loss.py) and
stored in the synchroniser (core/sync.py); then the newest complete set is processed at once
(`processing` 'callback', under the processing lock) or the worker thread is woken.

A mixin of PerceptionNode (perception_node.py), which owns the state used here: `_active`,
`sync`, `core`, `_gaps`, `_poses`, `_inline`, `_proc_lock`, `_wake`, and `_drain` (process
the newest complete sets)."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
from geometry_msgs.msg import PoseStamped
from kestrel_common.conversions import (
    DISTORTION_ADVICE,
    ConversionError,
    camera_info_is_distorted,
    camera_info_to_k,
    stamp_to_ns,
)
from sensor_msgs.msg import CameraInfo, Image, PointCloud2

from kestrel_perception.core.loss import message_sequence, ring_sequence
from kestrel_perception.core.params import pose_to_matrix
from kestrel_perception.core.sync import Stamped
from kestrel_perception.msg_inputs import InputDrop, cloud_xyz, image_rgb


class PerceptionInputs:
    """PerceptionNode's input callbacks and their path to processing (see the module doc)."""

    def _on_image(self, cam: int, msg: Image, info: dict | None = None) -> None:
        if not self._active or self.sync is None:
            return
        recv_s = time.monotonic()
        stamp_ns = stamp_to_ns(msg.header.stamp)
        # taken (received_camera_<i>), and those lost before it (lost_camera_<i>); before
        # validation: a bad image is counted under its reason, not also as lost
        self._gaps[cam].add(stamp_ns, *message_sequence(info))
        try:
            rgb = image_rgb(msg)  # [H,W,3] uint8 view on msg.data, RGB order
        except InputDrop as exc:
            self.drop(exc.counter, f"camera {cam}: {exc}")
            return
        self._take_image(cam, stamp_ns, recv_s, rgb, msg.header.frame_id, gap_seen=True)

    def _take_image(self, cam: int, stamp_ns: int, recv_s: float, rgb: np.ndarray,
                    frame_id: str, ticket: tuple | None = None, *,
                    gap_seen: bool = False) -> None:
        """One usable image (from a callback, or a receiver process: recv_s is its receipt
        there, on the same monotonic clock). gap_seen: it was already counted as received
        (core/loss.py); from a receiver process the ring version (ticket[2]) is its sequence
        number, so messages replaced in the ring count as lost."""
        sync = self.sync
        if not self._active or sync is None:
            return
        if not gap_seen:
            self._gaps[cam].add(stamp_ns, *ring_sequence(ticket))

        def store() -> None:
            sync.add_image(cam, Stamped(stamp_ns, recv_s, (rgb, frame_id), ticket))
            if self._inline and self.core is not None:  # copy to pinned memory on arrival:
                self.core.staging.prestage_image(cam, rgb)  # the frame skips it (staging.py)

        self._ready(store)

    def _on_jump(self, from_ns: int, to_ns: int) -> None:
        """The input stamps jumped back (core/sync.py): logged once per jump."""
        self.get_logger().warning(
            f"input stamps jumped back {(from_ns - to_ns) * 1e-9:.3f} s (from {from_ns} to "
            f"{to_ns} ns: a bag loop or replay, a sim restart?): the synchroniser starts over "
            f"(time_jumps_back {self.counters.get('time_jumps_back')})")

    def _on_info(self, cam: int, msg: CameraInfo) -> None:
        try:
            k = camera_info_to_k(msg)
        except ConversionError as exc:
            self.drop("dropped_bad_camera_info", f"camera {cam}: {exc}")
            return
        if camera_info_is_distorted(msg):  # used with K alone: counted and warned about
            n = self.counters.inc("unrectified_camera_info")
            self.get_logger().warning(
                f"camera {cam}: camera_info has distortion D = {list(msg.d)} (total {n}): "
                f"{DISTORTION_ADVICE}", throttle_duration_sec=10.0)
        self._take_info(cam, stamp_to_ns(msg.header.stamp), time.monotonic(), k,
                        int(msg.width), int(msg.height))

    def _take_info(self, cam: int, stamp_ns: int, recv_s: float, k: np.ndarray, width: int,
                   height: int) -> None:
        """One usable CameraInfo (from a callback, or a camera's receiver process)."""
        if not self._active or self.sync is None:
            return
        self.sync.add_info(cam, Stamped(stamp_ns, recv_s, (k, width, height)))
        self._ready()

    def _on_pose(self, cam: int, msg: PoseStamped) -> None:
        if not self._active:
            return
        frame = self.params["frame_id"]
        p, q = msg.pose.position, msg.pose.orientation
        try:
            if msg.header.frame_id not in ("", frame):
                raise ValueError(f"frame '{msg.header.frame_id}' is not frame_id '{frame}'")
            self._poses[cam] = pose_to_matrix([p.x, p.y, p.z, q.x, q.y, q.z, q.w])
        except ValueError as exc:
            self.drop("dropped_bad_pose", f"camera {cam}: {exc}")

    def _on_points(self, msg: PointCloud2, info: dict | None = None) -> None:
        if not self._active or self.sync is None:
            return
        recv_s = time.monotonic()
        stamp_ns = stamp_to_ns(msg.header.stamp)
        # (as _on_image) received_lidar, lost_lidar; a bad cloud counts under its reason
        self._gaps[-1].add(stamp_ns, *message_sequence(info))
        try:
            xyz = cloud_xyz(msg, self.params["lidar.max_points"], self.params["frame_id"])
        except InputDrop as exc:
            self.drop(exc.counter, str(exc))
            return
        self._take_points(stamp_ns, recv_s, xyz, gap_seen=True)

    def _take_points(self, stamp_ns: int, recv_s: float, xyz: np.ndarray,
                     ticket: tuple | None = None, *, gap_seen: bool = False) -> None:
        sync = self.sync
        if not self._active or sync is None:
            return
        if not gap_seen:  # (as _take_image)
            self._gaps[-1].add(stamp_ns, *ring_sequence(ticket))
        if xyz.shape[0] == 0:  # counted and logged, then used: the set completes without
            # waiting for a cloud that will not come, and runs on predicted depth alone
            n = self.counters.inc("empty_cloud")
            self.get_logger().warning(
                f"a LiDAR cloud with 0 points (total {n}): that frame's detections get "
                "predicted-depth positions only", throttle_duration_sec=1.0)

        def store() -> None:  # the cloud often completes its set (core/sync.py)
            sync.add_cloud(Stamped(stamp_ns, recv_s, xyz, ticket))
            if self._inline and self.core is not None:  # as the images: pre-staged
                self.core.staging.prestage_points(xyz)

        self._ready(store)

    def _ready(self, store: Callable[[], None] | None = None) -> None:
        """A message arrived: `store()` it (synchroniser, prestaging), then process the newest
        complete set now (callback mode) or wake the worker. In callback mode both run under
        the processing lock: prestaging writes the staging buffers a frame reads, and the
        receiver thread (receive: processes) is not serialised with the executor's callbacks."""
        if not self._inline:
            if store is not None:
                store()
            self._wake.set()
            return
        with self._proc_lock:
            if store is not None:
                store()
            self._drain()
