"""perception node over DDS: the node runs as its own process; this test publishes real
camera images, CameraInfos and PointCloud2s and checks the PerceptionResult content, the
counted drops of bad input on /diagnostics, run-time head switching and configure failures."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
from kestrel_common.base_node import SENSOR_QOS
from kestrel_common.conversions import (
    detection_arrays,
    make_camera_info,
    make_header,
    numpy_to_image,
    stamp_to_ns,
    xyz_to_pointcloud2,
)
from kestrel_interfaces.msg import PerceptionResult
from kestrel_perception.core.params import pose_to_matrix
from rcl_interfaces.msg import Parameter as ParameterMsg
from rcl_interfaces.msg import ParameterType, ParameterValue
from rcl_interfaces.srv import SetParameters
from sensor_msgs.msg import CameraInfo, Image, PointCloud2, PointField

from ros_harness import diagnostics_values

pytestmark = pytest.mark.dds

NODE = "perception"
W, H = 128, 96  # px
K = np.array([[100.0, 0.0, 64.0], [0.0, 100.0, 48.0], [0.0, 0.0, 1.0]])
CLASSES = ["background", "table", "red_cube", "green_cube", "blue_cylinder", "bin", "robot"]
# both cameras look along world +x from (0, 0, 1) and (0.5, 0, 1): optical x = -world y,
# optical y = -world z, optical z = world x  ->  quaternion (x, y, z, w) = (-.5, .5, -.5, .5)
QUAT = [-0.5, 0.5, -0.5, 0.5]
POSES = [0.0, 0.0, 1.0, *QUAT, 0.5, 0.0, 1.0, *QUAT]
WALL_X = 2.0  # m: a wall of LiDAR points at world x = 2 fills both views
# dotted names (a params file may nest them: model: {base_width: 8}, as the groups below do)
PARAMS = {
    "num_cameras": 2, "model.base_width": 8, "model.fpn_channels": 32,
    "detection": {"score_threshold": 0.0, "max_detections": 5}, "lidar.max_points": 10_000,
    "sync.slop": 0.01, "runtime.torch_threads": 1, "warmup_size": [W, H],
    "camera_poses": POSES, "output.debug_image": True, "diagnostics_period": 0.1,
    "frame_id": "world",
    # full-size float maps (defaults: 16UC1, 4)
    "output.depth_encoding": "32FC1", "output.stride": 1,
}


def wall_points() -> np.ndarray:
    ys, zs = np.meshgrid(np.arange(-1.5, 1.5, 0.04), np.arange(-0.1, 2.1, 0.04))
    return np.stack([np.full(ys.size, WALL_X), ys.ravel(), zs.ravel()], 1).astype(np.float32)


class Rig:
    """The test's publishers for 2 cameras + LiDAR, and a fresh stamp per set."""

    def __init__(self, probe) -> None:
        self.probe = probe
        self.img = [probe.publisher(Image, f"/{NODE}/input/camera_{i}/image", SENSOR_QOS)
                    for i in range(2)]
        self.info = [probe.publisher(CameraInfo, f"/{NODE}/input/camera_{i}/camera_info",
                                     SENSOR_QOS) for i in range(2)]
        self.cloud = probe.publisher(PointCloud2, f"/{NODE}/input/points", SENSOR_QOS)
        self.rng = np.random.default_rng(0)
        self.t = probe.now_ns()

    def next_stamp(self) -> int:
        self.t += 100_000_000  # 0.1 s apart: never within sync_slop of each other
        return self.t

    def image(self, cam: int, stamp: int, w: int = W, h: int = H, encoding: str = "rgb8"
              ) -> Image:
        arr = self.rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        msg = numpy_to_image(arr, "rgb8", make_header(stamp, f"cam{cam}_optical"))
        msg.encoding = encoding  # mislabelled on purpose for the bad-encoding cases
        return msg

    def publish_set(self, stamp: int, cloud: np.ndarray | None = None, image0: Image | None = None,
                    stamp1: int | None = None) -> None:
        if cloud is not None:
            self.cloud.publish(xyz_to_pointcloud2(cloud, make_header(stamp, "world")))
        for i in range(2):
            self.info[i].publish(make_camera_info(K, W, H, make_header(
                stamp if i == 0 or stamp1 is None else stamp1, f"cam{i}_optical")))
        self.img[1].publish(self.image(1, stamp if stamp1 is None else stamp1))
        self.img[0].publish(image0 if image0 is not None else self.image(0, stamp))


