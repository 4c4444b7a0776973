"""kestrel_interfaces/PerceptionResult written straight as CDR bytes, for `Publisher.publish`
with a `bytes` payload (rclpy's documented serialized-message path: rcl publishes the bytes as
they are).

Why: publishing the message object makes rclpy convert it to its C struct (one memcpy of every
array: 1.85 MB for 6 cameras' masks and 16-bit depths at stride 2, 0.47 MB at the default 4)
and then serialise the struct (a second memcpy), holding the GIL in both; and building the
message object costs the Python objects of the nested Images, Headers, Times and
StageTimings. Here every field goes into a list of parts (struct-packed scalars, memoryviews
of the numpy arrays) and ONE `b"".join` copies them into the payload.

The layout is plain CDR (OMG XTypes 1.3, XCDR version 1, little endian) as Fast DDS's Fast CDR
writes it for ROS 2 types: a 4-byte encapsulation header (0x0001 = CDR_LE), then each field in
.msg order, every primitive aligned to its own size counted from the end of that header;
string = uint32 length including the NUL, the UTF-8 bytes, the NUL; sequence = uint32 count,
then the elements (aligned to the element size; an empty sequence adds no padding). Constants
are not serialised. rmw_fastrtps's own serialisation (rclpy.serialization.serialize_message)
leaves its padding bytes uninitialised and sizes its buffer by an upper-bound estimate, so it
can end in garbage bytes past the data; `same_as` compares outside the padding, up to the end
of this payload. The node runs `result_msg.matches_rmw` at configure (that comparison plus a
round trip through the rmw's deserialiser) and publishes message objects if they ever differ
(a changed .msg, a different rmw or encoding), so the fast path can never send a payload the
subscribers misread. Message types only (no rclpy).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np

ENCAPSULATION_CDR_LE = b"\x00\x01\x00\x00"
_ZEROS = bytes(8)
_U32, _I32, _U8, _F64 = struct.Struct("<I"), struct.Struct("<i"), struct.Struct("<B"), \
    struct.Struct("<d")
_TIME, _U32X2 = struct.Struct("<iI"), struct.Struct("<II")  # 4-byte fields back to back
# str -> its CDR string (uint32 length incl. the NUL, UTF-8 bytes, NUL): the same few names
# (frames, classes, encodings, stage names) come every frame; bounded for arbitrary strings
_STRINGS: dict[str, bytes] = {}
_STRINGS_MAX = 4096


def _cdr_string(value: str) -> bytes:
    data = _STRINGS.get(value)
    if data is None:
        raw = value.encode() + b"\x00"
        data = _U32.pack(len(raw)) + raw
        if len(_STRINGS) < _STRINGS_MAX:
            _STRINGS[value] = data
    return data


class CdrWriter:
    """Appends CDR fields (little endian, XCDR1 alignment) as parts; `payload()` joins them."""

    __slots__ = ("parts", "pos", "pads")

    def __init__(self) -> None:
        self.parts: list = [ENCAPSULATION_CDR_LE]
        self.pos = 0  # offset in the payload after the encapsulation header
        self.pads: list[tuple[int, int]] = []  # (offset, bytes) of the alignment padding

    def _align(self, n: int) -> None:
        pad = -self.pos % n
        if pad:
            self.parts.append(_ZEROS[:pad])
            self.pads.append((self.pos, pad))
            self.pos += pad

    def _scalar(self, fmt: struct.Struct, value) -> None:
        self._align(fmt.size)
        self.parts.append(fmt.pack(value))
        self.pos += fmt.size

    def u32(self, value: int) -> None:
        self._scalar(_U32, value)

    def i32(self, value: int) -> None:
        self._scalar(_I32, value)

    def u8(self, value: int) -> None:
        self._scalar(_U8, value)

    def f64(self, value: float) -> None:
        self._scalar(_F64, value)

    def string(self, value: str) -> None:
        self._align(4)  # the length prefix
        data = _cdr_string(value)
        self.parts.append(data)
        self.pos += len(data)

    def strings(self, values: Sequence[str]) -> None:
        self.u32(len(values))
        for v in values:
            self.string(v)

    def array(self, values: np.ndarray, dtype: str) -> None:
        """A sequence of primitives from a numpy array (converted to `dtype`, little endian:
        '<u4', '<f8', ...); the bytes are referenced, copied once by payload()."""
        a = np.ascontiguousarray(values, dtype=dtype).reshape(-1)
        self.u32(a.size)
        if a.size:
            self._align(a.itemsize)
            self.parts.append(memoryview(a).cast("B"))
            self.pos += a.nbytes

    def time(self, stamp_ns: int) -> None:  # builtin_interfaces/Time: int32 sec, uint32 ns
        sec, nsec = divmod(int(stamp_ns), 1_000_000_000)
        self._align(4)
        self.parts.append(_TIME.pack(sec, nsec))
        self.pos += 8

    def header(self, stamp_ns: int, frame_id: str) -> None:  # std_msgs/Header
        self.time(stamp_ns)
        self.string(frame_id)

    def image(self, stamp_ns: int, frame_id: str, data: np.ndarray, encoding: str) -> None:
        """sensor_msgs/Image of an [H,W] map (mono8 / 16UC1 / 32FC1), little endian."""
        a = np.ascontiguousarray(data)
        self.header(stamp_ns, frame_id)
        self._align(4)
        self.parts.append(_U32X2.pack(a.shape[0], a.shape[1]))  # height, width
        self.pos += 8
        self.string(encoding)
        self.u8(0)  # is_bigendian
        self._align(4)
        self.parts.append(_U32X2.pack(a.shape[1] * a.itemsize, a.nbytes))  # step, data count
        self.pos += 8
        if a.nbytes:
            self.parts.append(memoryview(a).cast("B"))
            self.pos += a.nbytes

    def timings(self, timings: dict[str, float]) -> None:  # StageTiming[]
        self.u32(len(timings))
        for name, duration in timings.items():
            self.string(name)
            self.f64(float(duration))

    def payload(self) -> bytes:
        return b"".join(self.parts)

    def same_as(self, serialized: bytes) -> bool:
        """Whether `serialized` (another encoder's payload of the same message) equals this
        one outside the padding bytes, up to this payload's end (another encoder may leave
        its padding uninitialised and its buffer longer than the data)."""
        mine = bytearray(self.payload())
        other = bytearray(serialized[:len(mine)])
        if len(mine) != len(other):
            return False
        for off, n in self.pads:
            at = len(ENCAPSULATION_CDR_LE) + off
            other[at:at + n] = mine[at:at + n]
        return mine == other
