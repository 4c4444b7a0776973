"""Input messages -> arrays, with the drop reason of anything unusable (no rclpy).

One place for the checks the perception node makes on arrival, used by the node's own
subscription callbacks (`receive: executor`) and by its receiver processes (`receive:
processes`, perception_receiver_node.py): a bad message is the same named drop either way.
"""

from __future__ import annotations

import numpy as np
from kestrel_common.conversions import ConversionError, image_to_numpy, pointcloud2_to_xyz

from kestrel_perception.core.cloud_view import xyz_view


class InputDrop(Exception):
    """A message that cannot be used: `counter` names the drop, the message says why."""

    def __init__(self, counter: str, message: str) -> None:
        super().__init__(message)
        self.counter = counter


def image_rgb(msg: object) -> np.ndarray:
    """sensor_msgs/Image rgb8 or bgr8 -> [H, W, 3] uint8, RGB order (a view on msg.data)."""
    try:
        return image_to_numpy(msg, accept=("rgb8", "bgr8"))  # type: ignore[arg-type]
    except ConversionError as exc:
        raise InputDrop("dropped_bad_encoding" if exc.reason == "bad_encoding"
                        else "dropped_bad_image", str(exc)) from None


def cloud_xyz(msg: object, max_points: int, frame_id: str) -> np.ndarray:
    """sensor_msgs/PointCloud2 in `frame_id` (or no frame) -> [N, 3] float32 (a strided view on
    msg.data for the common x/y/z float32 layout, else a copy). NaN points are kept (the core
    filters and counts them); a cloud with no finite point is dropped."""
    n = int(msg.width) * int(msg.height)  # type: ignore[attr-defined]
    if n > max_points:  # before touching the data
        raise InputDrop("dropped_too_many_points", f"{n} points > lidar.max_points {max_points}")
    frame = msg.header.frame_id  # type: ignore[attr-defined]
    if frame not in ("", frame_id):
        raise InputDrop("dropped_bad_cloud", f"cloud frame '{frame}' is not frame_id "
                                             f"'{frame_id}' (no TF here)")
    try:
        xyz = xyz_view(msg)  # [N,3] float32 view (x,y,z float32 at 0/4/8)
        if xyz is None:  # other layouts: per-field copies
            xyz = pointcloud2_to_xyz(msg)  # type: ignore[arg-type]
    except ConversionError as exc:
        raise InputDrop("dropped_bad_cloud", str(exc)) from None
    # any finite point? (a prefix answers for real clouds without scanning all of them)
    if n > 0 and not np.isfinite(xyz[:1024]).all(axis=1).any() and \
            not np.isfinite(xyz).all(axis=1).any():
        raise InputDrop("dropped_bad_cloud", f"all {n} points are NaN/inf")
    return xyz
