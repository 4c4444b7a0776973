"""Input staging of PerceptionCore: one frame's images, LiDAR cloud and camera matrices from
host arrays (views on the ROS message buffers) to the device with ONE memcpy per input into
preallocated host memory (pinned on CUDA) and ONE non_blocking host->device copy per input.

Pure Python + torch + numpy, no ROS. Buffers are sized at configure (`configure`), reused
every frame; nothing is allocated per frame on the fast path. The host buffers are written
while the device may still read the previous frame's copy only if the caller did not sync in
between: PerceptionCore syncs once per frame (DeviceRegion download) before the next frame.

Pre-staging (`prestage_image` / `prestage_points`): a caller that gets the inputs one by one
(the node's subscription callbacks) copies each into its host slot on arrival, so the frame's
`images()` / `points()` skip the copies of the arrays that are already there (same object):
the copies overlap the arrival of the set's other messages instead of following the last one.
Only for callers that never pre-stage while the device may still read the slots (the node's
callback processing: each frame ends with a sync before the next callback runs).

Host buffers of the caller (its own memory registered with `pin_host_memory`: the input
receivers' shared-memory slots, `receive: processes`): preallocated host memory (page-locked
on CUDA) that a caller fills itself. An input pre-staged from
such a buffer skips the host copy too: it goes straight to its device slot (one non_blocking
host->device copy on the staging's copy stream, which the frame's stream waits for). On the CPU
the device slot is the host slot, so the same path is one copy, as before. The caller must
not rewrite a registered buffer while its copy may be pending: a receiver's slot is written
again only after the node claimed `pool` newer messages of its sensor (input_rings.py), and
the copy (short: one image) is queued behind nothing but the frame stream's current work (no
event per buffer is kept).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from kestrel_models.perception import bucket_points
from kestrel_models.perception.lidar import bucket_size

# camera matrices packed in one float64 buffer: name -> per-camera shape
CAMERA_FIELDS: tuple[tuple[str, tuple[int, int]], ...] = (
    ("T_cam_from_base", (4, 4)), ("K", (3, 3)), ("K_inv", (3, 3)), ("T_base_from_cam", (4, 4)))
# numpy dtype.str -> torch dtype of the inputs that can come from registered host buffers
_TORCH_DTYPES = {"|u1": torch.uint8, "<f4": torch.float32}
_HOST_REGISTER_PORTABLE = 0x01  # cudaHostRegisterPortable


def clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error after a failed call made through
    torch.cuda.cudart() (cudaHostRegister) on this thread: the runtime keeps it, and torch's
    next kernel launch check on this thread would raise it as its own. torch binds no
    cudaGetLastError, so it is looked up through torch's own libtorch_cuda (dlsym searches its
    dependencies: torch's libcudart, not another runtime loaded beside it, e.g. ONNX
    Runtime's for another CUDA major); failing that, one tiny torch op takes the error."""
    fn = getattr(torch.cuda.cudart(), "cudaGetLastError", None)
    if fn is None:
        lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cuda.so")
        try:  # RTLD_NOLOAD: only the copy torch already loaded
            fn = ctypes.CDLL(lib, mode=os.RTLD_NOLOAD | os.RTLD_LAZY).cudaGetLastError
        except (OSError, AttributeError):
            fn = None
    if fn is not None:
        fn()
        return
    try:  # the launch check of a kernel reads (and resets) the last error
        torch.zeros(1, device="cuda").add_(1)
    except RuntimeError:
        pass


@dataclass
class StagedPoints:
    """The cloud on the device: points [Nb,3] float32 m (NaN rows invalid) or None.

    host_dropped: non-finite rows counted on the host (the rare truncating path), else None
    (the device region counts the non-finite rows of the bucket, `pad` of them are padding).
    """

    points: torch.Tensor | None
    rows_in: int  # rows of the input cloud
    pad: int  # NaN padding rows appended (fast path)
    host_dropped: int | None
    truncated: int  # finite points left out of a cloud past the largest bucket (subsampled)


