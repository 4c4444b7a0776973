"""Newest-message rings in shared memory between the perception node and its input receiver
processes (parameter `receive: processes`; receivers.py starts them).

One segment, one ring per sensor (cameras 0..C-1, then the LiDAR cloud):
  header  int64 [16]: PUB (newest complete slot), VER (messages published), SEQ[3] (per slot,
          odd while it is written), READY (the receiver subscribed), PID, then the receiver's
          counters (RX_COUNTERS)
  meta    int64 [3, 8]: per slot: stamp ns (header.stamp), receipt ns (time.monotonic_ns at the
          receiver's callback entry: the same clock in every process), rows (image height / cloud
          points), cols (image width / 3), encoding (ENCODINGS index), bytes, version, frame-id
          length
  frame   uint8 [3, FRAME_ID_BYTES]: per slot header.frame_id, utf-8
  data    uint8 [3, slot_bytes]: the image [H, W, 3] uint8 or the cloud [N, 3] float32, packed
One writer per ring (the sensor's receiver process, one thread) and one reader (the node's
receiver thread). The writer fills slot (PUB + 1) % 3, never the published one; the reader
copies the published slot and keeps the copy only if the slot's SEQ is even and unchanged
across it (a seqlock, as kestrel_control.core.shm_control.SharedLatestValue, under the same
x86-64 TSO argument: numpy element stores are plain stores, seen in program order).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kestrel_common.shm import Arena

SLOTS = 3
FRAME_ID_BYTES = 128
ENCODINGS = ("rgb8", "bgr8", "xyz32")  # meta ENC: image encodings, then the cloud's
# receiver-side counters, named as the node's own (a drop in a receiver is the same drop)
RX_COUNTERS = ("received", "dropped_bad_encoding", "dropped_bad_image", "dropped_size_mismatch",
               "dropped_bad_cloud", "dropped_too_many_points")
_PUB, _VER, _SEQ, _READY, _PID, _CNT = 0, 1, 2, 5, 6, 8
_HEADER = 16
_M_STAMP, _M_RECV, _M_ROWS, _M_COLS, _M_ENC, _M_BYTES, _M_VER, _M_FID = range(8)


@dataclass(frozen=True)
class RingItem:
    """One message copied out of a ring (the data went into the reader's buffer)."""

    stamp_ns: int
    recv_ns: int  # time.monotonic_ns() when the receiver's callback started
    rows: int  # image height, or cloud points
    cols: int  # image width (0 for a cloud)
    encoding: str
    nbytes: int
    version: int  # 1, 2, ... per ring: a gap = messages overwritten before the node read them
    frame_id: str


class SensorRing:
    """The ring of one sensor (views into the segment; see the module docstring)."""

    def __init__(self, header: np.ndarray, meta: np.ndarray, frame: np.ndarray,
                 data: np.ndarray, *, max_retries: int = 16) -> None:
        self.h, self.meta, self.frame, self.data = header, meta, frame, data
        self.slot_bytes = int(data.shape[1])
        self.max_retries = max_retries
        self.torn_reads = 0  # reader side: copies discarded because the writer lapped them

    # ---- writer (the receiver process) -------------------------------------------------------
    def set_ready(self, pid: int) -> None:
        self.h[_PID] = pid
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
        h = self.h
        idx = (h.item(_PUB) + 1) % SLOTS if h.item(_VER) else 0
        seq = h.item(_SEQ + idx)
        h[_SEQ + idx] = seq + 1  # odd: being written
        np.copyto(self.data[idx, :nbytes].view(array.dtype).reshape(array.shape), array)
        fid = frame_id.encode()[:FRAME_ID_BYTES]  # cut longer ids (at a character boundary)
        fid = fid.decode(errors="ignore").encode()
        self.frame[idx, :len(fid)] = np.frombuffer(fid, np.uint8)
        version = h.item(_VER) + 1
        rows = int(array.shape[0])
        cols = int(array.shape[1]) if encoding != "xyz32" else 0
        self.meta[idx] = (stamp_ns, recv_ns, rows, cols, ENCODINGS.index(encoding), nbytes,
                          version, len(fid))
        h[_SEQ + idx] = seq + 2  # even: complete
        h[_PUB] = idx
        h[_VER] = version
        return True

    # ---- reader (the node) ---------------------------------------------------------------------
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

    def read_into(self, out: np.ndarray) -> RingItem | None:
        """Copy the newest complete message's data into `out` (uint8, >= slot_bytes) and return
        its metadata; None if nothing was published yet or every try was torn (counted)."""
        h = self.h
        if not h.item(_VER):
            return None
        for _ in range(self.max_retries):
            idx = h.item(_PUB)
            s1 = h.item(_SEQ + idx)
            if s1 & 1:
                self.torn_reads += 1
                continue
            m = self.meta[idx].tolist()
            nbytes = m[_M_BYTES]
            out[:nbytes] = self.data[idx, :nbytes]
            fid = self.frame[idx, :m[_M_FID]].tobytes()
            if h.item(_SEQ + idx) == s1:
                return RingItem(m[_M_STAMP], m[_M_RECV], m[_M_ROWS], m[_M_COLS],
                                ENCODINGS[m[_M_ENC]], nbytes, m[_M_VER],
                                fid.decode(errors="replace"))
            self.torn_reads += 1
        return None


@dataclass(frozen=True)
class RingLayout:
    """Sizes that fix the segment (the node and every receiver build the same views)."""

    num_cameras: int
    image_height: int
    image_width: int
    max_points: int

    def __post_init__(self) -> None:
        for name in ("num_cameras", "image_height", "image_width", "max_points"):
            if getattr(self, name) < 1:
                raise ValueError(f"parameter '{name}' = {getattr(self, name)!r}: must be >= 1")

    @property
    def num_sensors(self) -> int:
        return self.num_cameras + 1  # the cloud's ring is the last

    def slot_bytes(self, sensor: int) -> int:
        if sensor < self.num_cameras:
            return self.image_height * self.image_width * 3  # rgb8 / bgr8
        return self.max_points * 12  # x, y, z float32

    def _build(self, arena: Arena) -> list[tuple]:
        return [(arena.take(_HEADER, np.int64), arena.take((SLOTS, 8), np.int64),
                 arena.take((SLOTS, FRAME_ID_BYTES), np.uint8),
                 arena.take((SLOTS, self.slot_bytes(s)), np.uint8))
                for s in range(self.num_sensors)]

    @property
    def size(self) -> int:
        arena = Arena()
        self._build(arena)
        return arena.offset

    def rings(self, buf) -> list[SensorRing]:
        """Views on a mapped segment of `size` bytes, one ring per sensor."""
        return [SensorRing(*views) for views in self._build(Arena(buf))]

    def to_args(self) -> list[str]:
        return [str(v) for v in (self.num_cameras, self.image_height, self.image_width,
                                 self.max_points)]

    @classmethod
    def from_args(cls, values: list[str]) -> RingLayout:
        return cls(*(int(v) for v in values))
