"""ResultBuilder: the result message's content, and reuse of its objects between results."""

from __future__ import annotations

import numpy as np
from kestrel_interfaces.msg import Detection2D
from kestrel_models.perception import PositionSource
from kestrel_perception.core import CameraModel, Detection, PerceptionOutput
from kestrel_perception.result_msg import (POSITION_STD_DEPTH_REL, POSITION_STD_LIDAR,
                                           ResultBuilder)

K = np.array([[100.0, 0.0, 64.0], [0.0, 100.0, 48.0], [0.0, 0.0, 1.0]])
CLASSES = ("background", "a", "b")


def cams() -> list[CameraModel]:
    T1 = np.eye(4)
    T1[:3, 3] = (1.0, 0.0, 0.0)
    return [CameraModel(K, 128, 96, "cam0"), CameraModel(K, 128, 96, "cam1", T1)]


def output(shift: float, n_maps: int = 2) -> PerceptionOutput:
    dets = [
        Detection(0, 1, "a", 0.9, np.array([10, 20, 30, 60], np.float32) + shift,
                  np.array([0.0, 0.0, 2.0]), PositionSource.LIDAR),
        Detection(1, 2, "b", 0.5, np.array([0, 0, 8, 4], np.float32) + shift,
                  np.array([1.0, 0.0, 4.0]), PositionSource.PREDICTED_DEPTH),
        Detection(1, 1, "a", 0.25, np.array([1, 1, 2, 2], np.float32), None,
                  PositionSource.NONE),
    ]
    masks = [np.full((48, 64), i + int(shift), np.uint8) for i in range(n_maps)]
    depths = [np.full((48, 64), 1000 + i, np.uint16) for i in range(n_maps)]
    return PerceptionOutput(7, dets, masks, depths, {"model": 0.01}, depth_encoding="16UC1",
                            output_stride=2)


def test_content_and_reuse() -> None:
    b = ResultBuilder("world", CLASSES)
    r1 = b.build(5_000_000_123, [5_000_000_123, 5_000_000_456], cams(), output(0.0),
                 {"wait": 0.001})
    assert (r1.header.stamp.sec, r1.header.stamp.nanosec, r1.header.frame_id) == \
        (5, 123, "world")
    assert list(r1.class_names) == list(CLASSES) and len(r1.detections) == 3
    d0, d1, d2 = r1.detections
    assert (d0.bbox.center.x, d0.bbox.center.y, d0.bbox.size_x, d0.bbox.size_y) == \
        (20.0, 40.0, 20.0, 40.0)
    assert d1.header.frame_id == "cam1" and d1.header.stamp.nanosec == 456
    h0, h1, h2 = (d.results[0] for d in (d0, d1, d2))
    assert (h0.hypothesis.class_id, round(h0.hypothesis.score, 6)) == ("a", 0.9)
    assert (h0.pose.pose.position.z, d0.position_source) == (2.0, Detection2D.POSITION_LIDAR)
    assert h0.pose.covariance[0] == h0.pose.covariance[14] == POSITION_STD_LIDAR ** 2
    rng = 4.0  # |(1,0,4) - camera 1 at (1,0,0)|
    assert np.isclose(h1.pose.covariance[7], (POSITION_STD_DEPTH_REL * rng) ** 2)
    assert d2.position_source == Detection2D.POSITION_NONE and not any(h2.pose.covariance)
    assert (h2.pose.pose.position.x, h2.pose.pose.orientation.w) == (0.0, 1.0)
    assert [m.encoding for m in r1.masks] == ["mono8"] * 2 and r1.depths[0].encoding == "16UC1"
    assert (r1.depths[1].width, r1.depths[1].height, r1.depths[1].step) == (64, 48, 128)
    np.testing.assert_array_equal(np.frombuffer(r1.depths[1].data, np.uint16), 1001)
    assert {t.name: t.duration for t in r1.timings} == {"model": 0.01, "wait": 0.001}
    data_before = r1.masks[0].data
    # the next result reuses the messages (published in between) and writes new values
    r2 = b.build(6_000_000_000, [6_000_000_000] * 2, cams(), output(1.0))
    assert r2.detections[0] is d0 and r2.masks[0] is r1.masks[0]
    assert r2.masks[0].data is data_before  # same byte array, overwritten in place
    np.testing.assert_array_equal(np.frombuffer(r2.masks[1].data, np.uint8), 2)
    assert r2.detections[0].bbox.center.x == 21.0 and r2.detections[1].header.stamp.sec == 6
    assert len(r2.detections) == 3
    r3 = b.build(7, [7, 7], cams(), output(0.0, n_maps=0))  # heads switched off
    assert len(r3.masks) == 0 and len(r3.depths) == 0
