"""The per-frame device region after the forward: decode + NMS, seg argmax, depth encoding,
LiDAR fusion for all cameras at once, packed into ONE staging buffer, ONE device->host copy
into preallocated (pinned on CUDA) host memory, ONE sync. Pure Python + torch, no ROS.

In static mode (the default on CUDA) nothing inside `DeviceRegion.run` reads device values on
the host (no .item()/.cpu()/.tolist()/nonzero/boolean indexing); only `_download` copies and
synchronises. On the CPU (no device) the default is the data-dependent "CPU mode", which does
the same work as the previous per-camera path.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
from kestrel_models.perception.compiled import compiled
from kestrel_models.perception.lidar import (DEFAULT_SUPPORT_TOLERANCE, box_positions_batched,
                                              project_points)
from kestrel_models.perception.postprocess import (decode_detections_batched,
                                                   detections_from_decoded)

from .region_graph import RegionGraphs

# px: pixel-edge coordinates (detection boxes) minus this = K's pixel-centre coordinates
PIXEL_EDGE_TO_CENTRE = 0.5
DEPTH_ENCODINGS: tuple[str, ...] = ("32FC1", "16UC1")
OUTPUT_STRIDES: tuple[int, ...] = (1, 2, 4, 8)
_ALIGN = 64  # bytes, alignment of every field in the packed buffer


def _fail(name: str, value: object, why: str) -> ValueError:
    return ValueError(f"parameter '{name}' = {value!r}: {why}")


def validate_output_params(depth_encoding: str, output_stride: int) -> None:
    """Raise ValueError naming the parameter for an unsupported value."""
    if depth_encoding not in DEPTH_ENCODINGS:
        raise _fail("output.depth_encoding", depth_encoding, f"must be one of {DEPTH_ENCODINGS}")
    if output_stride not in OUTPUT_STRIDES:
        raise _fail("output.stride", output_stride, f"must be one of {OUTPUT_STRIDES}")


def strided_hw(hw: tuple[int, int], stride: int) -> tuple[int, int]:
    """(H, W) of a map subsampled as map[::stride, ::stride] -> (ceil(H/s), ceil(W/s))."""
    return (-(-hw[0] // stride), -(-hw[1] // stride))


def encode_depth(depth: torch.Tensor, encoding: str) -> torch.Tensor:
    """depth [..] float32 m -> 32FC1 (unchanged) or 16UC1 mm (REP 118: 0 = no return; NaN,
    <= 0 and > 65.535 m become 0). Device op, no sync."""
    if encoding == "32FC1":
        return depth
    mm = torch.round(depth * 1000.0)
    ok = torch.isfinite(mm) & (mm > 0) & (mm <= 65535)
    # int32 first: float -> uint16 casts are not defined for all values on every backend
    return torch.where(ok, mm, torch.zeros_like(mm)).to(torch.int32).to(torch.uint16)


def _maps(seg: torch.Tensor | None, depth: torch.Tensor | None, stride: int, encoding: str
          ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """seg logits [C,K,H,W] -> class mask [C,Hs,Ws] int64, depth [C,1,H,W] m -> encoded
    [C,Hs,Ws], both subsampled [::stride, ::stride] (None stays None)."""
    s = stride
    mask = None if seg is None else seg[:, :, ::s, ::s].argmax(dim=1)
    enc = None if depth is None else encode_depth(depth[:, 0, ::s, ::s].float(), encoding)
    return mask, enc


def _bad_rows(points: torch.Tensor) -> torch.Tensor:
    """Number of non-finite rows of points [N,3] as a [1] int64 tensor."""
    return (~torch.isfinite(points).all(dim=1)).sum().reshape(1)


@dataclass(frozen=True)
class RegionLayout:
    """Static sizes of one frame's outputs (sized at configure)."""

    cameras: int
    image_hw: tuple[int, int]  # (H, W) px of the input images
    max_det: int  # detection slots per camera
    stride: int  # output_stride of masks / depth maps
    depth_encoding: str  # "32FC1" or "16UC1"

    def fields(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        c, m = self.cameras, self.max_det
        hs, ws = strided_hw(self.image_hw, self.stride)
        ddt = torch.float32 if self.depth_encoding == "32FC1" else torch.uint16
        return {"boxes": ((c, m, 4), torch.float32), "scores": ((c, m), torch.float32),
                "classes": ((c, m), torch.int64), "valid": ((c, m), torch.bool),
                "pos": ((c, m, 3), torch.float64), "src": ((c, m), torch.int64),
                "mask": ((c, hs, ws), torch.uint8), "depth": ((c, hs, ws), ddt),
                "flags": ((1,), torch.bool),  # flags[0]: NMS converged
                "bad_points": ((1,), torch.int64)}  # non-finite rows of the point bucket


class PackedBuffer:
    """One flat uint8 buffer with typed views per field (64-byte aligned)."""

    def __init__(self, layout: RegionLayout, device: torch.device, pin: bool) -> None:
        offsets, total = {}, 0
        for name, (shape, dtype) in layout.fields().items():
            nbytes = int(np.prod(shape)) * dtype.itemsize
            offsets[name] = (total, nbytes, shape, dtype)
            total += -(-nbytes // _ALIGN) * _ALIGN
        self.raw = torch.zeros(max(total, _ALIGN), dtype=torch.uint8, device=device,
                               pin_memory=pin)
        self.views = {n: self.raw[o:o + nb].view(dt).view(shape)
                      for n, (o, nb, shape, dt) in offsets.items()}
        self.nbytes = total


@dataclass
class RegionResult:
    """Host (numpy) views of one frame's packed outputs; valid until the frame after next
    (two host buffers alternate)."""

    boxes: np.ndarray  # [C,M,4] float32 px
    scores: np.ndarray  # [C,M] float32
    classes: np.ndarray  # [C,M] int64
    valid: np.ndarray  # [C,M] bool, slot holds a detection
    pos: np.ndarray  # [C,M,3] float64 m, base frame (NaN: none)
    src: np.ndarray  # [C,M] int64 PositionSource
    masks: np.ndarray | None  # [C,Hs,Ws] uint8 class index, None without segmentation
    depths: np.ndarray | None  # [C,Hs,Ws] float32 m or uint16 mm, None without depth
    nms_converged: bool
    stage_s: dict[str, float]  # postprocess, lidar_fusion, download (s); device time on CUDA
    bad_points: int = 0  # non-finite rows of the point bucket (NaN padding included)
    host_s: dict[str, float] | None = None  # the same stages on the host clock (s)


def n_used(valid: torch.Tensor) -> int:
    """Largest number of used slots over the cameras (host read: CPU / static=False only)."""
    return int(valid.sum(dim=1).max()) if valid.numel() else 0


class _Clock:
    """Stage boundaries: CUDA events on CUDA (read after the frame's one sync, no extra sync),
    time.monotonic on the CPU (ops are synchronous there). Every mark also records the host
    clock: on CUDA, `host_durations` is the time the Python thread spent issuing each stage
    (device time < host time: the stage is launch/GIL bound, not GPU bound)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, object]] = []
        self.host: list[float] = []

    def mark(self, name: str) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append((name, ev))
        else:
            self.marks.append((name, time.monotonic()))
        self.host.append(time.monotonic())

    def durations(self) -> dict[str, float]:
        """Seconds from each mark to the next, keyed by the later mark's name."""
        out = {}
        for (_, a), (name, b) in zip(self.marks, self.marks[1:], strict=False):
            out[name] = (a.elapsed_time(b) / 1e3) if self.cuda else (b - a)  # type: ignore
        return out

    def host_durations(self) -> dict[str, float]:
        """Host-clock seconds from each mark to the next, keyed by the later mark's name."""
        return {name: b - a for (name, _), a, b in
                zip(self.marks[1:], self.host, self.host[1:], strict=False)}


MAX_LAYOUTS = 4  # region layouts (camera count x image size x slots) whose buffers are kept


class DeviceRegion:
    """Preallocated buffers + the one-sync post-processing of a frame (not thread-safe)."""

    def __init__(self, device: torch.device, depth_encoding: str = "16UC1",
                 output_stride: int = 4, nms_rounds: int = 8,
                 fusion_chunk_elems: int = 1 << 24, static: bool | None = None,
                 graphs: RegionGraphs | None = None, compile: bool = False) -> None:
        validate_output_params(depth_encoding, output_stride)
        if not 1 <= nms_rounds <= 10000:
            raise _fail("detection.nms_rounds", nms_rounds, "must be in [1, 10000]")
        self.device = device
        self.depth_encoding = depth_encoding
        self.stride = output_stride
        self.nms_rounds = nms_rounds
        self.chunk = fusion_chunk_elems
        # static shapes and no host reads in the region: always on CUDA; on the CPU (no
        # device to sync with) the default trims the work to the data: NMS over the candidates
        # above the threshold, per image; LiDAR medians over the used detection slots and each
        # camera's valid projections; predicted-depth medians for the boxes that need them
        self.static = device.type == "cuda" if static is None else static
        # static mode: the decode thresholds [score, NMS IoU] live in this device buffer and
        # every kernel reads them from it, so `ros2 param set detection.score_threshold / nms_iou`
        # changes them with two fill kernels: no region graph recapture, no recompile of the
        # compiled steps, nothing new cached (RegionGraphs keys exclude them)
        thr = torch.zeros(2, dtype=torch.float32, device=device) if self.static else None
        self._thr_views = (thr[0], thr[1]) if thr is not None else None  # [score, iou] views
        self._thr_set: tuple[float, float] | None = None
        self.layout: RegionLayout | None = None
        self._stage: PackedBuffer | None = None  # on the device (CUDA) or None on the CPU
        self._host: list[PackedBuffer] = []
        self._flip = 0
        # buffers of the last MAX_LAYOUTS layouts, kept: a camera set that switches between two
        # sizes (the runtime runs the other one eager) reuses its buffers and its region graphs
        # instead of reallocating and recapturing at every switch
        self._layouts: OrderedDict[RegionLayout, tuple[list[PackedBuffer],
                                                       PackedBuffer | None]] = OrderedDict()
        # CUDA graphs of the static region (one post + one fusion graph per input signature,
        # region_graph.py); None = every op launched from Python each frame
        self.graphs = graphs if self.static else None
        # static mode: the element-wise steps torch.compile'd (kestrel_models compiled.py;
        # a compile failure switches them back to plain torch and is reported)
        self.compile = compile and self.static

    def configure(self, cameras: int, image_hw: tuple[int, int], max_det: int) -> None:
        """Allocate for this shape (at configure / warm-up; again only if the shape changes)."""
        layout = RegionLayout(cameras, tuple(image_hw), max_det, self.stride,
                              self.depth_encoding)
        if layout == self.layout:
            return
        cached = self._layouts.get(layout)
        if cached is None:
            if len(self._layouts) >= MAX_LAYOUTS:  # bounded: start over (the graphs write
                self._layouts.clear()  # into the dropped buffers, so they go too)
                if self.graphs is not None:
                    self.graphs.clear()
            cuda = self.device.type == "cuda"
            host = [PackedBuffer(layout, torch.device("cpu"), pin=cuda) for _ in range(2)]
            # a graph writes into fixed addresses: the device staging buffer (CUDA; on the CPU
            # only with graphs, i.e. the tests' emulated capture)
            staged = cuda or self.graphs is not None
            cached = (host, PackedBuffer(layout, self.device, pin=False) if staged else None)
            self._layouts[layout] = cached
        else:
            self._layouts.move_to_end(layout)
        # a layout's graphs were captured on its own buffers (their keys hold the shapes)
        self._host, self._stage = cached
        self.layout = layout

    @property
    def host_bytes(self) -> int:
        return self._host[0].nbytes if self._host else 0

    def run(self, raw: dict, image_hw: tuple[int, int], det: dict, points: torch.Tensor | None,
            cams: dict[str, torch.Tensor], clock: _Clock | None = None,
            exact_nms: bool = False, persistent: bool = False) -> RegionResult:
        """raw: the model's outputs ([C,..] on the device); det: decode settings
        (score_thr, iou_thr, max_det, pre_nms_top_k, class_offset); points [Nb,3] m base
        frame on the device (NaN padded) or None; cams: T_cam_from_base, K, K_inv,
        T_base_from_cam [C,..] float64 on the device. exact_nms: the slow path after a
        frame whose NMS did not converge in `nms_rounds` (host-synced iterations).
        persistent: raw, points and cams are fixed buffers refilled every frame, which the
        region graphs may adopt and later write into (`RegionGraphs.run`)."""
        first = raw["det_cls"][0] if "det_cls" in raw else next(
            raw[k] for k in ("det_boxes", "seg", "depth") if k in raw)
        c = first.shape[0]
        self.configure(c, image_hw, det["max_det"])
        det = self._device_thresholds(det)
        clock = clock or _Clock(self.device)
        if not clock.marks:
            clock.mark("start")
        with torch.inference_mode():
            if self.graphs is not None and self.static and not exact_nms and \
                    self._stage is not None and \
                    self.graphs.run(self, raw, image_hw, det, points, cams, clock, persistent):
                return self._download(raw, clock)
            buf = self._stage if self._stage is not None else self._host[self._flip]
            dets = self._post(raw, image_hw, det, buf.views, exact_nms)
            clock.mark("postprocess")
            self._fusion(dets, raw, image_hw, det, points, cams, buf.views)
            clock.mark("lidar_fusion")
        return self._download(raw, clock)

    def _device_thresholds(self, det: dict) -> dict:
        """Static mode: `det` with score_thr / iou_thr as 0-d views of the threshold buffer,
        refilled (in stream order, before this frame's kernels) only when a value changed."""
        if self._thr_views is None:
            return det
        want = (float(det["score_thr"]), float(det["iou_thr"]))
        if want != self._thr_set:
            with torch.inference_mode():
                self._thr_views[0].fill_(want[0])
                self._thr_views[1].fill_(want[1])
            self._thr_set = want
        return {**det, "score_thr": self._thr_views[0], "iou_thr": self._thr_views[1]}

    def _post(self, raw: dict, image_hw: tuple[int, int], det: dict,
              v: dict[str, torch.Tensor], exact_nms: bool = False):
        """Decode + class-wise NMS into the slots, seg argmax, depth encoding (written into
        the staging views `v`). Returns the BatchedDetections (None without detections)."""
        m = self.layout.max_det
        if "det_cls" in raw or "det_boxes" in raw:
            if "det_cls" in raw:  # our head's raw maps
                dets = decode_detections_batched(
                    raw, image_hw, det["score_thr"], det["iou_thr"], m,
                    pre_nms_top_k=det["pre_nms_top_k"], class_offset=det["class_offset"],
                    nms_rounds=self.nms_rounds, static=self.static, exact=exact_nms,
                    compile=self.compile)
            else:  # a user model's decoded boxes (kestrel_models.perception.external)
                dets = detections_from_decoded(
                    raw["det_boxes"], raw["det_scores"], raw["det_labels"], image_hw,
                    det["num_classes"], det["score_thr"], det["iou_thr"], m,
                    pre_nms_top_k=det["pre_nms_top_k"], nms_rounds=self.nms_rounds,
                    static=self.static, exact=exact_nms, compile=self.compile)
            v["boxes"].copy_(dets.boxes)
            v["scores"].copy_(dets.scores)
            v["classes"].copy_(dets.classes)
            v["valid"].copy_(dets.valid)
            v["flags"].copy_(dets.nms_converged.reshape(1))
        else:
            dets = None
            v["valid"].zero_()
            v["flags"].fill_(True)
        if "seg" in raw or "depth" in raw:
            maps = compiled(_maps, self.compile)
            mask, depth = maps(raw.get("seg"), raw.get("depth"), self.stride,
                               self.depth_encoding)
            if mask is not None:
                v["mask"].copy_(mask)
            if depth is not None:
                v["depth"].copy_(depth)
        return dets

    def _fusion(self, dets, raw: dict, image_hw: tuple[int, int], det: dict,
                points: torch.Tensor | None, cams: dict[str, torch.Tensor],
                v: dict[str, torch.Tensor]) -> None:
        """LiDAR projection + per-detection positions (LiDAR: the support rule where the
        segmentation ran and det["support_classes"] names classes, else the box median; else
        predicted depth) and the count of non-finite cloud rows, written into the staging
        views `v`."""
        m = self.layout.max_det
        if dets is not None:
            c = dets.boxes.shape[0]
            if points is not None:
                uv, z, ok = project_points(points, cams["T_cam_from_base"], cams["K"],
                                           image_hw, compile=self.compile)
            else:
                uv = torch.zeros((c, 0, 2), device=self.device)
                z, ok = uv[..., 0], uv[..., 0].bool()
            depth_full = raw["depth"][:, 0].float() if "depth" in raw else None
            boxes, bvalid, bclass = dets.boxes, dets.valid, dets.classes
            if not self.static:  # valid slots come first: drop the unused tail
                k = n_used(bvalid)
                boxes, bvalid, bclass = boxes[:, :k], bvalid[:, :k], bclass[:, :k]
            # support rule (kestrel_models perception/support.py): needs the segmentation
            support = det.get("support_classes", ()) if "seg" in raw else ()
            # Detection boxes are in pixel-edge coordinates (the top-left pixel spans [0, 1),
            # as the training labels and COCO-style models have them); K puts that pixel's
            # centre at (0, 0) (kestrel_models perception/lidar.py). Half a pixel apart: taken
            # as they are, the box centre's ray lands half a pixel right of and below the
            # object, millimetres off on the table.
            pos, src = box_positions_batched(
                boxes - PIXEL_EDGE_TO_CENTRE, bvalid, uv, z, ok, depth_full, cams["K_inv"],
                cams["T_base_from_cam"], det["min_points"], self.chunk, self.static,
                self.compile, heights=points[:, 2] if points is not None else None,
                seg=raw.get("seg"), box_class=bclass, support_classes=support,
                support_tolerance=det.get("support_tolerance", DEFAULT_SUPPORT_TOLERANCE))
            d = pos.shape[1]
            v["pos"][:, :d].copy_(pos)
            v["src"][:, :d].copy_(src)
            if d < m:
                v["pos"][:, d:].fill_(float("nan"))
                v["src"][:, d:].zero_()
        if points is not None:  # counted here: no host pass over the cloud
            bad = compiled(_bad_rows, self.compile)
            v["bad_points"].copy_(bad(points))
        else:
            v["bad_points"].zero_()

    def _download(self, raw: dict, clock: _Clock) -> RegionResult:
        """The ONE device->host copy (non_blocking, into pinned memory) and the ONE sync."""
        host = self._host[self._flip]
        self._flip ^= 1
        if self._stage is not None:
            host.raw.copy_(self._stage.raw, non_blocking=True)
            clock.mark("download")
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
        else:
            clock.mark("download")
        h = {k: t.numpy() for k, t in host.views.items()}
        return RegionResult(h["boxes"], h["scores"], h["classes"], h["valid"], h["pos"],
                            h["src"], h["mask"] if "seg" in raw else None,
                            h["depth"] if "depth" in raw else None, bool(h["flags"][0]),
                            clock.durations(), int(h["bad_points"][0]), clock.host_durations())