class InputStaging:
    """Preallocated staging of images [C,H,W,3] uint8, points [max bucket,3] float32 and
    camera matrices (float64) for one device. Not thread-safe (the core's one worker)."""

    def __init__(self, device: torch.device, buckets: tuple[int, ...]) -> None:
        if not buckets or min(buckets) < 1:
            raise ValueError(f"parameter 'lidar.point_buckets' = {buckets!r}: must be positive "
                             "sizes")
        self.device = device
        self.buckets = tuple(sorted(buckets))
        self.cuda = device.type == "cuda"
        nmax = self.buckets[-1]
        self._pts_host = torch.empty((nmax, 3), dtype=torch.float32, pin_memory=self.cuda)
        self._pts_np = self._pts_host.numpy()
        self._pts_dev = self._pts_host.to(device) if self.cuda else self._pts_host
        self._img_host: torch.Tensor | None = None
        self._img_np: np.ndarray | None = None
        self._img_dev: torch.Tensor | None = None
        self._staged: list[np.ndarray | None] = []  # per camera: the array now in its slot
        self._staged_pts: np.ndarray | None = None  # the cloud now in the points buffer
        # data pointer -> (flat uint8 tensor, bytes) of each row given to pin_host_memory()
        self._registered: dict[int, tuple[torch.Tensor, int]] = {}
        self._dev_staged: list[np.ndarray | None] = []  # per camera: array in its device slot
        self._dev_staged_pts: np.ndarray | None = None  # cloud in the device points buffer
        self._copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self._pending_copies = False  # copies on _copy_stream the next frame must wait for
        self.prestaged_used = 0  # copies skipped at frame time (pre-staged inputs used)
        self.prestaged_direct = 0  # of those, from registered buffers (no host copy at all)
        self._cam_count = -1
        self.configure_cameras(1)

    # ---- configure ------------------------------------------------------------------------
    def configure_images(self, cameras: int, image_hw: tuple[int, int]) -> None:
        """Allocate the image buffers for [cameras, H, W, 3] (again only if the shape changes)."""
        shape = (cameras, int(image_hw[0]), int(image_hw[1]), 3)
        if self._img_host is not None and tuple(self._img_host.shape) == shape:
            return
        self._img_host = torch.empty(shape, dtype=torch.uint8, pin_memory=self.cuda)
        self._img_np = self._img_host.numpy()
        self._staged = [None] * cameras
        self._dev_staged = [None] * cameras
        # NHWC memory seen as NCHW = channels_last [C,3,H,W]
        self._img_dev_nhwc = (torch.empty(shape, dtype=torch.uint8, device=self.device)
                              if self.cuda else self._img_host)
        self._img_dev = self._img_dev_nhwc.permute(0, 3, 1, 2)

    def _register_rows(self, block: np.ndarray) -> list[np.ndarray]:
        rows = [block[i] for i in range(block.shape[0])]
        for row in rows:
            self._registered[row.ctypes.data] = (torch.from_numpy(row), row.nbytes)
        return rows

    def pin_host_memory(self, blocks: list[np.ndarray]) -> tuple[Callable[[], None], str]:
        """Registers memory the caller owns: each block [slots, bytes] uint8 (C-contiguous,
        e.g. the input receivers' shared-memory rings) is page-locked on CUDA
        (cudaHostRegister) and its rows become registered buffers: an image or cloud that is a
        C-contiguous view from the start of a row is pre-staged straight into its device slot
        (module docstring). Call at configure.
        Returns (undo, what was done); undo (unregister, unlock) must run before the memory
        is unmapped, with no copy from it pending. If the CUDA registration fails, nothing is
        registered: inputs from those blocks take the host slot path (one more copy)."""
        blocks = [b for b in blocks if b.size]
        pinned: list[int] = []
        if self.cuda:
            rt = torch.cuda.cudart()
            for b in blocks:
                if not b.flags.c_contiguous:
                    raise ValueError("pin_host_memory: blocks must be C-contiguous")
                # portable: page-locked for every CUDA context (the node's device may not be
                # the current one)
                err = rt.cudaHostRegister(b.ctypes.data, b.nbytes, _HOST_REGISTER_PORTABLE)
                if err != rt.cudaError.success:
                    clear_cuda_error()
                    for ptr in pinned:
                        rt.cudaHostUnregister(ptr)
                    return (lambda: None), (f"cudaHostRegister of {b.nbytes} bytes failed "
                                            f"({rt.cudaGetErrorString(err)}): inputs take "
                                            "one host copy more")
                pinned.append(b.ctypes.data)
        keys = [row.ctypes.data for b in blocks for row in self._register_rows(b)]

        def undo() -> None:
            if self._copy_stream is not None:  # no copy may still read the memory
                self._copy_stream.synchronize()
            for k in keys:
                self._registered.pop(k, None)
            if pinned:
                rt = torch.cuda.cudart()
                for ptr in pinned:
                    if rt.cudaHostUnregister(ptr) != rt.cudaError.success:
                        clear_cuda_error()  # never left for torch to find

        total = sum(b.nbytes for b in blocks)
        how = "page-locked (cudaHostRegister)" if self.cuda else "registered"
        return undo, f"{len(keys)} input slots ({total / 2**20:.1f} MiB) {how}"

    def _registered_source(self, arr: np.ndarray) -> torch.Tensor | None:
        """`arr` as a tensor on its registered host buffer (same memory), or None."""
        reg = self._registered.get(arr.ctypes.data) if arr.flags.c_contiguous else None
        if reg is None or arr.nbytes > reg[1]:
            return None
        dtype = _TORCH_DTYPES.get(arr.dtype.str)
        return None if dtype is None else reg[0][:arr.nbytes].view(dtype).view(arr.shape)

    def _device_copy(self, dst: torch.Tensor, src: torch.Tensor,
                     nan_tail: torch.Tensor | None = None) -> None:
        """dst (device slot) <- src (registered host memory), then `nan_tail` (the bucket's
        padding rows) <- NaN: async on the copy stream."""
        if self._copy_stream is None:
            dst.copy_(src)
            if nan_tail is not None:
                nan_tail.fill_(float("nan"))
            return
        # after whatever the frame stream queued (a frame still reading the slot), then the
        # copy; the frame stream waits for it in _join_copies
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._copy_stream):
            dst.copy_(src, non_blocking=True)
            if nan_tail is not None:
                nan_tail.fill_(float("nan"))
        self._pending_copies = True

    def _join_copies(self) -> None:
        """The frame's stream waits for the pre-staging copies (no host sync)."""
        if self._pending_copies and self._copy_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._copy_stream)
            self._pending_copies = False

    def configure_cameras(self, cameras: int) -> None:
        if cameras == self._cam_count:
            return
        per = sum(a * b for _, (a, b) in CAMERA_FIELDS)
        self._cam_host = torch.empty(cameras * per, dtype=torch.float64, pin_memory=self.cuda)
        self._cam_dev = self._cam_host.to(self.device) if self.cuda else self._cam_host
        self._cam_np: dict[str, np.ndarray] = {}
        self._cam_views: dict[str, torch.Tensor] = {}
        off = 0
        for name, (a, b) in CAMERA_FIELDS:
            n = cameras * a * b
            self._cam_np[name] = self._cam_host[off:off + n].numpy().reshape(cameras, a, b)
            self._cam_views[name] = self._cam_dev[off:off + n].view(cameras, a, b)
            off += n
        self._cam_count = cameras

    # ---- per frame ------------------------------------------------------------------------
    def images(self, images: list[np.ndarray]) -> torch.Tensor:
        """[H,W,3] uint8 arrays (any strides, e.g. a BGR view) -> [C,3,H,W] uint8 on the
        device (channels_last memory): one copy each into the host buffer, one H2D copy."""
        self._join_copies()  # before configure_images may free a slot a copy still writes
        self.configure_images(len(images), images[0].shape[:2])
        assert self._img_np is not None and self._img_dev is not None
        on_device = [self._dev_staged[i] is img for i, img in enumerate(images)]
        for i, img in enumerate(images):
            if on_device[i] or self._staged[i] is img:  # copied on arrival (prestage_image)
                self.prestaged_used += 1
                self.prestaged_direct += on_device[i]
            else:
                self._img_np[i] = img
        self._staged = [None] * len(images)  # consumed: the next frame stages again
        self._dev_staged = [None] * len(images)
        if self.cuda:
            assert self._img_host is not None
            if not any(on_device):  # one copy of all cameras
                self._img_dev_nhwc.copy_(self._img_host, non_blocking=True)
            else:  # only the cameras not already in their device slot
                for i, done in enumerate(on_device):
                    if not done:
                        self._img_dev_nhwc[i].copy_(self._img_host[i], non_blocking=True)
        return self._img_dev

    def prestage_image(self, cam: int, img: np.ndarray) -> bool:
        """Copy camera `cam`'s [H,W,3] uint8 image into its host slot now; `images()` skips
        the copy if the same array object is in the frame. False (nothing staged) when it does
        not fit the configured buffer: the frame path then copies or rejects it as usual."""
        buf = self._img_np
        if buf is None or not 0 <= cam < buf.shape[0] or img.dtype != np.uint8 or \
                img.shape != buf.shape[1:]:
            return False
        self._staged[cam] = self._dev_staged[cam] = None  # never trusted half-written
        src = self._registered_source(img)
        if src is not None:  # a registered buffer: straight into the device slot
            self._device_copy(self._img_dev_nhwc[cam], src)
            self._dev_staged[cam] = img
            return True
        buf[cam] = img
        self._staged[cam] = img
        return True

    def prestage_points(self, pts: np.ndarray) -> bool:
        """Copy a cloud [N,3] (N <= the largest bucket) into the points buffer now, NaN padded
        to its bucket; `points()` skips the copy for the same array object. False (nothing
        staged) for empty or larger clouds (the frame path handles them)."""
        n = int(pts.shape[0]) if pts.ndim == 2 and pts.shape[1] == 3 else 0
        self._staged_pts = self._dev_staged_pts = None
        if n == 0 or n > self.buckets[-1]:
            return False
        src = self._registered_source(pts) if pts.dtype == np.float32 else None
        if src is not None:  # a registered buffer: straight into the device buffer
            nb = bucket_size(n, self.buckets)
            self._device_copy(self._pts_dev[:n], src, self._pts_dev[n:nb])
            self._dev_staged_pts = pts
            return True
        self._fill_points(pts)
        self._staged_pts = pts
        return True

    def _fill_points(self, pts: np.ndarray) -> tuple[int, int]:
        """pts [N,3], N <= the largest bucket -> the host buffer, NaN padded. (nb, pad)."""
        n = int(pts.shape[0])
        nb = bucket_size(n, self.buckets)
        np.copyto(self._pts_np[:n], pts, casting="unsafe")
        self._pts_np[n:nb] = np.nan
        return nb, nb - n

    def cameras(self, T_base_from_cam: np.ndarray, K: np.ndarray) -> dict[str, torch.Tensor]:
        """T_base_from_cam [C,4,4], K [C,3,3] -> device float64 views T_cam_from_base, K,
        K_inv, T_base_from_cam (one H2D copy of the packed buffer)."""
        self.configure_cameras(T_base_from_cam.shape[0])
        h = self._cam_np
        h["T_base_from_cam"][...] = T_base_from_cam
        h["T_cam_from_base"][...] = np.linalg.inv(T_base_from_cam)
        h["K"][...] = K
        h["K_inv"][...] = np.linalg.inv(K)
        if self.cuda:
            self._cam_dev.copy_(self._cam_host, non_blocking=True)
        return self._cam_views

    def points(self, pts: np.ndarray | None) -> StagedPoints:
        """pts [N,3] (any float dtype, any strides, NaN rows allowed) -> the device cloud
        padded with NaN to its bucket. N <= the largest bucket (the normal case): one copy
        into the host buffer, no filtering on the host (non-finite rows are invalid in the
        projection and counted on the device). Larger clouds: finite rows first on the host
        (as before), truncated to the largest bucket."""
        if pts is None or pts.shape[0] == 0:
            return StagedPoints(None, 0, 0, 0, 0)
        n = int(pts.shape[0])
        nmax = self.buckets[-1]
        staged, self._staged_pts = self._staged_pts, None  # consumed either way
        on_device, self._dev_staged_pts = self._dev_staged_pts is pts, None
        self._join_copies()
        if on_device and n <= nmax:  # in the device buffer already (registered source)
            self.prestaged_used += 1
            self.prestaged_direct += 1
            nb = bucket_size(n, self.buckets)
            return StagedPoints(self._pts_dev[:nb], n, nb - n, None, 0)
        if n <= nmax:
            if staged is pts:  # copied on arrival (prestage_points)
                self.prestaged_used += 1
                nb = bucket_size(n, self.buckets)
                pad = nb - n
            else:
                nb, pad = self._fill_points(pts)
            host_dropped, truncated = None, 0
        else:
            finite = np.isfinite(pts).all(axis=1)
            good = pts[finite]
            host_dropped = n - int(good.shape[0])
            if good.shape[0] == 0:
                return StagedPoints(None, n, 0, host_dropped, 0)
            padded, used, truncated = bucket_points(good.astype(np.float32, copy=False),
                                                    self.buckets)
            nb = padded.shape[0]
            self._pts_np[:nb] = padded
            pad = 0
        if self.cuda:
            self._pts_dev[:nb].copy_(self._pts_host[:nb], non_blocking=True)
        return StagedPoints(self._pts_dev[:nb], n, pad, host_dropped, truncated)
