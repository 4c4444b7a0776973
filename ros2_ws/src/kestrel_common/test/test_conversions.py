"""Message <-> numpy conversions: round trips and clear errors on bad messages."""

import numpy as np
import pytest

pytest.importorskip("sensor_msgs.msg", reason="ROS message packages not installed")

from kestrel_common.conversions import (ConversionError, camera_info_is_distorted,  # noqa: E402
                                        camera_info_to_k, image_to_numpy,
                                        make_camera_info, make_header, ns_to_stamp,
                                        numpy_to_image, pointcloud2_to_xyz, stamp_to_ns,
                                        xyz_to_pointcloud2)
from sensor_msgs.msg import PointCloud2, PointField  # noqa: E402


def test_stamp_round_trip():
    ns = 1_234_567_890_123
    assert stamp_to_ns(ns_to_stamp(ns)) == ns
    h = make_header(ns, "camera")
    assert h.frame_id == "camera" and stamp_to_ns(h.stamp) == ns


def test_rgb_bgr_mono_float_round_trip():
    rgb = np.random.default_rng(0).integers(0, 255, (4, 5, 3), dtype=np.uint8)
    msg = numpy_to_image(rgb, "rgb8", make_header(1, "c"))
    assert msg.step == 15 and len(msg.data) == 60
    np.testing.assert_array_equal(image_to_numpy(msg), rgb)
    msg.encoding = "bgr8"
    np.testing.assert_array_equal(image_to_numpy(msg), rgb[:, :, ::-1])
    depth = np.linspace(0, 3, 20, dtype=np.float32).reshape(4, 5)
    dmsg = numpy_to_image(depth, "32FC1", make_header(1, "c"))
    np.testing.assert_array_equal(image_to_numpy(dmsg, accept=("32FC1",)), depth)
    mm = (np.arange(12, dtype=np.uint16) * 1000).reshape(3, 4)  # 16UC1: depth in mm
    mmsg = numpy_to_image(mm, "16UC1", make_header(1, "c"))
    assert mmsg.step == 8
    np.testing.assert_array_equal(image_to_numpy(mmsg, accept=("16UC1",)), mm)


def test_image_padding_in_step_is_skipped():
    rgb = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3)
    msg = numpy_to_image(rgb, "rgb8", make_header(0, "c"))
    padded = bytearray()
    for r in range(2):
        padded += bytes(msg.data[r * 9:(r + 1) * 9]) + b"\0\0\0"
    msg.step, msg.data = 12, bytes(padded)
    np.testing.assert_array_equal(image_to_numpy(msg), rgb)


@pytest.mark.parametrize("mutate,reason", [
    (lambda m: setattr(m, "encoding", "mono16"), "bad_encoding"),
    (lambda m: setattr(m, "encoding", "32FC1"), "bad_encoding"),
    (lambda m: setattr(m, "data", bytes(10)), "bad_size"),
    (lambda m: setattr(m, "step", 2), "bad_size"),
    (lambda m: setattr(m, "height", 0), "bad_size"),
])
def test_bad_images_raise_with_reason(mutate, reason):
    msg = numpy_to_image(np.zeros((4, 5, 3), np.uint8), "rgb8", make_header(0, "c"))
    mutate(msg)
    with pytest.raises(ConversionError) as exc:
        image_to_numpy(msg)
    assert exc.value.reason == reason


def test_camera_info():
    k = np.array([[100.0, 0, 160], [0, 100.0, 128], [0, 0, 1]])
    msg = make_camera_info(k, 320, 256, make_header(0, "cam"))
    np.testing.assert_array_equal(camera_info_to_k(msg), k)
    assert not camera_info_is_distorted(msg)
    msg.d = [0.0, 0.0, 0.001, 0.0, 0.0]
    assert camera_info_is_distorted(msg)
    msg.k = [0.0] * 9
    with pytest.raises(ConversionError):
        camera_info_to_k(msg)


def test_pointcloud_round_trip_and_errors():
    pts = np.random.default_rng(1).normal(size=(100, 3)).astype(np.float32)
    pts[3] = np.nan
    msg = xyz_to_pointcloud2(pts, make_header(5, "world"))
    assert not msg.is_dense
    np.testing.assert_array_equal(pointcloud2_to_xyz(msg), pts)
    empty = xyz_to_pointcloud2(np.zeros((0, 3), np.float32), make_header(5, "world"))
    assert pointcloud2_to_xyz(empty).shape == (0, 3)
    no_x = PointCloud2(width=1, height=1, point_step=8, row_step=8, data=bytes(8),
                       fields=[PointField(name="y", offset=0, datatype=7, count=1),
                               PointField(name="z", offset=4, datatype=7, count=1)])
    with pytest.raises(ConversionError) as exc:
        pointcloud2_to_xyz(no_x)
    assert exc.value.reason == "bad_cloud"
    msg.data = bytes(msg.data)[:-5]
    with pytest.raises(ConversionError):
        pointcloud2_to_xyz(msg)


def test_pointcloud_with_extra_fields():
    # x, y, z, intensity + 4 pad bytes per point (like many LiDAR drivers)
    n = 7
    raw = np.zeros((n, 20), np.uint8)
    xyz = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
    raw[:, 0:12] = xyz.view(np.uint8).reshape(n, 12)
    fields = [PointField(name=a, offset=4 * i, datatype=7, count=1) for i, a in enumerate("xyz")]
    fields.append(PointField(name="intensity", offset=12, datatype=7, count=1))
    msg = PointCloud2(width=n, height=1, point_step=20, row_step=20 * n, fields=fields,
                      data=raw.tobytes())
    np.testing.assert_array_equal(pointcloud2_to_xyz(msg), xyz)
