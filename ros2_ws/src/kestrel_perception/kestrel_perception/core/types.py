"""Data types of the perception core (plain dataclasses + numpy, no ROS message types)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from kestrel_models.perception import PositionSource

DEFAULT_CLASS_NAMES: tuple[str, ...] = (
    "background", "table", "red_cube", "green_cube", "blue_cylinder", "bin", "robot",
)

# InputError reason codes (the node shell counts them by name)
NO_IMAGES = "no_images"  # empty FrameSet or images/cameras count differ
BAD_IMAGE = "bad_image"  # not an HxWx3 uint8 array
SIZE_MISMATCH = "size_mismatch"  # image size != its CameraModel size
MIXED_SIZES = "mixed_sizes"  # cameras of one FrameSet have different image sizes
BAD_CAMERA = "bad_camera"  # non-finite / singular K or extrinsic
BAD_POINTS = "bad_points"  # cloud not an [N,3] numeric array
TOO_MANY_POINTS = "too_many_points"  # N > max_points
REASON_CODES: tuple[str, ...] = (NO_IMAGES, BAD_IMAGE, SIZE_MISMATCH, MIXED_SIZES, BAD_CAMERA,
                                 BAD_POINTS, TOO_MANY_POINTS)


class InputError(ValueError):
    """Bad runtime input: the FrameSet is rejected; `reason_code` is one of REASON_CODES."""

    def __init__(self, reason_code: str, message: str) -> None:
        super().__init__(f"{reason_code}: {message}")
        self.reason_code = reason_code
        self.message = message


@dataclass
class CameraModel:
    """Pinhole camera: K [3,3] px, image size px, optical frame, extrinsic T_base_from_cam."""

    K: np.ndarray  # [3,3] float64
    width: int  # px
    height: int  # px
    frame_id: str = "camera"
    T_base_from_cam: np.ndarray = field(default_factory=lambda: np.eye(4))  # [4,4], m

    def validate(self, index: int) -> None:
        """Raise InputError(BAD_CAMERA) when K, size or the extrinsic cannot be used."""
        K = np.asarray(self.K, dtype=np.float64)
        T = np.asarray(self.T_base_from_cam, dtype=np.float64)
        why = ""
        if K.shape != (3, 3) or not np.all(np.isfinite(K)):
            why = f"K must be a finite 3x3 matrix, got shape {K.shape}"
        elif K[0, 0] <= 0 or K[1, 1] <= 0 or K[2, 2] != 1.0:
            why = f"K needs fx, fy > 0 and K[2,2] = 1, got {K.tolist()}"
        elif self.width <= 0 or self.height <= 0:
            why = f"size must be positive, got {self.width}x{self.height}"
        elif T.shape != (4, 4) or not np.all(np.isfinite(T)) or not np.allclose(
                T[3], (0.0, 0.0, 0.0, 1.0)):
            why = "T_base_from_cam must be a finite 4x4 rigid transform"
        if why:
            raise InputError(BAD_CAMERA, f"camera {index} ({self.frame_id}): {why}")


@dataclass
class FrameSet:
    """One synchronised input set: an RGB image per camera and an optional LiDAR cloud."""

    stamp_ns: int  # capture time of the images, ns
    images: list[np.ndarray]  # per camera [H,W,3] uint8 RGB
    cameras: list[CameraModel]  # same order as images
    points: np.ndarray | None = None  # [N,3] float32, base frame, m (None: no cloud)


@dataclass
class Detection:
    """One detection in one camera, with a 3D position in the base frame where known."""

    camera_index: int
    class_index: int  # into the class names (also the mask value)
    class_name: str
    score: float  # [0, 1]
    box_xyxy: np.ndarray  # [4] float32 px (x1, y1, x2, y2)
    position: np.ndarray | None  # [3] float64 m, base frame; None when unknown
    position_source: PositionSource = PositionSource.NONE


@dataclass
class DetectionArrays:
    """All detections of one output as parallel arrays (D detections, camera by camera):
    what the core computes and what PerceptionResult carries, without one Python object per
    detection to make and read back)."""

    camera_index: np.ndarray  # [D] uint32
    class_index: np.ndarray  # [D] uint16, into the class names (also the mask value)
    score: np.ndarray  # [D] float32, [0, 1]
    box_xyxy: np.ndarray  # [D,4] float32 px (x1, y1, x2, y2)
    position: np.ndarray  # [D,3] float64 m, base frame; NaN rows where the source is NONE
    position_source: np.ndarray  # [D] uint8 PositionSource

    def __len__(self) -> int:
        return int(self.score.shape[0])

    @classmethod
    def from_list(cls, dets: list[Detection]) -> DetectionArrays:
        pos = [d.position if d.position is not None and d.position_source
               != PositionSource.NONE else np.full(3, np.nan) for d in dets]
        return cls(np.array([d.camera_index for d in dets], np.uint32),
                   np.array([d.class_index for d in dets], np.uint16),
                   np.array([d.score for d in dets], np.float32),
                   np.array([d.box_xyxy for d in dets], np.float32).reshape(-1, 4),
                   np.array(pos, np.float64).reshape(-1, 3),
                   np.array([int(d.position_source) for d in dets], np.uint8))

    def to_list(self, class_names: tuple[str, ...] | list[str]) -> list[Detection]:
        sources = {int(p): p for p in PositionSource}
        out = []
        for k, (cam, cls, score, src) in enumerate(zip(
                self.camera_index.tolist(), self.class_index.tolist(), self.score.tolist(),
                self.position_source.tolist(), strict=True)):
            source = sources[src]
            out.append(Detection(
                camera_index=cam, class_index=cls, class_name=class_names[cls], score=score,
                box_xyxy=self.box_xyxy[k],
                position=None if source == PositionSource.NONE else self.position[k],
                position_source=source))
        return out


@dataclass
class PerceptionOutput:
    """Result of `PerceptionCore.process` for one FrameSet.

    Detections: the core sets `arrays` (DetectionArrays) and `class_names`; `detections` (a
    list of Detection) is then built from them on first access. Constructed with a list
    instead (tests, benchmarks), `detection_arrays()` builds the arrays from it.
    """

    stamp_ns: int  # = FrameSet.stamp_ns
    detections: list[Detection]  # None at construction: built from `arrays` when read
    # masks/depths are subsampled by output_stride: [ceil(H/s), ceil(W/s)], pixel (i, j) =
    # input pixel (s*i, s*j), i.e. K scaled by 1/s (fx, fy, cx, cy). With the core's
    # zero_copy_maps they are views into its host buffers (valid for one more process()).
    masks: list[np.ndarray]  # per camera [Hs,Ws] uint8 class index; [] without segmentation
    depths: list[np.ndarray]  # per camera [Hs,Ws] float32 m (32FC1) or uint16 mm (16UC1,
    # 0 = no value); [] without the depth head
    timings: dict[str, float]  # stage -> s: preprocess, model, postprocess, lidar_fusion,
    # download, unpack (see perception_core.STAGES)
    dropped_points: int = 0  # non-finite cloud points filtered out
    truncated_points: int = 0  # finite points left out of a cloud past the largest bucket
    # (the rest is an even subsample, lidar.bucket_points)
    used_points: int = 0  # finite points projected into the cameras
    runtime_fallback: bool = False  # the prepared runtime did not fit: ran the eager model
    depth_encoding: str = "32FC1"  # encoding of `depths`
    output_stride: int = 1  # subsampling of masks and depths
    nms_fallback: bool = False  # NMS needed more than nms_rounds rounds: exact slow path ran
    # CUDA only: host-clock seconds of the device stages (the Python thread issuing them);
    # `timings` holds their device (CUDA event) time. Empty on the CPU (the same numbers).
    host_timings: dict[str, float] = field(default_factory=dict)
    arrays: DetectionArrays | None = None  # the core's detections (authoritative when set)
    class_names: tuple[str, ...] = ()  # for `detections` built from `arrays`

    def detection_arrays(self) -> DetectionArrays:
        if self.arrays is not None:
            return self.arrays
        return DetectionArrays.from_list(self.detections)


def _get_detections(self: PerceptionOutput) -> list[Detection]:
    dets = self.__dict__.get("_detections")
    if dets is None:
        arrays = self.__dict__.get("arrays")
        dets = arrays.to_list(self.class_names) if arrays is not None else []
        self.__dict__["_detections"] = dets
    return dets


def _set_detections(self: PerceptionOutput, value: list[Detection] | None) -> None:
    self.__dict__["_detections"] = value


# a property over the dataclass field: the generated __init__ assigns through the setter
PerceptionOutput.detections = property(_get_detections, _set_detections)  # type: ignore


def validate_frames(frames: FrameSet, max_points: int) -> tuple[int, int]:
    """Check a FrameSet; return the shared image size (H, W). Raises InputError."""
    n = len(frames.images)
    if n == 0 or n != len(frames.cameras):
        raise InputError(NO_IMAGES, f"{n} images for {len(frames.cameras)} cameras")
    size: tuple[int, int] | None = None
    for i, (img, cam) in enumerate(zip(frames.images, frames.cameras, strict=True)):
        if (not isinstance(img, np.ndarray) or img.ndim != 3 or img.shape[2] != 3
                or img.dtype != np.uint8):
            desc = (f"shape {img.shape} dtype {img.dtype}" if isinstance(img, np.ndarray)
                    else type(img).__name__)
            raise InputError(BAD_IMAGE, f"camera {i}: expected HxWx3 uint8, got {desc}")
        cam.validate(i)
        if img.shape[:2] != (cam.height, cam.width):
            raise InputError(SIZE_MISMATCH, f"camera {i}: image {img.shape[1]}x{img.shape[0]}"
                                            f" but CameraInfo {cam.width}x{cam.height}")
        if size is not None and img.shape[:2] != size:
            raise InputError(MIXED_SIZES, f"camera {i}: image {img.shape[1]}x{img.shape[0]} "
                                          f"differs from camera 0 {size[1]}x{size[0]}")
        size = (img.shape[0], img.shape[1])
    pts = frames.points
    if pts is not None:
        if (not isinstance(pts, np.ndarray) or pts.ndim != 2 or pts.shape[1] != 3
                or not np.issubdtype(pts.dtype, np.number)):
            desc = (f"shape {pts.shape} dtype {pts.dtype}" if isinstance(pts, np.ndarray)
                    else type(pts).__name__)
            raise InputError(BAD_POINTS, f"expected an [N,3] float array, got {desc}")
        if pts.shape[0] > max_points:
            raise InputError(TOO_MANY_POINTS, f"{pts.shape[0]} points > lidar.max_points "
                                              f"{max_points}")
    assert size is not None
    return size
