"""ResultBuilder: the result message's content (detections as parallel arrays, read back with
kestrel_common.conversions.detection_arrays), and reuse of the map messages between results."""

from __future__ import annotations

import numpy as np
import pytest
from kestrel_common.conversions import ConversionError, detection_arrays
from kestrel_interfaces.msg import PerceptionResult
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
    assert list(r1.class_names) == list(CLASSES)
    assert [(t.sec, t.nanosec) for t in r1.image_stamps] == [(5, 123), (5, 456)]
    assert list(r1.camera_frame_ids) == ["cam0", "cam1"]
    d = detection_arrays(r1)
    assert d["score"].shape == (3,) and d["bbox"].shape == (3, 4) and d["position"].shape == (3, 3)
    assert d["camera_index"].tolist() == [0, 1, 1] and d["class_index"].tolist() == [1, 2, 1]
    np.testing.assert_allclose(d["score"], [0.9, 0.5, 0.25], rtol=1e-6)
    np.testing.assert_array_equal(d["bbox"][0], [20.0, 40.0, 20.0, 40.0])  # cx, cy, w, h px
    assert d["position_source"].tolist() == [PerceptionResult.POSITION_LIDAR,
                                             PerceptionResult.POSITION_PREDICTED_DEPTH,
                                             PerceptionResult.POSITION_NONE]
    np.testing.assert_array_equal(d["position"][:2], [[0.0, 0.0, 2.0], [1.0, 0.0, 4.0]])
    assert np.isnan(d["position"][2]).all() and np.isnan(d["position_variance"][2])
    assert d["position_variance"][0] == POSITION_STD_LIDAR ** 2
    rng = 4.0  # |(1,0,4) - camera 1 at (1,0,0)|
    assert np.isclose(d["position_variance"][1], (POSITION_STD_DEPTH_REL * rng) ** 2)
    assert [m.encoding for m in r1.masks] == ["mono8"] * 2 and r1.depths[0].encoding == "16UC1"
    assert r1.masks[1].header.frame_id == "cam1" and r1.masks[1].header.stamp.nanosec == 456
    assert (r1.depths[1].width, r1.depths[1].height, r1.depths[1].step) == (64, 48, 128)
    np.testing.assert_array_equal(np.frombuffer(r1.depths[1].data, np.uint16), 1001)
    assert {t.name: t.duration for t in r1.timings} == {"model": 0.01, "wait": 0.001}
    data_before = r1.masks[0].data
    # the next result reuses the map messages (published in between) and writes new values
    r2 = b.build(6_000_000_000, [6_000_000_000] * 2, cams(), output(1.0))
    assert r2.masks[0] is r1.masks[0]
    assert r2.masks[0].data is data_before  # same byte array, overwritten in place
    np.testing.assert_array_equal(np.frombuffer(r2.masks[1].data, np.uint8), 2)
    d2 = detection_arrays(r2)
    assert d2["bbox"][0, 0] == 21.0 and r2.image_stamps[1].sec == 6
    np.testing.assert_array_equal(d["bbox"][0], [20.0, 40.0, 20.0, 40.0])  # r1's kept
    r3 = b.build(7, [7, 7], cams(), output(0.0, n_maps=0))  # heads switched off
    assert len(r3.masks) == 0 and len(r3.depths) == 0


def test_no_detections_gives_empty_arrays() -> None:
    out = output(0.0)
    out.detections = []
    r = ResultBuilder("world", CLASSES).build(7, [7, 7], cams(), out)
    d = detection_arrays(r)
    assert all(v.shape[0] == 0 for v in d.values())
    assert d["bbox"].shape == (0, 4) and d["position"].shape == (0, 3)


def test_inconsistent_arrays_are_a_conversion_error() -> None:
    r = ResultBuilder("world", CLASSES).build(7, [7, 7], cams(), output(0.0))
    r.score = r.score[:2]  # 2 scores for 3 detections
    with pytest.raises(ConversionError, match="disagree on the count") as err:
        detection_arrays(r)
    assert err.value.reason == "bad_detections"


def test_arrays_and_list_give_the_same_message_and_round_trip() -> None:
    """The core's DetectionArrays (no Detection objects) and a list of Detection give the same
    result message; the list built lazily from the arrays equals the original list."""
    from kestrel_perception.core.types import DetectionArrays

    listed = output(0.0)
    arrays = DetectionArrays.from_list(listed.detections)
    assert len(arrays) == 3 and np.isnan(arrays.position[2]).all()
    from_arrays = PerceptionOutput(7, None, listed.masks, listed.depths, {"model": 0.01},
                                   depth_encoding="16UC1", output_stride=2, arrays=arrays,
                                   class_names=CLASSES)
    m_list = detection_arrays(ResultBuilder("world", CLASSES).build(1, [1, 1], cams(), listed))
    m_arr = detection_arrays(ResultBuilder("world", CLASSES).build(1, [1, 1], cams(),
                                                                   from_arrays))
    for key in m_list:
        np.testing.assert_array_equal(m_list[key], m_arr[key], err_msg=key)
    back = from_arrays.detections  # built on first read, then the same list
    assert back is from_arrays.detections
    for a, b in zip(back, listed.detections, strict=True):
        assert (a.camera_index, a.class_index, a.class_name, a.position_source) == \
            (b.camera_index, b.class_index, b.class_name, b.position_source)
        assert a.score == pytest.approx(b.score) and np.array_equal(a.box_xyxy, b.box_xyxy)
        assert (a.position is None) == (b.position is None)
        if a.position is not None:
            np.testing.assert_array_equal(a.position, b.position)


