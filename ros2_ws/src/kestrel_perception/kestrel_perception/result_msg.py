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
import time

import numpy as np
from builtin_interfaces.msg import Time
from kestrel_common.conversions import make_header
from kestrel_interfaces.msg import PerceptionResult, StageTiming
from kestrel_models.perception import PositionSource
from sensor_msgs.msg import Image

from kestrel_perception.core import CameraModel, PerceptionOutput
from kestrel_perception.result_cdr import CdrWriter

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

    def detection_fields(self, cams: list[CameraModel], out: PerceptionOutput
                         ) -> dict[str, np.ndarray] | None:
        """The parallel detection arrays of the message, by field name (None: no detections).
        bbox [D,4] px centre/size, position [D,3] m, position_variance [D] m^2."""
        a = out.detection_arrays()
        if not len(a):
            return None
        src, cam = a.position_source, a.camera_index  # [D] uint8, [D] uint32
        pos = a.position  # [D,3] m, NaN rows where NONE
        cam_pos = np.stack([c.T_base_from_cam[:3, 3] for c in cams])[cam]  # [D,3] m
        std = np.where(src == int(PositionSource.LIDAR), POSITION_STD_LIDAR,
                       POSITION_STD_DEPTH_REL * np.linalg.norm(pos - cam_pos, axis=1))
        std[src == int(PositionSource.NONE)] = np.nan
        boxes = a.box_xyxy  # [D,4] px
        return {"camera_index": cam, "class_index": a.class_index, "score": a.score,
                "bbox": np.concatenate([(boxes[:, :2] + boxes[:, 2:]) * 0.5,
                                        boxes[:, 2:] - boxes[:, :2]], axis=1),
                "position_source": src, "position": pos, "position_variance": std * std}

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
        fields = self.detection_fields(cams, out)
        if fields is not None:
            for name, (typecode, _) in _DETECTION_FIELDS.items():
                setattr(res, name, _array(typecode, fields[name]))
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

    def build_cdr(self, stamp_ns: int, image_stamps_ns: list[int], cams: list[CameraModel],
                  out: PerceptionOutput) -> CdrWriter:
        """The same result as `build` written as CDR (result_cdr.py) up to and including the
        depths; the caller appends `timings(...)` and `f64(latency)`, then takes `payload()`.
        The arrays are referenced, not copied, until payload()."""
        w = CdrWriter()
        w.header(stamp_ns, self.frame_id)
        w.strings(self.class_names)
        w.u32(len(image_stamps_ns))
        for st in image_stamps_ns:
            w.time(st)
        w.strings([cam.frame_id for cam in cams])
        fields = self.detection_fields(cams, out)
        for name, (_, dtype) in _DETECTION_FIELDS.items():
            w.array(fields[name] if fields is not None else _EMPTY, dtype)
        for maps, encoding in ((out.masks, "mono8"), (out.depths, out.depth_encoding)):
            w.u32(len(maps))
            for i, m in enumerate(maps):  # camera i's map (none without the head)
                w.image(image_stamps_ns[i], cams[i].frame_id, m, encoding)
        return w


class ResultPublisher:
    """Builds and publishes one result per frame: as CDR bytes (result_cdr.py) when `cdr`
    (the node sets it from `matches_rmw` at configure), else as a message object.
    `publisher` is anything with publish(msg | bytes) (an rclpy Publisher)."""

    def __init__(self, builder: ResultBuilder, publisher, cdr: bool) -> None:  # noqa: ANN001
        self.builder, self.publisher, self.cdr = builder, publisher, cdr

    def publish(self, stamp_ns: int, image_stamps_ns: list[int], cams: list[CameraModel],
                out: PerceptionOutput, extra: dict[str, float], t_build: float,
                newest_recv_s: float) -> tuple[float, float]:
        """Build (timings: out.timings, extra, then "build" = now - t_build) and publish;
        latency = now - newest_recv_s (time.monotonic). Returns (build s, latency s)."""
        if self.cdr:  # one copy of the maps, in payload()
            w = self.builder.build_cdr(stamp_ns, image_stamps_ns, cams, out)
            build = time.monotonic() - t_build
            w.timings({**out.timings, **extra, "build": build})
            latency = time.monotonic() - newest_recv_s  # (the payload join follows)
            w.f64(latency)
            self.publisher.publish(w.payload())
        else:
            msg = self.builder.build(stamp_ns, image_stamps_ns, cams, out, extra)
            build = time.monotonic() - t_build
            msg.timings.append(StageTiming(name="build", duration=build))
            msg.latency = latency = time.monotonic() - newest_recv_s
            self.publisher.publish(msg)
        return build, latency


# the detection arrays in .msg order: (array.array typecode for message objects, CDR dtype)
_DETECTION_FIELDS = {"camera_index": ("I", "<u4"), "class_index": ("H", "<u2"),
                     "score": ("f", "<f4"), "bbox": ("f", "<f4"),
                     "position_source": ("B", "u1"), "position": ("d", "<f8"),
                     "position_variance": ("d", "<f8")}
_EMPTY = np.zeros(0)


def matches_rmw(builder: ResultBuilder, serialize, deserialize) -> bool:
    """Whether `build_cdr` writes what the rmw's serialiser (`serialize`, e.g.
    rclpy.serialization.serialize_message) makes of `build` for a sample result with
    detections, masks, 16UC1 depths, non-ASCII frame ids and timings (same bytes outside the
    padding), and `deserialize(payload, PerceptionResult)` gives back the same message."""
    from kestrel_perception.core import Detection
    K = np.array([[100.0, 0.0, 32.0], [0.0, 100.0, 24.0], [0.0, 0.0, 1.0]])
    T = np.eye(4)
    T[:3, 3] = (1.0, -2.0, 0.5)
    cams = [CameraModel(K, 64, 48, "cam_0"), CameraModel(K, 64, 48, "kamera_ü", T)]
    dets = [Detection(0, 1, builder.class_names[min(1, len(builder.class_names) - 1)], 0.75,
                      np.array([1, 2, 30, 40], np.float32), np.array([0.5, 0.0, 3.0]),
                      PositionSource.LIDAR),
            Detection(1, 0, builder.class_names[0], 0.5, np.array([0, 0, 9, 7], np.float32),
                      np.array([1.0, 2.0, 9.5]), PositionSource.PREDICTED_DEPTH)]  # no NaN:
    # the round trip compares with ==
    rng = np.random.default_rng(0)
    masks = [rng.integers(0, 3, (5, 7), dtype=np.uint8) for _ in cams]
    depths = [rng.integers(0, 60000, (5, 7), dtype=np.uint16) for _ in cams]
    out = PerceptionOutput(123_456_789_012, dets, masks, depths, {"model": 0.25},
                           depth_encoding="16UC1", output_stride=1)
    stamps = [123_456_789_012, 123_456_789_999]
    timings = {"model": 0.25, "build": 1e-3}
    msg = builder.build(123_456_789_012, stamps, cams, out, {"build": 1e-3})
    msg.latency = 0.0125
    w = builder.build_cdr(123_456_789_012, stamps, cams, out)
    w.timings(timings)
    w.f64(0.0125)
    try:  # a payload the rmw cannot read back (e.g. a field added to the .msg) is a "no"
        return w.same_as(bytes(serialize(msg))) and \
            deserialize(w.payload(), PerceptionResult) == msg
    except Exception:  # noqa: BLE001 - any failure means: publish message objects
        return False
