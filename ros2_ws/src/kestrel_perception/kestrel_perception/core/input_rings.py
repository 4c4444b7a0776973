"""Shared-memory input slots between the perception node and its input receiver processes
(parameter `receive: processes`; receivers.py starts them). The node reads NO copy of an
input: its arrays are views of the slot the receiver wrote, and on CUDA the node has
page-locked the slots (cudaHostRegister) so they go straight to the device.

One segment, one ring of `slots` slots per sensor (cameras 0..C-1, then the LiDAR cloud):
  header  int64 [24]: PUB (slot of the newest message not yet claimed, -1 none), VER (messages
          published), READY (the receiver subscribed), PID, then the receiver's counters
          (RX_COUNTERS; "lost": messages its depth-1 subscription never took, from the
          publisher's sequence numbers, core/loss.py)
  state   int64 [slots]: FREE, WRITING (the receiver fills it), PUBLISHED (= PUB), HELD (the
          node uses it: its synchroniser history, a pending host->device copy)
  meta    int64 [slots, 9]: stamp ns (header.stamp), receipt ns (time.monotonic_ns at the
          receiver's callback entry: the same clock in every process), rows (image height /
          cloud points), cols (image width; 0 for a cloud), encoding (ENCODINGS index), bytes,
          version, frame-id length, published ns (time.monotonic_ns when the slot was
          published)
  frame   uint8 [slots, FRAME_ID_BYTES]: header.frame_id, utf-8
  data    uint8 [slots, slot_bytes]: the image [H, W, 3] uint8 or the cloud [N, 3] float32
  info    int64 [4] + float64 [9]: a camera's newest CameraInfo (version, stamp ns, receipt
          ns, width << 32 | height; K row-major), written and read under the ring's lock
          (newest wins, as the images: the node's executor then takes no per-frame message)

Ownership, so that no slot is written while the node reads it (no torn input, no copy to
check one): one writer per ring (its receiver process) and one reader (the node's receiver
thread). State changes happen under a POSIX record lock on one byte of the segment's file per
ring (fcntl: microseconds, and the kernel drops the lock of a process that dies holding it):
- writer: takes a FREE slot (-> WRITING), fills it WITHOUT the lock, then publishes it
  (-> PUBLISHED, PUB, VER + 1); a newer message replaces an unclaimed one (that slot -> FREE;
  the node counts the version gap as overwritten);
- reader (`claim`): the PUBLISHED slot -> HELD, and its oldest held slot beyond `hold` -> FREE.
With slots >= hold + 2 a FREE slot always exists: <= hold HELD, <= 1 PUBLISHED.
"""

from __future__ import annotations

import contextlib
import fcntl
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from kestrel_common.shm import Arena

FRAME_ID_BYTES = 128
ENCODINGS = ("rgb8", "bgr8", "xyz32")  # meta ENC: image encodings, then the cloud's
# receiver-side counters, named as the node's own (a drop in a receiver is the same drop)
RX_COUNTERS = ("received", "lost", "dropped_bad_encoding", "dropped_bad_image",
               "dropped_size_mismatch", "dropped_bad_cloud", "dropped_too_many_points",
               "dropped_bad_camera_info", "unrectified_camera_info")
FREE, WRITING, PUBLISHED, HELD = 0, 1, 2, 3
_PUB, _VER, _READY, _PID, _CNT = 0, 1, 2, 3, 8
_HEADER = 24  # _CNT + len(RX_COUNTERS) <= _HEADER (a new counter may need a bigger header)
assert _CNT + len(RX_COUNTERS) <= _HEADER, "ring header too small for RX_COUNTERS"
_I_VER, _I_STAMP, _I_RECV, _I_SIZE = range(4)
_M_STAMP, _M_RECV, _M_ROWS, _M_COLS, _M_ENC, _M_BYTES, _M_VER, _M_FID, _M_PUBT = range(9)


@dataclass(frozen=True)
class RingItem:
    """One message claimed by the node: its data is `SensorRing.view(item)` (slot `slot`, held
    until the node claimed `hold` newer messages of this sensor)."""

    slot: int
    stamp_ns: int
    recv_ns: int  # time.monotonic_ns() when the receiver's callback started
    rows: int  # image height, or cloud points
    cols: int  # image width (0 for a cloud)
    encoding: str
    nbytes: int
    version: int  # 1, 2, ... per ring: a gap = messages replaced before the node claimed them
    frame_id: str
    published_ns: int = 0  # time.monotonic_ns() when the receiver published the slot


