"""The conversions module: ROS messages <-> numpy arrays and plain values.

Generic conversions shared by every node shell (images, camera info, point clouds, stamps,
diagnostics), and the numpy view of kestrel_interfaces/PerceptionResult's detection arrays
that several packages read (`detection_arrays`, duck-typed: no import of the message). Bad
messages raise `ConversionError(reason, message)`; the node counts the `reason` on
/diagnostics and drops the message. Package-specific messages are built in the node files
themselves.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
from builtin_interfaces.msg import Time
from diagnostic_msgs.msg import DiagnosticStatus, KeyValue
from sensor_msgs.msg import CameraInfo, Image, PointCloud2, PointField
from std_msgs.msg import Header

# Image encodings the stack reads: name -> (channels, numpy dtype)
IMAGE_ENCODINGS: dict[str, tuple[int, np.dtype]] = {
    "rgb8": (3, np.dtype(np.uint8)),
    "bgr8": (3, np.dtype(np.uint8)),
    "mono8": (1, np.dtype(np.uint8)),
    "32FC1": (1, np.dtype(np.float32)),
    "16UC1": (1, np.dtype(np.uint16)),  # depth in mm, 0 = no value (REP 118)
}

_POINTFIELD_DTYPES = {
    PointField.INT8: np.int8, PointField.UINT8: np.uint8, PointField.INT16: np.int16,
    PointField.UINT16: np.uint16, PointField.INT32: np.int32, PointField.UINT32: np.uint32,
    PointField.FLOAT32: np.float32, PointField.FLOAT64: np.float64,
}


class ConversionError(ValueError):
    """A message cannot be converted. `reason` is a short counter name, e.g. 'bad_encoding'."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


# ---- time -------------------------------------------------------------------------------------
def stamp_to_ns(stamp: Time) -> int:
    return int(stamp.sec) * 1_000_000_000 + int(stamp.nanosec)


