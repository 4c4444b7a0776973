"""PerceptionCore: happy path, input errors, NaN points, LiDAR fusion, weights, timing."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from kestrel_models.perception import PerceptionConfig, PositionSource
from kestrel_perception.core import (
    STAGES,
    DEFAULT_CLASS_NAMES,
    CameraModel,
    FrameSet,
    InputError,
    PerceptionCore,
    PerceptionCoreConfig,
)

torch.set_num_threads(1)

H, W = 96, 128  # px, small for speed
K = np.array([[100.0, 0.0, 64.0], [0.0, 100.0, 48.0], [0.0, 0.0, 1.0]])


def extrinsic(tx: float) -> np.ndarray:
    """T_base_from_cam of a camera at base (tx, 0, 1) looking along base +x."""
    T = np.eye(4)
    T[:3, :3] = np.array([[0.0, 0, 1], [-1, 0, 0], [0, -1, 0]])  # columns: cam x, y, z in base
    T[:3, 3] = (tx, 0.0, 1.0)
    return T


CAMERAS = [CameraModel(K, W, H, "cam0", extrinsic(0.0)), CameraModel(K, W, H, "cam1",
                                                                         extrinsic(0.5))]


def core_config(**kw: object) -> PerceptionCoreConfig:
    model = PerceptionConfig.tiny(base_width=8, fpn_channels=32, score_threshold=0.0,
                                  max_detections=12)
    # the plain fp32 model on every device (the runtime's own tests pick other options)
    base: dict[str, object] = dict(model=model, warmup_image_hw=(H, W), warmup_cameras=2,
                                   max_points=50_000, precision="fp32", compile="off",
                                   cuda_graph=False, optimize=False)
    base.update(kw)
    return PerceptionCoreConfig(**base)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def core() -> PerceptionCore:
    return PerceptionCore(core_config())


def frames(stamp: int = 1_234_567_890, points: np.ndarray | None = None,
           images: list[np.ndarray] | None = None) -> FrameSet:
    rng = np.random.default_rng(stamp % 1000)
    imgs = images if images is not None else [
        rng.integers(0, 256, (H, W, 3), dtype=np.uint8) for _ in CAMERAS]
    return FrameSet(stamp, imgs, list(CAMERAS), points)


def wall_points(depth: float, cam_x: float = 0.0, step: float = 0.02) -> np.ndarray:
    """Points (step m apart) on the plane base x = cam_x + depth, wide enough to cover the
    whole views of both test cameras (at base x = 0 and 0.5)."""
    ys, zs = np.meshgrid(np.arange(-1.5, 1.5, step), np.arange(-0.1, 2.1, step))
    x = np.full(ys.size, cam_x + depth)
    return np.stack([x, ys.ravel(), zs.ravel()], axis=1).astype(np.float32)


def table_points(step: float = 0.04) -> np.ndarray:
    """A horizontal plane 0.4 m below the test cameras (base z = 0.6) in front of them, and
    0.3 m blocks standing on it (points on their tops and on the faces the cameras see)."""
    xs, ys = np.meshgrid(np.arange(1.0, 6.0, step), np.arange(-3.0, 3.0, step))
    parts = [np.stack([xs.ravel(), ys.ravel(), np.full(xs.size, 0.6)], axis=1)]
    a, b = np.meshgrid(np.arange(0.0, 0.3, step / 2), np.arange(0.0, 0.3, step / 2))
    a, b = a.ravel(), b.ravel()
    for x0 in (1.8, 2.6, 3.4):
        for y0 in (-1.0, -0.4, 0.2, 0.8):
            parts.append(np.stack([x0 + a, y0 + b, np.full(a.size, 0.9)], axis=1))  # top
            parts.append(np.stack([np.full(a.size, x0), y0 + a, 0.6 + b], axis=1))  # front
    return np.concatenate(parts).astype(np.float32)


# ---- happy path -----------------------------------------------------------------------------
def test_happy_path_shapes_values_and_stamp(core: PerceptionCore) -> None:
    out = core.process(frames(stamp=42_000_000_123))
    assert out.stamp_ns == 42_000_000_123
    assert len(out.masks) == 2 and len(out.depths) == 2
    for m, d in zip(out.masks, out.depths, strict=True):
        assert m.shape == (H, W) and m.dtype == np.uint8
        assert int(m.max()) < len(DEFAULT_CLASS_NAMES)
        assert d.shape == (H, W) and d.dtype == np.float32
        assert np.isfinite(d).all() and (d > 0).all()
    assert set(out.timings) == set(STAGES)
    assert all(v >= 0.0 for v in out.timings.values()) and out.timings["model"] > 0.0
    assert {d.camera_index for d in out.detections} == {0, 1}
    assert len(out.detections) == 24  # score_threshold 0: max_detections (12) per camera
    for det in out.detections:
        assert 1 <= det.class_index < len(DEFAULT_CLASS_NAMES)  # never background
        assert det.class_name == DEFAULT_CLASS_NAMES[det.class_index]
        x1, y1, x2, y2 = det.box_xyxy
        assert 0 <= x1 < x2 <= W and 0 <= y1 < y2 <= H
        assert 0.0 <= det.score <= 1.0
        # no cloud: positions come from the predicted depth (always positive)
        assert det.position_source == PositionSource.PREDICTED_DEPTH
        assert det.position is not None and np.isfinite(det.position).all()


def test_deterministic_seeded_init() -> None:
    a = PerceptionCore(core_config(warmup_image_hw=None))
    b = PerceptionCore(core_config(warmup_image_hw=None))
    c = PerceptionCore(core_config(warmup_image_hw=None, seed=1))
    f = frames()
    oa, ob, oc = a.process(f), b.process(f), c.process(f)
    np.testing.assert_array_equal(oa.depths[0], ob.depths[0])
    assert not np.array_equal(oa.depths[0], oc.depths[0])


def test_runtime_head_subset(core: PerceptionCore) -> None:
    out = core.process(frames(), heads=frozenset({"detection"}))
    assert out.masks == [] and out.depths == [] and len(out.detections) == 24
    # neither a cloud nor a depth map: no position
    assert all(d.position is None and d.position_source == PositionSource.NONE
               for d in out.detections)


def test_bgr_view_and_non_contiguous_images_are_copied(core: PerceptionCore) -> None:
    f = frames()
    flipped = [np.ascontiguousarray(img[..., ::-1]) for img in f.images]
    views = [img[..., ::-1] for img in f.images]  # strided views
    a = core.process(frames(images=flipped))
    b = core.process(frames(images=views))
    np.testing.assert_array_equal(a.depths[1], b.depths[1])


# ---- input errors ---------------------------------------------------------------------------
def _img(h: int = H, w: int = W, c: int = 3, dtype: type = np.uint8) -> np.ndarray:
    return np.zeros((h, w, c), dtype=dtype) if c else np.zeros((h, w), dtype=dtype)


@pytest.mark.parametrize("images,code", [
    ([_img(), _img(h=H + 2)], "size_mismatch"),
    ([_img(), _img(c=0)], "bad_image"),
    ([_img(c=4), _img()], "bad_image"),
    ([_img(), _img(dtype=np.float32)], "bad_image"),
    ([_img()], "no_images"),
])
def test_bad_images_raise_input_error(core: PerceptionCore, images: list, code: str) -> None:
    with pytest.raises(InputError) as err:
        core.process(frames(images=images))
    assert err.value.reason_code == code
    assert "camera" in err.value.message or code == "no_images"


def test_size_mismatch_names_both_sizes(core: PerceptionCore) -> None:
    with pytest.raises(InputError) as err:
        core.process(frames(images=[_img(), _img(h=50, w=60)]))
    assert err.value.reason_code == "size_mismatch"
    assert "60x50" in err.value.message and f"{W}x{H}" in err.value.message


def test_mixed_sizes_and_bad_camera(core: PerceptionCore) -> None:
    small = CameraModel(K, 64, 48, "small", extrinsic(0.0))
    f = FrameSet(1, [_img(), _img(48, 64)], [CAMERAS[0], small])
    with pytest.raises(InputError) as err:
        core.process(f)
    assert err.value.reason_code == "mixed_sizes"
    zero_k = CameraModel(np.zeros((3, 3)), W, H, "uncalibrated")
    with pytest.raises(InputError) as err:
        core.process(FrameSet(1, [_img(), _img()], [CAMERAS[0], zero_k]))
    assert err.value.reason_code == "bad_camera" and "uncalibrated" in err.value.message


def test_point_errors(core: PerceptionCore) -> None:
    with pytest.raises(InputError) as err:
        core.process(frames(points=np.zeros((50_001, 3), np.float32)))
    assert err.value.reason_code == "too_many_points" and "50001" in err.value.message
    with pytest.raises(InputError) as err:
        core.process(frames(points=np.zeros((10, 2), np.float32)))
    assert err.value.reason_code == "bad_points"
    # the core keeps working after errors
    assert len(core.process(frames()).detections) == 24


# ---- points ---------------------------------------------------------------------------------
def test_nan_points_filtered_and_counted(core: PerceptionCore) -> None:
    pts = wall_points(2.0)
    n = pts.shape[0]
    pts[:7, 1] = np.nan
    pts[7, 2] = np.inf
    out = core.process(frames(points=pts))
    assert out.dropped_points == 8
    assert out.used_points == n - 8 and out.truncated_points == 0
    all_nan = np.full((100, 3), np.nan, np.float32)
    out = core.process(frames(points=all_nan))
    assert out.dropped_points == 100 and out.used_points == 0
    assert all(d.position_source == PositionSource.PREDICTED_DEPTH for d in out.detections)


def test_empty_cloud_uses_predicted_depth(core: PerceptionCore) -> None:
    out = core.process(frames(points=np.zeros((0, 3), np.float32)))
    assert out.dropped_points == 0 and out.used_points == 0
    assert all(d.position_source == PositionSource.PREDICTED_DEPTH for d in out.detections)


def test_positions_from_lidar(core: PerceptionCore) -> None:
    # a wall 2 m in front of camera 0 (base x = 2), i.e. 1.5 m in front of camera 1
    out = core.process(frames(points=wall_points(2.0)))
    assert len(out.detections) == 24
    for det in out.detections:
        assert det.position_source == PositionSource.LIDAR
        assert det.position is not None
        # every point of the wall has base x = 2; the box centre lies on it
        np.testing.assert_allclose(det.position[0], 2.0, atol=1e-4)
        cam = CAMERAS[det.camera_index]
        p_cam = np.linalg.inv(cam.T_base_from_cam) @ np.append(det.position, 1.0)
        uvw = K @ p_cam[:3]
        centre = ((det.box_xyxy[0] + det.box_xyxy[2]) / 2, (det.box_xyxy[1] + det.box_xyxy[3]) / 2)
        # boxes are in pixel-edge coordinates, K puts the top-left pixel's centre at (0, 0):
        # the box centre is half a pixel right of and below its projection
        np.testing.assert_allclose(uvw[:2] / uvw[2], np.subtract(centre, 0.5), atol=1e-3)


# ---- config / weights -----------------------------------------------------------------------
def test_config_errors_name_parameter() -> None:
    with pytest.raises(ValueError, match="'model.class_names'"):
        core_config(class_names=("background", "cube"))
    with pytest.raises(ValueError, match="'runtime.device' = 'tpu'"):
        core_config(device="tpu")
    with pytest.raises(ValueError, match=r"'lidar.support_classes' = \['shelf'\]"):
        core_config(support_classes=("shelf",))
    with pytest.raises(ValueError, match="'lidar.support_tolerance' = 2.0"):
        core_config(support_tolerance=2.0)
    with pytest.raises(ValueError, match="'model.weights_path' = '/nonexistent.pt'"):
        core_config(weights_path="/nonexistent.pt")


def test_weights_path_round_trip(core: PerceptionCore, tmp_path) -> None:
    path = tmp_path / "w.pt"
    torch.save(core.model.state_dict(), path)
    other = PerceptionCore(core_config(weights_path=str(path), seed=7, warmup_image_hw=None))
    f = frames()
    np.testing.assert_array_equal(other.process(f).masks[0], core.process(f).masks[0])
    bad = tmp_path / "bad.pt"
    torch.save({"nope": torch.zeros(1)}, bad)
    with pytest.raises(ValueError, match="'model.weights_path'.*cannot load"):
        PerceptionCore(core_config(weights_path=str(bad), warmup_image_hw=None))


# ---- synchroniser (pure Python) ---------------------------------------------------------------
def _sync(n: int = 2, slop: float = 0.01, history: int = 4):
    from kestrel_perception.core.sync import FrameSynchronizer

    counts: dict[str, int] = {}

    def count(name: str, k: int) -> None:
        counts[name] = counts.get(name, 0) + k

    return FrameSynchronizer(n, slop, history, count=count), counts


def _st(stamp_ms: int, data: object = None):
    from kestrel_perception.core.sync import Stamped

    return Stamped(stamp_ms * 1_000_000, stamp_ms / 1000.0, data)


def test_sync_takes_newest_complete_set_and_counts_skipped() -> None:
    sync, counts = _sync()
    for t in (100, 200, 300):
        for c in range(2):
            sync.add_info(c, _st(t))
            sync.add_image(c, _st(t + 3 * c, f"img{c}@{t + 3 * c}"))  # camera 1: +3 ms, in slop
    sync.add_cloud(_st(295, "cloud295"))
    sync.add_cloud(_st(250, "cloud250"))
    s = sync.pop_newest_set()
    assert s is not None and s.stamp_ns == 300_000_000
    assert [i.data for i in s.images] == ["img0@300", "img1@303"]
    assert s.cloud is not None and s.cloud.data == "cloud295"
    assert s.newest_recv_s == pytest.approx(0.303)
    assert s.oldest_recv_s == pytest.approx(0.295)  # the cloud (receipt = stamp here)
    assert counts == {"skipped_stale": 4}  # the sets at 100 and 200 were complete, skipped
    assert sync.pop_newest_set() is None  # consumed
    sync.add_image(0, _st(250))  # older than the set just processed
    assert counts["skipped_stale"] == 5


def test_sync_out_of_sync_and_bounded_history() -> None:
    sync, counts = _sync(history=4)
    for t in range(0, 1000, 100):  # 10 images per camera, camera 1 always 50 ms late
        for c in range(2):
            sync.add_info(c, _st(t + 50 * c))
            sync.add_image(c, _st(t + 50 * c))
        assert sync.pop_newest_set() is None
    assert counts == {"out_of_sync": 12}  # 6 evicted per camera, the history stays at 4
    assert all(len(q) == 4 for q in sync._images)
    sync.add_info(1, _st(900))
    sync.add_image(1, _st(905))  # now camera 0's 900 has a partner: a set, no cloud
    s = sync.pop_newest_set()
    assert s is not None and s.stamp_ns == 900_000_000 and s.cloud is None
    # camera 0: 600, 700, 800 had no partner; camera 1: 650..950 (950 is newer, stays)
    assert counts["out_of_sync"] == 12 + 3 + 3


def test_sync_waits_for_the_cloud_while_the_lidar_is_live() -> None:
    """cloud_required: complete images do not make a set while a live LiDAR's cloud for them is
    still on the way (it arrives after the images); a silent LiDAR (no cloud for
    cloud_timeout) or cloud_required False lets sets go without one, counted missing_cloud."""
    from kestrel_perception.core.sync import FrameSynchronizer, Stamped

    now = [0.0]
    counts: dict[str, int] = {}
    sync = FrameSynchronizer(2, 0.01, 4, count=lambda k, n: counts.__setitem__(
        k, counts.get(k, 0) + n), cloud_timeout_s=0.5, clock=lambda: now[0])

    def images(t: int) -> None:
        for c in range(2):
            sync.add_info(c, _st(t))
            sync.add_image(c, _st(t))

    images(100)
    now[0] = 0.1
    s = sync.pop_newest_set()  # no cloud ever: the LiDAR is not live, no waiting
    assert s is not None and s.cloud is None and counts == {"missing_cloud": 1}
    sync.add_cloud(_st(195, "c195"))  # the LiDAR is live from now on (receipt 0.195)
    images(300)
    now[0] = 0.30
    assert sync.pop_newest_set() is None  # 300's cloud is on the way: wait
    sync.add_cloud(_st(301, "c301"))
    s = sync.pop_newest_set()
    assert s is not None and s.stamp_ns == 300_000_000 and s.cloud.data == "c301"
    assert s.newest_recv_s == pytest.approx(0.301)  # the cloud completed the set
    images(400)  # its cloud is lost; 500 comes with its cloud: 400 is skipped, not waited on
    now[0] = 0.45
    assert sync.pop_newest_set() is None
    images(500)
    sync.add_cloud(_st(502, "c502"))
    s = sync.pop_newest_set()
    assert s.stamp_ns == 500_000_000 and s.cloud.data == "c502"
    # 400 left without its cloud: camera 0's image says why (one count per set)
    assert counts == {"missing_cloud": 1, "skipped_stale": 1, "cloud_out_of_sync": 1}
    images(600)  # the LiDAR fell silent: 0.502 + 0.5 s later the sets go without it
    now[0] = 0.95
    assert sync.pop_newest_set() is None
    now[0] = 1.01
    s = sync.pop_newest_set()
    assert s.stamp_ns == 600_000_000 and s.cloud is None and counts["missing_cloud"] == 2
    # a 1 Hz LiDAR: the live window follows its period (1.5 x 1 s), not the 0.5 s timeout
    slow = FrameSynchronizer(1, 0.01, 4, cloud_timeout_s=0.5, clock=lambda: now[0])
    for k in range(3):
        slow.add_cloud(_st(1000 * k))  # receipt k s
    now[0] = 2.0 + 1.2
    assert slow.live_window_s() == pytest.approx(1.5) and slow.lidar_live()
    now[0] = 2.0 + 1.6
    assert not slow.lidar_live()
    # LiDAR stamps 50 ms after the cameras' (beyond slop): a set stops waiting once a cloud
    # stamped after it + slop has arrived (clouds come in stamp order), and goes without
    off: dict[str, int] = {}
    skew = FrameSynchronizer(1, 0.01, 2, count=lambda k, n: off.__setitem__(
        k, off.get(k, 0) + n), clock=lambda: now[0])
    for k in range(5):
        now[0] = 10.0 + 0.1 * k
        skew.add_image(0, Stamped(k * 100_000_000, now[0], None))
        skew.add_info(0, Stamped(k * 100_000_000, now[0], None))
        if k:  # the previous cloud (stamp 50 ms before this set) is not beyond it: wait
            assert skew.pop_newest_set() is None
        skew.add_cloud(Stamped(k * 100_000_000 + 50_000_000, now[0], None))
        s = skew.pop_newest_set()
        assert s is not None and s.cloud is None
    assert off == {"missing_cloud": 5}
    lax = FrameSynchronizer(1, 0.01, 4, cloud_required=False, clock=lambda: 0.0)
    lax.add_cloud(_st(0, "c0"))  # live, but not required
    lax.add_info(0, _st(700))
    lax.add_image(0, _st(700))
    assert lax.pop_newest_set().cloud is None


def test_sync_clear_forgets_the_lidar_too() -> None:
    """Reactivation after a bag loop / sim restart: stamps start over. clear() must forget the
    previous run's newest cloud stamp, or every new set counts as missing its cloud (the
    "newer cloud already here" shortcut) instead of waiting for it."""
    from kestrel_perception.core.sync import FrameSynchronizer, Stamped

    now = [0.0]
    counts: dict[str, int] = {}
    sync = FrameSynchronizer(1, 0.01, 4, count=lambda k, n: counts.__setitem__(
        k, counts.get(k, 0) + n), clock=lambda: now[0])

    def msg(stamp_ms: int, data: object = None) -> Stamped:  # received now
        return Stamped(stamp_ms * 1_000_000, now[0], data)

    for t in (9_900, 10_000):  # the first run, ending at stamp 10 s
        now[0] = t / 1000
        sync.add_info(0, msg(t))
        sync.add_image(0, msg(t))
        sync.add_cloud(msg(t + 1, f"c{t}"))
        assert sync.pop_newest_set().cloud is not None
    sync.clear()
    now[0] = 20.0  # the restarted run: stamps from 0 again, receipts go on
    sync.add_cloud(msg(50, "c50"))  # the LiDAR is live again
    now[0] = 20.05
    sync.add_info(0, msg(100))
    sync.add_image(0, msg(100))
    assert sync.pop_newest_set() is None  # 100's cloud is on the way: wait for it
    sync.add_cloud(msg(101, "c101"))
    s = sync.pop_newest_set()
    assert s is not None and s.cloud.data == "c101" and "missing_cloud" not in counts, counts


def test_sync_needs_camera_info_within_slop() -> None:
    sync, counts = _sync(n=1)
    sync.add_image(0, _st(100))
    sync.add_info(0, _st(150))
    assert sync.pop_newest_set() is None
    sync.add_info(0, _st(105))
    s = sync.pop_newest_set()
    assert s is not None and s.infos[0].stamp_ns == 105_000_000


# ---- node parameters (pure Python) ------------------------------------------------------------
def test_param_cross_checks_and_core_config() -> None:
    from kestrel_common.params import ParamError, validate_params
    from kestrel_perception.core.params import SPECS, core_config, validate_perception_params

    values = validate_params(SPECS, {"num_cameras": 2, "detection": {"score_threshold": 0.4}})
    validate_perception_params(values)
    cfg = core_config(values)
    assert cfg.model.heads == frozenset({"detection", "segmentation", "depth"})
    assert cfg.model.score_threshold == 0.4 and cfg.warmup_cameras == 2
    assert cfg.warmup_image_hw == (256, 320) and cfg.class_names == DEFAULT_CLASS_NAMES
    for bad, name in (({"camera_poses": [0.0] * 7}, "camera_poses"),
                      ({"model.class_names": ["a", "a"]}, "model.class_names"),
                      ({"enable_detection": False, "enable_segmentation": False,
                        "enable_depth": False}, "enable_detection"),
                      ({"receive.cpus": [0, os.cpu_count()]},
                       "receive.cpus"),
                      ({"lidar.support_classes": ["table", "shelf"]}, "lidar.support_classes")):
        with pytest.raises(ParamError, match=f"parameter '{name}'"):
            validate_perception_params({**values, **bad})
    with pytest.raises(ParamError, match="parameter 'model.backbone_depth' = 101"):
        validate_params(SPECS, {"model": {"backbone_depth": 101}})
    # lidar.point_buckets: the node's static cloud sizes, validated and passed to the core
    assert core_config(validate_params(SPECS, {"lidar.point_buckets": [1000, 250000]})
                       ).point_buckets == (1000, 250000)
    for bad in ([], [4096, 1024], [1024, 1024], [0, 8]):
        with pytest.raises(ParamError, match="parameter 'lidar.point_buckets'"):
            validate_params(SPECS, {"lidar.point_buckets": bad})
    # the support rule: on the table by default, off with []
    assert (cfg.support_classes, cfg.support_tolerance) == (("table",), 0.01)
    off = core_config(validate_params(SPECS, {"lidar": {"support_classes": [],
                                                        "support_tolerance": 0.03}}))
    assert (off.support_classes, off.support_tolerance) == ((), 0.03)
    with pytest.raises(ParamError, match="parameter 'lidar.support_tolerance'"):
        validate_params(SPECS, {"lidar.support_tolerance": -0.01})


def test_pose_to_matrix() -> None:
    from kestrel_perception.core.params import pose_to_matrix

    T = pose_to_matrix([1.0, 2.0, 3.0, -0.5, 0.5, -0.5, 0.5])
    np.testing.assert_allclose(T[:3, :3], extrinsic(0.0)[:3, :3], atol=1e-12)
    np.testing.assert_allclose(T[:3, 3], [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="non-zero quaternion"):
        pose_to_matrix([0.0] * 7)


def test_debug_render_draws_box_outlines() -> None:
    from kestrel_perception.core.draw import PALETTE, render_debug
    from kestrel_perception.core.types import Detection

    imgs = [np.zeros((20, 30, 3), np.uint8), np.zeros((20, 30, 3), np.uint8)]
    det = Detection(1, 2, "red_cube", 0.9, np.array([5.0, 4.0, 15.0, 12.0], np.float32), None)
    out = render_debug(imgs, [det], thickness=1)
    assert out.shape == (20, 60, 3)
    assert (out[4, 35:46] == PALETTE[2]).all() and (out[12, 35:46] == PALETTE[2]).all()
    assert (out[4:13, 35] == PALETTE[2]).all() and (out[4:13, 45] == PALETTE[2]).all()
    assert (out[8, 36:45] == 0).all() and (out[:, :30] == 0).all()  # inside / camera 0 clean
    assert (imgs[1] == 0).all()  # inputs untouched


def test_debug_render_blends_the_mask_at_its_stride() -> None:
    """The debug image carries the segmentation too: class colours blended over the image,
    background (0) left alone, a mask at output_stride 2 expanded back to the image size."""
    from kestrel_perception.core.draw import PALETTE, render_debug

    imgs = [np.full((20, 30, 3), 100, np.uint8), np.full((20, 30, 3), 100, np.uint8)]
    mask = np.zeros((10, 15), np.uint8)  # stride 2
    mask[2:4, 5:8] = 3  # image rows 4-7, columns 10-15 of camera 1
    out = render_debug(imgs, [], masks=[np.zeros((10, 15), np.uint8), mask])
    blended = ((1 - 0.45) * 100 + 0.45 * PALETTE[3].astype(np.float32)).astype(np.uint8)
    assert (out[4:8, 30 + 10:30 + 16] == blended).all()
    assert (out[:4, 30:] == 100).all() and (out[8:, 30:] == 100).all()
    assert (out[:, :30] == 100).all() and (imgs[1] == 100).all()  # background, inputs as is
    # a small image, where the shapes alone cannot tell the stride: the node passes it
    small = [np.full((5, 8, 3), 100, np.uint8)]
    m = np.array([[0, 1], [0, 0]], np.uint8)  # stride 4: rows 0-3, columns 4-7 are class 1
    out = render_debug(small, [], masks=[m], mask_stride=4)
    assert (out[:4, 4:8] != 100).all() and (out[4:, :] == 100).all() and (out[:, :4] == 100).all()