def result_for(results, stamp: int) -> PerceptionResult | None:
    for msg in results.snapshot():
        if stamp_to_ns(msg.header.stamp) == stamp:
            return msg
    return None


def produce(rig: Rig, results, cloud: np.ndarray | None = None, timeout: float = 20.0,
            check=lambda r: True) -> PerceptionResult:
    """Publish fresh good sets until a result for one of them satisfies `check`."""
    stamps: list[int] = []

    def done() -> bool:
        return any((r := result_for(results, s)) is not None and check(r) for s in stamps)

    def publish() -> None:
        stamps.append(rig.next_stamp())
        rig.publish_set(stamps[-1], cloud)

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not done():
        publish()
        end = time.monotonic() + 0.3
        while time.monotonic() < end and not done():
            time.sleep(0.02)
    for s in stamps:
        r = result_for(results, s)
        if r is not None and check(r):
            return r
    raise AssertionError("no matching result from the perception node")


def counter(diag, name: str, at_least: int, timeout: float = 10.0) -> int:
    msgs = diag.wait_for(lambda m: int(diagnostics_values(m, NODE).get(name, "0")) >= at_least,
                         timeout=timeout)
    return int(diagnostics_values(msgs, NODE).get(name, "0"))


def check_result_content(r: PerceptionResult, stamp: int) -> None:
    assert stamp_to_ns(r.header.stamp) == stamp and r.header.frame_id == "world"
    assert list(r.class_names) == CLASSES
    assert len(r.masks) == 2 and len(r.depths) == 2
    for i, (m, d) in enumerate(zip(r.masks, r.depths, strict=True)):
        assert (m.encoding, m.width, m.height) == ("mono8", W, H)
        assert stamp_to_ns(m.header.stamp) == stamp and m.header.frame_id == f"cam{i}_optical"
        assert int(np.frombuffer(bytes(m.data), np.uint8).max()) < len(CLASSES)
        assert (d.encoding, d.width, d.height) == ("32FC1", W, H)
        depth = np.frombuffer(bytes(d.data), np.float32)
        assert depth.size == W * H and np.isfinite(depth).all() and (depth > 0).all()
    assert [stamp_to_ns(t) for t in r.image_stamps] == [stamp, stamp]
    assert list(r.camera_frame_ids) == ["cam0_optical", "cam1_optical"]
    # score_threshold 0: max_detections (5) per camera
    d = detection_arrays(r)
    assert sorted(d["camera_index"].tolist()) == [0] * 5 + [1] * 5
    assert ((1 <= d["class_index"]) & (d["class_index"] < len(CLASSES))).all()
    assert ((0.0 <= d["score"]) & (d["score"] <= 1.0)).all()
    cx, cy, w, h = d["bbox"].T.astype(np.float64)  # px
    assert (cx - w / 2 >= -1e-3).all() and (cx + w / 2 <= W + 1e-3).all()
    assert (cy - h / 2 >= -1e-3).all() and (cy + h / 2 <= H + 1e-3).all()
    timings = {t.name: t.duration for t in r.timings}
    assert set(timings) >= {"preprocess", "model", "postprocess", "lidar_fusion", "download",
                            "unpack", "wait", "build", "input_age", "input_spread"}
    # (cloud_lag: cloud receipt - last image receipt, negative when the cloud came first)
    assert all(v >= 0 for k, v in timings.items() if k not in ("input_age", "cloud_lag"))
    assert r.latency > 0 and abs(timings.get("cloud_lag", 0.0)) < 30.0
    # input_age = node clock at receipt - header stamp: this test's stamps run 0.1 s apart
    # from its start time (they may lead the wall clock), so only a bound is checked
    assert abs(timings["input_age"]) < 30.0
    assert timings["input_spread"] < 30.0  # first -> last message of the set, s
    # latency = receipt of the set's last message -> publish: it contains the stages
    assert r.latency >= timings["wait"] + timings["build"] + timings["model"]


def sources(r: PerceptionResult) -> list[int]:
    return detection_arrays(r)["position_source"].tolist()