def ns_to_stamp(ns: int) -> Time:
    ns = int(ns)
    return Time(sec=ns // 1_000_000_000, nanosec=ns % 1_000_000_000)


def make_header(stamp_ns: int, frame_id: str) -> Header:
    return Header(stamp=ns_to_stamp(stamp_ns), frame_id=frame_id)


# ---- images ------------------------------------------------------------------------------------
def image_to_numpy(msg: Image, accept: tuple[str, ...] = ("rgb8", "bgr8")) -> np.ndarray:
    """Image -> array. rgb8/bgr8 -> HxWx3 uint8 in RGB order (a view where possible);
    mono8 -> HxW uint8; 32FC1 -> HxW float32. Raises ConversionError on anything else."""
    enc = msg.encoding
    if enc not in accept or enc not in IMAGE_ENCODINGS:
        raise ConversionError("bad_encoding", f"image encoding '{enc}' not accepted {accept}")
    channels, dtype = IMAGE_ENCODINGS[enc]
    h, w = int(msg.height), int(msg.width)
    if h <= 0 or w <= 0:
        raise ConversionError("bad_size", f"image size {w}x{h} is empty")
    row = w * channels * dtype.itemsize
    if msg.step < row:
        raise ConversionError("bad_size",
                              f"image step {msg.step} < width*channels*size {row}")
    data = msg.data
    buf = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
    if buf.size != msg.step * h:
        raise ConversionError(
            "bad_size", f"image data has {buf.size} bytes, expected step*height = {msg.step * h}")
    rows = buf.reshape(h, msg.step)[:, :row]
    if msg.is_bigendian and dtype.itemsize > 1:
        raise ConversionError("bad_encoding", "big-endian float images are not supported")
    arr = rows.view(dtype)
    arr = arr.reshape(h, w, channels) if channels > 1 else arr.reshape(h, w)
    if enc == "bgr8":
        arr = arr[:, :, ::-1]
    return arr


def numpy_to_image(array: np.ndarray, encoding: str, header: Header) -> Image:
    """rgb8: HxWx3 uint8; mono8: HxW uint8; 32FC1: HxW float32."""
    if encoding not in IMAGE_ENCODINGS:
        raise ConversionError("bad_encoding", f"cannot encode '{encoding}'")
    channels, dtype = IMAGE_ENCODINGS[encoding]
    arr = np.ascontiguousarray(array, dtype=dtype)
    expected_ndim = 3 if channels > 1 else 2
    if arr.ndim != expected_ndim or (channels > 1 and arr.shape[2] != channels):
        shape = "HxWx3" if channels > 1 else "HxW"
        raise ConversionError("bad_size", f"{encoding} needs shape {shape}, got {arr.shape}")
    msg = Image()
    msg.header = header
    msg.height, msg.width = int(arr.shape[0]), int(arr.shape[1])
    msg.encoding = encoding
    msg.is_bigendian = 0
    msg.step = int(arr.shape[1] * channels * dtype.itemsize)
    msg.data = arr.tobytes()
    return msg


# ---- camera info ---------------------------------------------------------------------------------
def camera_info_to_k(msg: CameraInfo) -> np.ndarray:
    """CameraInfo -> K [3,3] float64. Raises ConversionError when K is unset or not finite."""
    k = np.asarray(msg.k, dtype=np.float64).reshape(3, 3)
    if not np.all(np.isfinite(k)) or k[0, 0] <= 0 or k[1, 1] <= 0 or k[2, 2] != 1.0:
        raise ConversionError("bad_camera_info", f"camera_info K is invalid: {k.ravel().tolist()}")
    return k


# what the perception node and its receivers log for a CameraInfo with distortion
DISTORTION_ADVICE = ("the perception node projects with the pinhole K alone and ignores D, so "
                     "LiDAR points and 3D positions are off by the lens distortion; feed "
                     "undistorted images with a CameraInfo whose K matches them and D = 0")


def camera_info_is_distorted(msg: CameraInfo) -> bool:
    """True when the CameraInfo has non-zero distortion coefficients D. The perception node
    projects with the pinhole K alone and ignores D, so its images must be undistorted and
    described by a CameraInfo whose K matches them (D = 0); a camera with D is counted and
    warned about, and its LiDAR points land up to the distortion's pixel error off."""
    return any(float(c) != 0.0 for c in msg.d)


def make_camera_info(k: np.ndarray, width: int, height: int, header: Header) -> CameraInfo:
    """A pinhole CameraInfo (plumb_bob, zero distortion) from K [3,3]."""
    msg = CameraInfo()
    msg.header = header
    msg.width, msg.height = int(width), int(height)
    msg.distortion_model = "plumb_bob"
    msg.d = [0.0] * 5
    k = np.asarray(k, dtype=np.float64).reshape(3, 3)
    msg.k = k.ravel().tolist()
    msg.r = np.eye(3).ravel().tolist()
    p = np.zeros((3, 4))
    p[:, :3] = k
    msg.p = p.ravel().tolist()
    return msg


# ---- point clouds -------------------------------------------------------------------------------
def pointcloud2_to_xyz(msg: PointCloud2) -> np.ndarray:
    """PointCloud2 -> xyz [N,3] float32 (NaN points kept: the core filters and counts them).

    Raises ConversionError when x/y/z fields are missing or the data size is inconsistent."""
    fields = {f.name: f for f in msg.fields}
    for axis in ("x", "y", "z"):
        if axis not in fields:
            raise ConversionError("bad_cloud", f"point cloud has no '{axis}' field")
    n = int(msg.width) * int(msg.height)
    if n == 0:
        return np.zeros((0, 3), dtype=np.float32)
    if msg.point_step <= 0 or len(msg.data) != msg.row_step * msg.height or \
            msg.row_step < msg.width * msg.point_step:
        raise ConversionError(
            "bad_cloud", f"point cloud data size {len(msg.data)} inconsistent with "
            f"{msg.width}x{msg.height} points, point_step {msg.point_step}, "
            f"row_step {msg.row_step}")
    buf = np.frombuffer(msg.data, dtype=np.uint8) if not isinstance(msg.data, np.ndarray) \
        else msg.data
    rows = buf.reshape(msg.height, msg.row_step)[:, : msg.width * msg.point_step]
    pts = rows.reshape(n, msg.point_step)
    out = np.empty((n, 3), dtype=np.float32)
    for i, axis in enumerate(("x", "y", "z")):
        f = fields[axis]
        dtype = np.dtype(_POINTFIELD_DTYPES.get(f.datatype, np.float32))
        if msg.is_bigendian:
            dtype = dtype.newbyteorder(">")
        if f.offset + dtype.itemsize > msg.point_step:
            raise ConversionError("bad_cloud", f"field '{axis}' lies outside point_step")
        col = pts[:, f.offset: f.offset + dtype.itemsize].copy().view(dtype).reshape(n)
        out[:, i] = col
    return out


def xyz_to_pointcloud2(points: np.ndarray, header: Header) -> PointCloud2:
    """xyz [N,3] float32 (m) -> unorganised PointCloud2 with x, y, z FLOAT32 fields."""
    pts = np.ascontiguousarray(points, dtype=np.float32).reshape(-1, 3)
    msg = PointCloud2()
    msg.header = header
    msg.height = 1
    msg.width = int(pts.shape[0])
    msg.fields = [PointField(name=a, offset=4 * i, datatype=PointField.FLOAT32, count=1)
                  for i, a in enumerate(("x", "y", "z"))]
    msg.is_bigendian = False
    msg.point_step = 12
    msg.row_step = 12 * msg.width
    msg.is_dense = bool(np.all(np.isfinite(pts)))
    msg.data = pts.tobytes()
    return msg


# ---- diagnostics -------------------------------------------------------------------------------
def diagnostic_status(name: str, hardware_id: str, level: int, message: str,
                      values: Mapping[str, object]) -> DiagnosticStatus:
    """level: DiagnosticStatus.OK / WARN / ERROR / STALE."""
    status = DiagnosticStatus()
    if isinstance(level, int) and isinstance(DiagnosticStatus.OK, bytes):
        level = bytes([level])
    status.level = level
    status.name = name
    status.hardware_id = hardware_id
    status.message = message
    status.values = [KeyValue(key=str(k), value=_fmt(v)) for k, v in values.items()]
    return status


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def detection_arrays(msg) -> dict[str, np.ndarray]:  # noqa: ANN001 (a PerceptionResult)
    """A PerceptionResult's detections as numpy views of its arrays (no copy): camera_index
    [D], class_index [D], score [D], bbox [D,4] px (cx, cy, w, h), position_source [D],
    position [D,3] m (NaN where unknown), position_variance [D] m^2. ConversionError when the
    arrays disagree on D."""
    out = {
        "camera_index": np.frombuffer(msg.camera_index, np.uint32),
        "class_index": np.frombuffer(msg.class_index, np.uint16),
        "score": np.frombuffer(msg.score, np.float32),
        "bbox": np.frombuffer(msg.bbox, np.float32),
        "position_source": np.frombuffer(msg.position_source, np.uint8),
        "position": np.frombuffer(msg.position, np.float64),
        "position_variance": np.frombuffer(msg.position_variance, np.float64),
    }
    n = out["score"].shape[0]
    per = {"bbox": 4, "position": 3}
    sizes = {k: v.shape[0] for k, v in out.items()}
    if any(size != n * per.get(k, 1) for k, size in sizes.items()):
        raise ConversionError("bad_detections", f"detection arrays disagree on the count: {sizes}")
    out["bbox"] = out["bbox"].reshape(n, 4)
    out["position"] = out["position"].reshape(n, 3)
    return out