def _cdr(b: ResultBuilder, stamps: list[int], out: PerceptionOutput, timings: dict,
         latency: float):
    w = b.build_cdr(stamps[0], stamps, cams(), out)
    w.timings({**out.timings, **timings})
    w.f64(latency)
    return w


@pytest.mark.parametrize("case", ["full", "no_detections", "no_maps", "float_depth",
                                  "one_map", "unicode"])
def test_cdr_payload_equals_the_rmw_serialisation(case: str) -> None:
    """build_cdr + timings + latency is byte for byte the rmw's serialisation of build()
    (outside the padding the rmw leaves uninitialised), and deserialises to the same message."""
    from rclpy.serialization import deserialize_message, serialize_message

    out = output(0.0)
    frame = "world"
    if case == "no_detections":
        out.detections = []
    elif case == "no_maps":
        out = output(0.0, n_maps=0)
    elif case == "float_depth":
        out.depths = [np.full((5, 3), 1.5 + i, np.float32) for i in range(2)]
        out.depth_encoding = "32FC1"
    elif case == "one_map":
        out.depths = out.depths[:1]
    elif case == "unicode":
        frame = "wörld_ø"
    b = ResultBuilder(frame, CLASSES)
    stamps = [5_000_000_123, 5_000_000_456]
    msg = b.build(stamps[0], stamps, cams(), out, {"wait": 0.001})
    msg.latency = 0.0123
    w = _cdr(b, stamps, out, {"wait": 0.001}, 0.0123)
    payload = w.payload()
    assert w.same_as(bytes(serialize_message(msg)))
    back = deserialize_message(payload, PerceptionResult)
    assert back.header.frame_id == frame and back.latency == 0.0123
    assert [t.name for t in back.timings] == ["model", "wait"]
    for k, v in detection_arrays(back).items():
        np.testing.assert_array_equal(v, detection_arrays(msg)[k])
    assert [bytes(m.data) for m in back.depths] == [bytes(m.data) for m in msg.depths]
    assert [bytes(m.data) for m in back.masks] == [bytes(m.data) for m in msg.masks]


def test_cdr_check_detects_a_different_serialisation() -> None:
    """matches_rmw (the node's configure-time check) is False when the serialiser writes
    anything else, e.g. another field layout; then the node publishes message objects."""
    from rclpy.serialization import deserialize_message, serialize_message

    from kestrel_perception.result_msg import matches_rmw

    b = ResultBuilder("world", CLASSES)
    assert matches_rmw(b, serialize_message, deserialize_message)
    short = lambda m: bytes(serialize_message(m))[:-40]  # noqa: E731
    assert not matches_rmw(b, short, deserialize_message)
    flipped = lambda m: (lambda s: s[:40] + bytes([s[40] ^ 1]) + s[41:])(  # noqa: E731
        bytes(serialize_message(m)))
    assert not matches_rmw(b, flipped, deserialize_message)
    # a payload the subscribers would read differently fails the round trip
    assert not matches_rmw(b, serialize_message, lambda p, t: PerceptionResult())


def test_result_publisher_sends_the_same_result_either_way() -> None:
    """ResultPublisher (the node's publish step): CDR bytes and the message object path give
    the same message once deserialised, with the build timing and latency appended."""
    import time as _time

    from rclpy.serialization import deserialize_message, serialize_message

    from kestrel_perception.result_msg import ResultPublisher

    class Sink:
        def __init__(self) -> None:
            self.sent: list = []

        def publish(self, m) -> None:  # noqa: ANN001
            self.sent.append(m)

    got = []
    for cdr in (True, False):
        sink = Sink()
        pub = ResultPublisher(ResultBuilder("world", CLASSES), sink, cdr)
        t = _time.monotonic()
        build, latency = pub.publish(5, [5, 5], cams(), output(0.0), {"wait": 0.001}, t, t)
        assert 0 <= build <= latency
        (m,) = sink.sent
        assert isinstance(m, bytes) == cdr
        got.append(deserialize_message(m, PerceptionResult) if cdr
                   else deserialize_message(serialize_message(m), PerceptionResult))
    a, b = got
    assert [t.name for t in a.timings] == [t.name for t in b.timings] == ["model", "wait",
                                                                          "build"]
    for k, v in detection_arrays(a).items():  # NaN positions compare equal here
        np.testing.assert_array_equal(v, detection_arrays(b)[k])
    for m in (a, b):  # measured (differ), and NaN != NaN for ==
        m.timings, m.latency, m.position, m.position_variance = [], 0.0, [], []
    assert a == b
