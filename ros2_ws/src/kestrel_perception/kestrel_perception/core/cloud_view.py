"""Zero-copy xyz view on a PointCloud2's data (no rclpy: reads the message's attributes).

The common LiDAR layout (x, y, z FLOAT32 little-endian at offsets 0, 4, 8 of each point,
rows without padding) is read as a strided numpy view on the message buffer: no per-field
copies. The core copies the view once, into its pinned staging buffer. Other layouts return
None and the caller uses the generic kestrel_common.conversions.pointcloud2_to_xyz.
"""

from __future__ import annotations

import numpy as np

FLOAT32 = 7  # sensor_msgs/PointField.FLOAT32


def xyz_view(msg: object) -> np.ndarray | None:
    """PointCloud2 -> [N,3] float32 view (strides (point_step, 4)) on msg.data, or None when
    the layout is not x/y/z float32 at 0/4/8 little-endian with row_step = width*point_step
    (or the data size does not match: the generic converter then raises the right error)."""
    fields = {f.name: f for f in msg.fields}  # type: ignore[attr-defined]
    for axis, off in (("x", 0), ("y", 4), ("z", 8)):
        f = fields.get(axis)
        if f is None or f.offset != off or f.datatype != FLOAT32 or f.count not in (0, 1):
            return None
    n = int(msg.width) * int(msg.height)  # type: ignore[attr-defined]
    step = int(msg.point_step)  # type: ignore[attr-defined]
    if msg.is_bigendian or step < 12 or step % 4 or n == 0 or \
            int(msg.row_step) != int(msg.width) * step:  # type: ignore[attr-defined]
        return None
    data = msg.data  # type: ignore[attr-defined]
    buf = data if isinstance(data, np.ndarray) else np.frombuffer(data, dtype=np.uint8)
    if buf.nbytes != n * step:
        return None
    floats = buf.view(np.float32) if buf.dtype != np.float32 else buf
    return np.lib.stride_tricks.as_strided(floats, shape=(n, 3), strides=(step, 4),
                                           writeable=False)