def check_lidar_positions(r: PerceptionResult) -> None:
    """Every detection's position lies on the wall and projects onto its box centre, taken in
    K's pixel convention (boxes are in pixel-edge coordinates: half a pixel apart)."""
    d = detection_arrays(r)
    assert (d["position_source"] == PerceptionResult.POSITION_LIDAR).all()
    for cam, p, box, var in zip(d["camera_index"], d["position"], d["bbox"],
                                d["position_variance"], strict=True):
        assert p[0] == pytest.approx(WALL_X, abs=1e-3)
        T = pose_to_matrix(POSES[7 * cam: 7 * cam + 7])
        p_cam = np.linalg.inv(T) @ np.array([*p, 1.0])
        u, v = (K @ p_cam[:3])[:2] / p_cam[2]
        assert (u, v) == pytest.approx((float(box[0]) - 0.5, float(box[1]) - 0.5), abs=1e-2)
        assert var > 0


def distorted_info(rig) -> CameraInfo:
    """Camera 1's CameraInfo with plumb_bob distortion (an unrectified camera)."""
    info = make_camera_info(K, W, H, make_header(rig.next_stamp(), "cam1_optical"))
    info.d = [-0.2, 0.05, 0.0, 0.0, 0.0]
    return info


def set_bool(probe, name: str, value: bool):
    cli = probe.node.create_client(SetParameters, f"/{NODE}/set_parameters")
    assert cli.wait_for_service(timeout_sec=10.0)
    p = ParameterMsg(name=name, value=ParameterValue(type=ParameterType.PARAMETER_BOOL,
                                                     bool_value=value))
    fut = cli.call_async(SetParameters.Request(parameters=[p]))
    deadline = time.monotonic() + 10.0
    while not fut.done() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert fut.done()
    return fut.result().results[0]


def start_node(launch_node, probe, params: dict):
    """The node as its own process, a result subscription and the input Rig, once the node's
    image and cloud subscriptions are matched. Returns (node, results, rig)."""
    node = launch_node("kestrel_perception.perception_node", NODE, params=params)
    results = probe.subscribe(PerceptionResult, f"/{NODE}/output/result", 50)
    rig = Rig(probe)
    # bounded by the node's own configure: receive.start_timeout (60 s) for its receivers
    assert probe.wait_for_subscribers(rig.img[0], timeout=90.0), node.output()
    assert probe.wait_for_subscribers(rig.cloud, timeout=10.0), node.output()
    return node, results, rig


