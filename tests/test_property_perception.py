"""Property-based tests of the perception input paths (hypothesis), through
kestrel_common.conversions and kestrel_perception.msg_inputs: whatever Image, CameraInfo or
PointCloud2 arrives (wrong encodings, sizes, steps, endianness, zero/NaN K, distortion, NaN/inf
points, wrong point_step or fields, huge counts), the result is a valid array or a named drop
(ConversionError / InputDrop with its counter): no other exception escapes."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from sensor_msgs.msg import CameraInfo, Image, PointCloud2, PointField

from kestrel_common.conversions import (ConversionError, camera_info_is_distorted,
                                        camera_info_to_k, image_to_numpy, pointcloud2_to_xyz)
from kestrel_perception.msg_inputs import InputDrop, cloud_xyz, image_rgb

SETTINGS = settings(max_examples=200, deadline=None)
IMAGE_DROPS = {"dropped_bad_encoding", "dropped_bad_image"}
ENCODINGS = st.one_of(st.sampled_from(["rgb8", "bgr8", "mono8", "32FC1", "16UC1", "rgba8",
                                       "RGB8", "", "yuv422"]), st.text(max_size=8))
UINT32 = st.integers(0, 2**32 - 1)


@st.composite
def images(draw) -> Image:
    msg = Image()
    msg.encoding = draw(ENCODINGS)
    msg.height = draw(st.one_of(st.integers(0, 8), UINT32))
    msg.width = draw(st.one_of(st.integers(0, 8), UINT32))
    channels = draw(st.sampled_from([1, 2, 3, 4]))
    msg.step = draw(st.one_of(st.just(min(msg.width * channels, 2**32 - 1)),
                              st.integers(0, 40), UINT32))
    n = draw(st.one_of(st.just(min(msg.step * msg.height, 4096)), st.integers(0, 300)))
    msg.data = draw(st.binary(min_size=n, max_size=n))
    msg.is_bigendian = draw(st.sampled_from([0, 1]))
    return msg


@SETTINGS
@given(msg=images(), accept=st.sampled_from([("rgb8", "bgr8"), ("mono8",), ("32FC1",),
                                             ("16UC1",)]))
def test_any_image_is_an_array_or_a_named_drop(msg, accept) -> None:
    try:
        arr = image_to_numpy(msg, accept=accept)
    except ConversionError as exc:
        assert exc.reason in ("bad_encoding", "bad_size")
    else:
        assert arr.shape[:2] == (msg.height, msg.width)
    try:
        rgb = image_rgb(msg)
    except InputDrop as exc:
        assert exc.counter in IMAGE_DROPS
    else:
        assert rgb.shape == (msg.height, msg.width, 3) and rgb.dtype == np.uint8


FLOATS = st.floats(allow_nan=True, allow_infinity=True)


@SETTINGS
@given(k=st.lists(FLOATS, min_size=9, max_size=9), d=st.lists(FLOATS, max_size=14),
       zero=st.booleans())
def test_any_camera_info_is_k_or_a_named_drop(k, d, zero) -> None:
    msg = CameraInfo()
    msg.k = [0.0] * 9 if zero else k
    msg.d = d
    try:
        km = camera_info_to_k(msg)
    except ConversionError as exc:
        assert exc.reason == "bad_camera_info"
    else:
        assert np.isfinite(km).all() and km[0, 0] > 0 and km[1, 1] > 0 and km[2, 2] == 1.0
    assert camera_info_is_distorted(msg) == any(c != 0.0 for c in d)  # NaN counts as set


def _field(name: str, offset: int, datatype: int, count: int = 1) -> PointField:
    return PointField(name=name, offset=offset, datatype=datatype, count=count)


SPECIAL = [float("nan"), float("inf"), -float("inf"), 0.0, 1.5, -2.0, 1e30]


@st.composite
def clouds(draw) -> PointCloud2:
    msg = PointCloud2()
    msg.header.frame_id = draw(st.sampled_from(["", "lidar", "base"]))
    n = draw(st.integers(0, 40))
    msg.height = draw(st.sampled_from([1, 1, 1, 2, 0]))
    msg.width = draw(st.one_of(st.just(n), st.integers(0, 50), UINT32))
    good = draw(st.booleans())
    if good:  # the common layout: x, y, z float32 at 0/4/8, maybe padded
        step = draw(st.sampled_from([12, 16, 32]))
        fields = [_field(a, 4 * i, PointField.FLOAT32) for i, a in enumerate("xyz")]
    else:
        step = draw(st.integers(0, 40))
        names = draw(st.lists(st.sampled_from(["x", "y", "z", "intensity", "X"]), max_size=5))
        fields = [_field(a, draw(st.integers(0, 48)), draw(st.integers(0, 9)),
                         draw(st.integers(0, 3))) for a in names]
    msg.fields = fields
    msg.point_step = step
    msg.row_step = draw(st.one_of(st.just(min(step * msg.width, 2**32 - 1)), UINT32))
    msg.is_bigendian = draw(st.booleans())
    vals = draw(st.lists(st.sampled_from(SPECIAL) | FLOATS, min_size=0, max_size=200))
    with np.errstate(over="ignore"):  # beyond float32: inf, as a sensor may send
        raw = np.asarray(vals, dtype=np.float64).astype("<f4").tobytes()
    size = draw(st.one_of(st.just(min(msg.row_step * msg.height, 4096)),
                          st.integers(0, 800)))
    msg.data = (raw * (size // max(len(raw), 1) + 1))[:size] if raw else bytes(size)
    return msg


@SETTINGS
@given(msg=clouds(), max_points=st.sampled_from([0, 10, 10_000, 2**40]))
def test_any_cloud_is_points_or_a_named_drop(msg, max_points) -> None:
    try:
        xyz = pointcloud2_to_xyz(msg)
    except ConversionError as exc:
        assert exc.reason == "bad_cloud"
    else:
        assert xyz.shape == (msg.width * msg.height, 3)
    try:
        pts = cloud_xyz(msg, max_points, "lidar")
    except InputDrop as exc:
        assert exc.counter in ("dropped_bad_cloud", "dropped_too_many_points")
    else:
        assert pts.shape == (msg.width * msg.height, 3) and pts.dtype == np.float32
        assert msg.width * msg.height <= max_points


@settings(max_examples=50, deadline=None)
@given(w=st.integers(2**20, 2**32 - 1), h=st.integers(2**10, 2**32 - 1))
def test_a_huge_cloud_count_is_dropped_before_the_data_is_read(w, h) -> None:
    msg = PointCloud2(width=w, height=h, point_step=16, row_step=16 * w, data=b"")
    msg.fields = [_field(a, 4 * i, PointField.FLOAT32) for i, a in enumerate("xyz")]
    try:
        cloud_xyz(msg, 200_000, "lidar")
    except InputDrop as exc:
        assert exc.counter == "dropped_too_many_points"
    else:
        raise AssertionError("a cloud of more than lidar.max_points points was accepted")