@dataclass(frozen=True)
class InfoItem:
    """A camera's newest CameraInfo, as the node's synchroniser takes it."""

    version: int
    stamp_ns: int
    recv_ns: int  # time.monotonic_ns() when the receiver's callback started
    k: np.ndarray  # [3, 3] float64
    width: int
    height: int


class SensorRing:
    """The ring of one sensor (views into the segment; see the module docstring). `lock_fd`:
    an fd of the segment's file open in THIS process; byte `index` of it is this ring's lock."""

    def __init__(self, index: int, lock_fd: int, header: np.ndarray, state: np.ndarray,
                 meta: np.ndarray, frame: np.ndarray, data: np.ndarray, info: np.ndarray,
                 info_k: np.ndarray) -> None:
        self.index, self.lock_fd = index, lock_fd
        self.h, self.state, self.meta, self.frame, self.data = header, state, meta, frame, data
        self.info, self.info_k = info, info_k
        self.slot_bytes = int(data.shape[1])

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """This ring's record lock, held for the block (released on an exception too)."""
        fcntl.lockf(self.lock_fd, fcntl.LOCK_EX, 1, self.index)
        try:
            yield
        finally:
            fcntl.lockf(self.lock_fd, fcntl.LOCK_UN, 1, self.index)

    # ---- writer (the receiver process) -------------------------------------------------------
    def set_ready(self, pid: int) -> None:
        self.h[_PID] = pid
        self.h[_PUB] = -1
        self.h[_READY] = 1

    def count(self, name: str, n: int = 1) -> None:
        self.h[_CNT + RX_COUNTERS.index(name)] += n

    def write(self, array: np.ndarray, stamp_ns: int, recv_ns: int, encoding: str,
              frame_id: str) -> bool:
        """Publish `array` ([H, W, 3] uint8 image, or [N, 3] float32 cloud; any strides).
        False (nothing written) when it does not fit a slot."""
        nbytes = int(array.size) * array.itemsize
        if nbytes > self.slot_bytes:
            return False
        state = self.state
        with self._locked():
            free = np.flatnonzero(state == FREE)
            if free.size == 0:  # cannot happen with slots >= hold + 2 (module docstring)
                raise RuntimeError(f"ring {self.index}: no free slot (states {state.tolist()})")
            idx = int(free[0])
            state[idx] = WRITING
        np.copyto(self.data[idx, :nbytes].view(array.dtype).reshape(array.shape), array)
        fid = frame_id.encode()[:FRAME_ID_BYTES]  # cut longer ids (at a character boundary)
        fid = fid.decode(errors="ignore").encode()
        self.frame[idx, :len(fid)] = np.frombuffer(fid, np.uint8)
        rows = int(array.shape[0])
        cols = int(array.shape[1]) if encoding != "xyz32" else 0
        h = self.h
        with self._locked():
            version = h.item(_VER) + 1
            self.meta[idx] = (stamp_ns, recv_ns, rows, cols, ENCODINGS.index(encoding), nbytes,
                              version, len(fid), time.monotonic_ns())
            old = h.item(_PUB)
            if old >= 0 and state[old] == PUBLISHED:  # never claimed: replaced
                state[old] = FREE
            state[idx] = PUBLISHED
            h[_PUB] = idx
            h[_VER] = version
        return True

    def write_info(self, stamp_ns: int, recv_ns: int, k: np.ndarray, width: int,
                   height: int) -> None:
        """Publish a camera's CameraInfo (K [3,3]); a newer one replaces an unread one."""
        with self._locked():
            self.info_k[:] = np.asarray(k, np.float64).reshape(9)
            self.info[_I_STAMP] = stamp_ns
            self.info[_I_RECV] = recv_ns
            self.info[_I_SIZE] = (int(width) << 32) | int(height)
            self.info[_I_VER] += 1

    # ---- reader (the node) ---------------------------------------------------------------------
    @property
    def info_version(self) -> int:
        return self.info.item(_I_VER)

    def read_info(self) -> InfoItem | None:
        """The newest CameraInfo (a copy), or None if none was published."""
        with self._locked():
            ver, stamp, recv, size = self.info.tolist()
            k = self.info_k.reshape(3, 3).copy()
        return None if ver == 0 else InfoItem(ver, stamp, recv, k, size >> 32, size & 0xFFFFFFFF)

    @property
    def ready(self) -> bool:
        return bool(self.h.item(_READY))

    @property
    def pid(self) -> int:
        return self.h.item(_PID)

    @property
    def version(self) -> int:
        return self.h.item(_VER)

    def counters(self) -> dict[str, int]:
        return {name: self.h.item(_CNT + i) for i, name in enumerate(RX_COUNTERS)}

    def claim(self, release: int = -1) -> RingItem | None:
        """Take the newest published message (its slot -> HELD) and give slot `release` (one
        this reader held, -1 none) back to the writer. None when nothing new was published
        (`release` is still given back)."""
        h, state = self.h, self.state
        with self._locked():
            if release >= 0:
                state[release] = FREE
            idx = h.item(_PUB)
            if idx < 0 or state[idx] != PUBLISHED:
                return None
            state[idx] = HELD
            h[_PUB] = -1
            m = self.meta[idx].tolist()
        fid = self.frame[idx, :m[_M_FID]].tobytes()
        return RingItem(idx, m[_M_STAMP], m[_M_RECV], m[_M_ROWS], m[_M_COLS],
                        ENCODINGS[m[_M_ENC]], m[_M_BYTES], m[_M_VER],
                        fid.decode(errors="replace"), m[_M_PUBT])

    def holds(self, slot: int, version: int) -> bool:
        """Slot `slot` still holds message `version`, claimed and untouched since: a slot is
        written only when FREE, and its version changes when it is published again."""
        return self.state.item(slot) == HELD and self.meta.item(slot, _M_VER) == version

    def view(self, item: RingItem) -> np.ndarray:
        """The claimed message's array, a view of its slot: [H, W, 3] uint8 or [N, 3] float32."""
        flat = self.data[item.slot, :item.nbytes]
        if item.encoding == "xyz32":
            return flat.view(np.float32).reshape(item.rows, 3)
        return flat.reshape(item.rows, item.cols, 3)