def test_results_bad_inputs_and_runtime_heads(launch_node, probe):
    debug = probe.subscribe(Image, f"/{NODE}/output/debug_image", SENSOR_QOS)
    diag = probe.subscribe(DiagnosticArray, "/diagnostics", 50)
    node, results, rig = start_node(launch_node, probe, PARAMS)

    # 1. good input with a LiDAR cloud -> content, stamps, 3D positions from the LiDAR
    r = produce(rig, results, wall_points(), timeout=30.0,
                check=lambda r: all(s == PerceptionResult.POSITION_LIDAR for s in sources(r)))
    check_result_content(r, stamp_to_ns(r.header.stamp))
    check_lidar_positions(r)
    dbg = debug.wait_for(lambda m: len(m) > 0, timeout=10.0)
    assert dbg and (dbg[-1].encoding, dbg[-1].width, dbg[-1].height) == ("rgb8", 2 * W, H)

    # 2. without a cloud: positions from the predicted depth
    r = produce(rig, results)
    assert all(s == PerceptionResult.POSITION_PREDICTED_DEPTH for s in sources(r))

    # 3. bad inputs: each is counted on /diagnostics (republished if a best-effort sample
    #    got lost) and the node keeps producing results
    def bad(name: str, publish, period: float = 1.5) -> None:
        before = counter(diag, name, 0)
        deadline = time.monotonic() + 15.0
        while time.monotonic() < deadline:
            publish()
            if counter(diag, name, before + 1, timeout=period) > before:
                return
        raise AssertionError(f"{name} not counted\n{node.output()}")

    bad("dropped_bad_encoding", lambda: rig.img[0].publish(
        rig.image(0, rig.next_stamp(), encoding="mono16")))
    bad("dropped_bad_encoding", lambda: rig.img[0].publish(
        rig.image(0, rig.next_stamp(), encoding="32FC1")))
    bad("dropped_size_mismatch", lambda: (s := rig.next_stamp(), rig.publish_set(
        s, image0=rig.image(0, s, w=64, h=48))))
    no_x = xyz_to_pointcloud2(wall_points(), make_header(rig.next_stamp(), "world"))
    no_x.fields = [PointField(name=n, offset=4 * i, datatype=PointField.FLOAT32, count=1)
                   for i, n in enumerate(("a", "y", "z"))]
    bad("dropped_bad_cloud", lambda: rig.cloud.publish(no_x))
    all_nan = np.full((500, 3), np.nan, np.float32)
    bad("dropped_bad_cloud", lambda: rig.cloud.publish(
        xyz_to_pointcloud2(all_nan, make_header(rig.next_stamp(), "world"))))
    # an empty cloud: counted and logged, and its set still gives a result (predicted depth)
    before_empty = counter(diag, "empty_cloud", 0)
    r = produce(rig, results, np.zeros((0, 3), np.float32))
    assert all(s == PerceptionResult.POSITION_PREDICTED_DEPTH for s in sources(r))
    assert counter(diag, "empty_cloud", before_empty + 1) > before_empty, node.output()
    assert "a LiDAR cloud with 0 points" in node.output()
    # distortion coefficients: the camera is used with K alone, counted and warned about
    bad("unrectified_camera_info", lambda: rig.info[1].publish(distorted_info(rig)))
    assert "camera_info has distortion" in node.output()
    huge = np.zeros((10_001, 3), np.float32)  # > max_points
    bad("dropped_too_many_points", lambda: rig.cloud.publish(
        xyz_to_pointcloud2(huge, make_header(rig.next_stamp(), "world"))))
    # camera 1 always 50 ms after camera 0 (sync_slop 10 ms): no set can form; the images are
    # counted as out_of_sync when they leave the fixed-size history (8 per camera)
    bad("out_of_sync", lambda: (s := rig.next_stamp(), rig.publish_set(s, stamp1=s + 50_000_000)),
        period=0.1)
    r = produce(rig, results)
    check_result_content(r, stamp_to_ns(r.header.stamp))
    # every published result was counted (results are reliable: all of them arrive)
    diag.wait_for(lambda m: int(diagnostics_values(m, NODE).get("processed", "-1"))
                  == len(results.snapshot()), timeout=10.0)
    processed = int(diagnostics_values(diag.snapshot(), NODE)["processed"])
    assert processed == len(results.snapshot()) and processed >= 3
    values = diagnostics_values(diag.snapshot(), NODE)
    assert float(values["latency_model_p50_s"]) > 0.0
    assert float(values["latency_total_p99_s"]) >= float(values["latency_total_p50_s"])
    assert "dropped input (dropped_bad_encoding" in node.output()

    # 4. heads switch at run time (same process, same weights)
    assert set_bool(probe, "enable_segmentation", False).successful
    r = produce(rig, results, check=lambda r: len(r.masks) == 0)
    assert len(r.depths) == 2 and len(r.score) == 10
    assert set_bool(probe, "enable_detection", False).successful
    refused = set_bool(probe, "enable_depth", False)  # would leave no head
    assert not refused.successful and "at least one head" in refused.reason
    r = produce(rig, results, check=lambda r: len(r.score) == 0)
    assert len(r.masks) == 0 and len(r.depths) == 2
    assert node.alive() and "Traceback" not in node.output()


