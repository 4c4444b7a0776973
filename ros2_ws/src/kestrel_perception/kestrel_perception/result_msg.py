"""PerceptionOutput -> kestrel_interfaces/PerceptionResult, built with few Python objects.

Message types only (no rclpy). The detections go out as parallel arrays (PerceptionResult.msg):
each is filled from one numpy array with one memcpy into an `array.array` (the generated setter
takes those as they are; a list or numpy array would be checked element by element in Python).
rclpy serialises a message inside `publish()`, so the mask/depth Image messages and their byte
arrays are reused for the next result once it was published. Not thread-safe: build and
publish from one thread, publish before the next build.
"""

from __future__ import annotations

import array

import numpy as np
from builtin_interfaces.msg import Time
from kestrel_common.conversions import make_header
from kestrel_interfaces.msg import PerceptionResult, StageTiming
from kestrel_models.perception import PositionSource
from sensor_msgs.msg import Image

from kestrel_perception.core import CameraModel, PerceptionOutput

# nominal (not calibrated) 1-sigma position uncertainty (position_variance = sigma^2), m
POSITION_STD_LIDAR = 0.05
POSITION_STD_DEPTH_REL = 0.1  # fraction of the range for predicted-depth positions


def _array(typecode: str, values: np.ndarray) -> array.array:
    """A numpy array -> array.array of `typecode` with one memcpy (values already of the
    matching dtype: float32 'f', float64 'd', uint32 'I', uint16 'H', uint8 'B')."""
    out = array.array(typecode)
    out.frombytes(memoryview(np.ascontiguousarray(values)).cast("B"))
    return out


def fill_map_image(msg: Image, arr: np.ndarray, encoding: str, header) -> Image:
    """Write an [H,W] mono8 / 16UC1 / 32FC1 map into `msg` with ONE memcpy: into its existing
    array('B') when the byte size matches, else into a new one (assigning bytes would make
    the generated setter check every byte in Python)."""
    a = np.ascontiguousarray(arr)
    msg.header = header
    msg.height, msg.width = int(a.shape[0]), int(a.shape[1])
    msg.encoding = encoding
    msg.is_bigendian = 0
    msg.step = int(a.shape[1] * a.itemsize)
    src = memoryview(a).cast("B")
    data = msg.data
    if isinstance(data, array.array) and len(data) == src.nbytes:
        memoryview(data)[:] = src
    else:
        data = array.array("B")
        data.frombytes(src)
        msg.data = data
    return msg


class ResultBuilder:
    """Reused message objects for the results of one node (see the module docstring)."""

    def __init__(self, frame_id: str, class_names: tuple[str, ...]) -> None:
        self.frame_id = frame_id
        self.class_names = list(class_names)
        self._masks: list[Image] = []
        self._depths: list[Image] = []

    def build(self, stamp_ns: int, image_stamps_ns: list[int], cams: list[CameraModel],
              out: PerceptionOutput, extra_timings: dict[str, float] | None = None
              ) -> PerceptionResult:
        """One result: header stamped with the set's stamp (frame_id), per camera its image
        stamp and frame, the detections as parallel arrays, masks, depths, timings."""
        res = PerceptionResult()
        res.header = make_header(stamp_ns, self.frame_id)
        res.class_names = self.class_names
        res.image_stamps = [Time(sec=int(st) // 1_000_000_000, nanosec=int(st) % 1_000_000_000)
                            for st in image_stamps_ns]
        res.camera_frame_ids = [cam.frame_id for cam in cams]
        a = out.detection_arrays()
        if len(a):
            src, cam = a.position_source, a.camera_index  # [D] uint8, [D] uint32
            pos = a.position  # [D,3] m, NaN rows where NONE
            cam_pos = np.stack([c.T_base_from_cam[:3, 3] for c in cams])[cam]  # [D,3] m
            std = np.where(src == int(PositionSource.LIDAR), POSITION_STD_LIDAR,
                           POSITION_STD_DEPTH_REL * np.linalg.norm(pos - cam_pos, axis=1))
            std[src == int(PositionSource.NONE)] = np.nan
            boxes = a.box_xyxy  # [D,4] px
            res.camera_index = _array("I", cam)
            res.class_index = _array("H", a.class_index)
            res.score = _array("f", a.score)
            res.bbox = _array("f", np.concatenate([(boxes[:, :2] + boxes[:, 2:]) * 0.5,
                                                   boxes[:, 2:] - boxes[:, :2]], axis=1))
            res.position_source = _array("B", src)
            res.position = _array("d", pos)
            res.position_variance = _array("d", std * std)
        headers = [make_header(st, cam.frame_id)
                   for st, cam in zip(image_stamps_ns, cams, strict=True)]
        while len(self._masks) < len(out.masks):
            self._masks.append(Image())
        while len(self._depths) < len(out.depths):
            self._depths.append(Image())
        res.masks = [fill_map_image(self._masks[i], m, "mono8", headers[i])
                     for i, m in enumerate(out.masks)]
        res.depths = [fill_map_image(self._depths[i], m, out.depth_encoding, headers[i])
                      for i, m in enumerate(out.depths)]
        timings = {**out.timings, **(extra_timings or {})}
        res.timings = [StageTiming(name=k, duration=float(v)) for k, v in timings.items()]
        return res