@dataclass(frozen=True)
class RingLayout:
    """Sizes that fix the segment (the node and every receiver build the same views)."""

    num_cameras: int
    image_height: int
    image_width: int
    max_points: int
    slots: int = 4  # per sensor: >= the node's held messages + 2

    def __post_init__(self) -> None:
        for name in ("num_cameras", "image_height", "image_width", "max_points"):
            if getattr(self, name) < 1:
                raise ValueError(f"parameter '{name}' = {getattr(self, name)!r}: must be >= 1")
        if self.slots < 3:
            raise ValueError(f"ring slots = {self.slots!r}: must be >= 3")

    @property
    def num_sensors(self) -> int:
        return self.num_cameras + 1  # the cloud's ring is the last

    def slot_bytes(self, sensor: int) -> int:
        if sensor < self.num_cameras:
            return self.image_height * self.image_width * 3  # rgb8 / bgr8
        return self.max_points * 12  # x, y, z float32

    def _build(self, arena: Arena) -> list[tuple]:
        k = self.slots
        return [(arena.take(_HEADER, np.int64), arena.take(k, np.int64),
                 arena.take((k, 9), np.int64), arena.take((k, FRAME_ID_BYTES), np.uint8),
                 arena.take((k, self.slot_bytes(s)), np.uint8), arena.take(4, np.int64),
                 arena.take(9, np.float64))
                for s in range(self.num_sensors)]

    @property
    def size(self) -> int:
        arena = Arena()
        self._build(arena)
        return arena.offset

    def rings(self, buf, lock_fd: int) -> list[SensorRing]:
        """Views on a mapped segment of `size` bytes, one ring per sensor; `lock_fd`: an fd of
        the segment's file opened by this process (the rings' locks)."""
        return [SensorRing(s, lock_fd, *views)
                for s, views in enumerate(self._build(Arena(buf)))]

    def to_args(self) -> list[str]:
        return [str(v) for v in (self.num_cameras, self.image_height, self.image_width,
                                 self.max_points, self.slots)]

    @classmethod
    def from_args(cls, values: list[str]) -> RingLayout:
        return cls(*(int(v) for v in values))