@pytest.mark.parametrize("processing", ["callback", "worker"])
def test_depth_16uc1_strided_output(launch_node, probe, processing):
    """The node's defaults: 16UC1 depth (mm, 0 = none) and masks/depths at stride 4, with
    the same detections and LiDAR positions; sets processed in the completing subscription
    callback (default) or in the worker thread."""
    params = {k: v for k, v in PARAMS.items()
              if k not in ("output.depth_encoding", "output.stride")}
    node, results, rig = start_node(launch_node, probe, {**params, "output.debug_image": False,
                                                         "processing": processing})
    r = produce(rig, results, wall_points(), timeout=30.0,
                check=lambda r: len(r.score) == 10 and all(
                    s == PerceptionResult.POSITION_LIDAR for s in sources(r)))
    check_lidar_positions(r)
    hs, ws = -(-H // 4), -(-W // 4)
    assert len(r.masks) == 2 and len(r.depths) == 2
    for m, d in zip(r.masks, r.depths, strict=True):
        assert (m.encoding, m.width, m.height, m.step) == ("mono8", ws, hs, ws)
        assert int(np.frombuffer(bytes(m.data), np.uint8).max()) < len(CLASSES)
        assert (d.encoding, d.width, d.height, d.step) == ("16UC1", ws, hs, 2 * ws)
        mm = np.frombuffer(bytes(d.data), np.uint16)
        # the depth head is bounded by max_depth (20 m): every pixel has a value in mm
        assert mm.size == ws * hs and (mm > 0).all() and (mm <= 20_000).all()
    check_result_content_timings(r)
    assert "results published as CDR bytes" in node.output()  # result_cdr.py, checked at configure
    assert f"processing in the {processing}, GIL switch interval 200 us" in node.output(), \
        node.output()
    assert node.alive() and "Traceback" not in node.output()


def check_result_content_timings(r: PerceptionResult) -> None:
    timings = {t.name: t.duration for t in r.timings}
    assert {"wait", "build", "preprocess", "model"} <= set(timings)
    assert r.latency >= timings["wait"] + timings["build"] + timings["model"]


def _user_model(path) -> str:
    """A user's TorchScript model: per camera one 'red_cube' box over the image centre."""
    import torch

    class UserModel(torch.nn.Module):
        def forward(self, images: torch.Tensor):
            b = images.shape[0]
            z = images.float().mean() * 0
            boxes = torch.tensor([[[44.0, 28.0, 84.0, 68.0]]]).expand(b, 1, 4) + z
            return boxes, torch.full((b, 1), 0.9) + z, torch.full((b, 1), 2, dtype=torch.long)

    torch.jit.save(torch.jit.trace(UserModel(), torch.zeros((2, 3, H, W), dtype=torch.uint8)),
                   str(path))
    return str(path)


def test_user_model_through_the_node(launch_node, probe, run_dir):
    """model_path + model_outputs: the node runs a user's TorchScript model (detections only),
    fuses LiDAR into its boxes and publishes them like the reference model's."""
    params = {**PARAMS, "output.debug_image": False,
              "model.path": _user_model(run_dir / "user_model.pt"),
              "model.outputs": ["boxes:output0", "scores:output1", "labels:output2"]}
    node, results, rig = start_node(launch_node, probe, params)
    # a set whose cloud missed the sync window has no positions (no depth head): wait for one
    # with LiDAR positions
    r = produce(rig, results, wall_points(), timeout=30.0,
                check=lambda r: len(r.score) == 2 and all(
                    s == PerceptionResult.POSITION_LIDAR for s in sources(r)))
    d = detection_arrays(r)
    assert [CLASSES[k] for k in d["class_index"]] == ["red_cube"] * 2
    np.testing.assert_allclose(d["score"], 0.9, atol=1e-6)
    np.testing.assert_allclose(d["bbox"][:, :2], [[64.0, 48.0]] * 2)
    check_lidar_positions(r)
    assert len(r.masks) == 0 and len(r.depths) == 0  # no seg/depth in this contract
    # switching off the model's only head is refused (it would leave every frame nothing
    # to compute), naming the parameter that keeps it running
    res = set_bool(probe, "enable_detection", False)
    assert not res.successful and "'enable_detection'" in res.reason, res.reason
    r = produce(rig, results, wall_points(), timeout=30.0, check=lambda r: len(r.score) == 2)
    assert node.alive() and "Traceback" not in node.output()


@pytest.mark.parametrize("params,fragment", [
    ({"output": {"depth_encoding": "16UC2"}}, "parameter 'output.depth_encoding' = '16UC2'"),
    ({"output.stride": 3}, "parameter 'output.stride' = 3"),
    ({"detection": {"score_threshold": 1.5}},
     "parameter 'detection.score_threshold' = 1.5: must be <= 1.0"),
    ({"model": {"backbone_depth": 101}}, "parameter 'model.backbone_depth' = 101"),
    ({"num_cameras": 2, "camera_poses": [0.0] * 7}, "parameter 'camera_poses'"),
    ({"model": {"path": "/nonexistent/user.onnx", "outputs": ["seg:logits"]}},
     "parameter 'model.path' = '/nonexistent/user.onnx': file not found"),
    ({"model.path": "/nonexistent/user.onnx", "model.outputs": ["boxes:b"]},
     "parameter 'model.outputs'"),
    ({"runtime": {"engine": "tensorrt"}},
     "parameter 'runtime.engine' = 'tensorrt': TensorRT runs on CUDA: needs device 'cuda'"),
    ({"runtime": {"cuda_graph": True}},
     "parameter 'runtime.cuda_graph' = True: CUDA graphs need device 'cuda'"),
    ({"runtime": {"precision": "fp64"}}, "parameter 'runtime.precision' = 'fp64': must be one"),
    ({"runtime": {"precison": "bf16"}}, "parameter 'runtime.precison' = 'bf16': not a "
     "parameter of this node; did you mean 'runtime.precision'"),
    ({"runtime_variant": "eager_fp32"}, "parameter 'runtime_variant' = 'eager_fp32': not a "
     "parameter of this node"),
    ({"lidar.point_buckets": [4096, 1024]}, "parameter 'lidar.point_buckets'"),
])
def test_bad_parameter_fails_configure(launch_node, params, fragment):
    node = launch_node("kestrel_perception.perception_node", NODE,
                       params={"runtime.torch_threads": 1, **params})
    assert node.wait_for_output("autostart: configure failed", timeout=30.0), node.output()
    assert fragment in node.output()
    assert node.proc.wait(10) == 2
    assert "Traceback" not in node.output()


def test_set_waits_for_a_late_cloud_and_goes_without_a_silent_lidar(launch_node, probe):
    """cloud_required (default): a set whose cloud comes after its images waits for it and
    gets LiDAR positions; once the LiDAR falls silent, a set goes out without a cloud after
    the live window (released by the node's timer: no further message is sent), counted as
    missing_cloud."""
    diag = probe.subscribe(DiagnosticArray, "/diagnostics", 50)
    node, results, rig = start_node(launch_node, probe, {**PARAMS, "sync.cloud_timeout": 3.0,
                                                         "output.debug_image": False})
    produce(rig, results, wall_points(), timeout=30.0,
            check=lambda r: all(s == PerceptionResult.POSITION_LIDAR for s in sources(r)))
    missing = counter(diag, "missing_cloud", 0)
    late = rig.next_stamp()
    rig.publish_set(late)  # images and infos first ...
    cloud = xyz_to_pointcloud2(wall_points(), make_header(late, "world"))
    rig.cloud.publish(cloud)  # ... then its cloud (within the live window)
    r = results.wait_for(lambda m: result_for(results, late) is not None, timeout=15.0)
    assert r, node.output()
    check_lidar_positions(result_for(results, late))  # it waited for the cloud
    silent = rig.next_stamp()
    rig.publish_set(silent)  # no cloud ever again: released after the live window
    assert results.wait_for(lambda m: result_for(results, silent) is not None,
                            timeout=15.0), node.output()
    assert all(s != PerceptionResult.POSITION_LIDAR for s in sources(result_for(results,
                                                                              silent)))
    assert counter(diag, "missing_cloud", missing + 1) >= missing + 1
    assert node.alive() and "Traceback" not in node.output()


def test_receiver_processes(launch_node, probe):
    """receive: processes: one receiver process per image topic and one for the cloud take
    the inputs off DDS and hand them over in shared memory; results, LiDAR positions and the
    counted drops are those of the in-node subscriptions; the processes and the segment are
    gone after the node."""
    import glob

    diag = probe.subscribe(DiagnosticArray, "/diagnostics", 50)
    mine = sorted(os.sched_getaffinity(0))
    rx_cpus = [mine[-1], mine[0]]  # receiver i on rx_cpus[i % 2]: cameras 0, 1, the cloud
    node, results, rig = start_node(launch_node, probe, {**PARAMS,
                                                         "receive.mode": "processes",
                                                         "output.debug_image": False,
                                                         "receive.cpus": rx_cpus})
    r = produce(rig, results, wall_points(), timeout=30.0,
                check=lambda r: all(s == PerceptionResult.POSITION_LIDAR for s in sources(r)))
    check_result_content(r, stamp_to_ns(r.header.stamp))
    check_lidar_positions(r)
    assert "input receivers started: ['/perception/input/camera_0/image', " \
           "'/perception/input/camera_1/image', '/perception/input/points', " \
           "'/perception/input/camera_0/camera_info', '/perception/input/camera_1/camera_info'" \
           in node.output()  # the camera receivers take the CameraInfo topics too

    def bad(name: str, publish) -> None:
        before = counter(diag, name, 0)
        deadline = time.monotonic() + 15.0
        while time.monotonic() < deadline:
            publish()
            if counter(diag, name, before + 1, timeout=1.5) > before:
                return
        raise AssertionError(f"{name} not counted\n{node.output()}")

    bad("dropped_bad_encoding", lambda: rig.img[0].publish(
        rig.image(0, rig.next_stamp(), encoding="mono16")))
    bad("dropped_size_mismatch", lambda: rig.img[1].publish(  # wider than warmup_size (as
        rig.image(1, rig.next_stamp(), w=2 * W, h=H // 2)))  # many bytes: by dimensions)
    bad("dropped_too_many_points", lambda: rig.cloud.publish(xyz_to_pointcloud2(
        np.zeros((10_001, 3), np.float32), make_header(rig.next_stamp(), "world"))))
    bad("dropped_bad_camera_info", lambda: rig.info[1].publish(make_camera_info(  # K unset
        np.zeros((3, 3)), W, H, make_header(rig.next_stamp(), "cam1_optical"))))
    bad("unrectified_camera_info", lambda: rig.info[1].publish(distorted_info(rig)))
    assert "camera_info has distortion" in node.output()  # the receiver's log line
    r = produce(rig, results)
    check_result_content(r, stamp_to_ns(r.header.stamp))
    values = diagnostics_values(diag.snapshot(), NODE)
    assert int(values["rx_received"]) >= 6 and "rx_overwritten" in values
    assert int(values["rx_handler_errors"]) == 0
    # the receivers' ring slots are registered with the staging: inputs go straight to their
    # device slot (no host copy in the node)
    assert int(values["prestaged_direct"]) > 0, values
    assert "camera 0: dropped (dropped_bad_encoding)" in node.output()
    assert node.alive() and "Traceback" not in node.output()
    pid = node.proc.pid
    # a receiver that exits is reported (ERROR on /diagnostics), the node stays up. SIGTERM,
    # not SIGKILL: a killed DDS participant leaves its shared-memory files (dds_guard)
    children = open(f"/proc/{pid}/task/{pid}/children").read().split()
    assert len(children) == 3, children  # 2 cameras + the cloud
    # receiver_cpus: every thread of each receiver (its DDS threads too) on its one CPU
    def cpus_of(child: str) -> set[int]:
        out = set()
        for tid in os.listdir(f"/proc/{child}/task"):
            try:
                out |= os.sched_getaffinity(int(tid))
            except ProcessLookupError:
                pass  # a thread that ended meanwhile
        return out

    pinned = [cpus_of(child) for child in children]
    assert sorted(map(sorted, pinned)) == sorted([[rx_cpus[0]], [rx_cpus[1]], [rx_cpus[0]]])
    assert f"on CPUs {[rx_cpus[0], rx_cpus[1], rx_cpus[0]]}" in node.output()
    os.kill(int(children[-1]), signal.SIGTERM)
    msgs = diag.wait_for(lambda m: any(s.level == DiagnosticStatus.ERROR and "input receiver "
                                       "process exited for ['/perception/input/"
                                       in s.message for a in m for s in a.status), timeout=10.0)
    assert any(s.level == DiagnosticStatus.ERROR for a in msgs for s in a.status)
    assert node.alive()
    assert glob.glob(f"/dev/shm/kestrel_perception_{pid}_*")
    node.stop()
    # the node waits for its receivers (bounded); if it was killed instead, they exit and
    # unlink the segment themselves once they see it gone: bounded waits, not a fixed sleep
    deadline = time.monotonic() + 15.0
    while time.monotonic() < deadline and (
            not node.group_gone() or glob.glob(f"/dev/shm/kestrel_perception_{pid}_*")):
        time.sleep(0.1)  # polling the condition, bounded by the deadline
    assert node.group_gone(), "receiver processes outlived the node"
    assert not glob.glob(f"/dev/shm/kestrel_perception_{pid}_*")
