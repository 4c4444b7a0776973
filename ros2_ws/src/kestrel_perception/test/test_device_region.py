"""The one-sync device region of PerceptionCore: same results as the previous per-camera
path, no host reads inside the region, depth encodings and output strides."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from kestrel_models.perception import PositionSource, box_positions, decode_detections
from kestrel_perception.core import PerceptionCore
from kestrel_perception.core.device_region import PIXEL_EDGE_TO_CENTRE, DeviceRegion, encode_depth

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_perception_core import (  # noqa: E402
    CAMERAS,
    H,
    W,
    core_config,
    frames,
    table_points,
    wall_points,
)

torch.set_num_threads(1)
_CORES: dict[tuple, PerceptionCore] = {}


def cached_core(**kw: object) -> PerceptionCore:
    """One core per config in this module (construction + warm-up dominate the run time)."""
    key = tuple(sorted(kw.items()))
    if key not in _CORES:
        _CORES[key] = PerceptionCore(core_config(num_threads=1, **kw))
    return _CORES[key]


def reference(core: PerceptionCore, f) -> list[tuple]:
    """The previous path: eager forward, per-camera decode + NMS, per-camera box medians
    with the predicted-depth fallback on the host copy of the depth maps."""
    m = core.config.model
    x = torch.from_numpy(np.stack(f.images)).permute(0, 3, 1, 2)
    with torch.inference_mode():
        raw = core.model(x, core.heads)
        dets = decode_detections(raw, (H, W), m.score_threshold, m.nms_iou, m.max_detections,
                                 pre_nms_top_k=m.pre_nms_top_k, class_offset=m.det_class_offset)
        pts = torch.from_numpy(f.points) if f.points is not None else None
        out = []
        for cam, d in enumerate(dets):
            c = f.cameras[cam]
            K = torch.from_numpy(np.asarray(c.K, np.float64))
            T = torch.from_numpy(np.linalg.inv(c.T_base_from_cam))
            if pts is not None:
                from kestrel_models.perception import project_points
                uv, z, ok = project_points(pts, T[None], K[None], (H, W))
                uv, z, ok = uv[0], z[0], ok[0]
            else:
                uv, z, ok = torch.zeros(0, 2), torch.zeros(0), torch.zeros(0, dtype=torch.bool)
            rule = {} if pts is None or "seg" not in raw else dict(  # the support rule
                heights=pts[:, 2], class_map=raw["seg"][cam].argmax(0), box_class=d.classes,
                support_classes=core._support_classes,
                support_tolerance=core.config.support_tolerance)
            # the detector's pixel-edge boxes in K's pixel-centre convention, as the region
            pos, src = box_positions(d.boxes - PIXEL_EDGE_TO_CENTRE, uv, z, ok,
                                     raw["depth"][cam, 0], K, T, core.config.min_lidar_points,
                                     **rule)
            for k in range(d.boxes.shape[0]):
                out.append((cam, int(d.classes[k]), float(d.scores[k]), d.boxes[k].numpy(),
                            pos[k].numpy(), int(src[k])))
    return out


def run_with_support(core: PerceptionCore, f, support: tuple[int, ...]) -> tuple:
    """(region output, reference) with the support rule on these class indices."""
    kept, core._support_classes = core._support_classes, support
    try:
        return core.process(f), reference(core, f)
    finally:
        core._support_classes = kept


@pytest.mark.parametrize("static", [True, False])
@pytest.mark.parametrize("cloud", ["wall", "none", "sparse", "table", "table_on_background"])
def test_region_equals_previous_per_camera_path(static: bool, cloud: str) -> None:
    core = cached_core()
    core.region.static = static
    pts = {"wall": wall_points(3.0), "none": None, "sparse": wall_points(2.0, step=0.2),
           "table": table_points(), "table_on_background": table_points()}[cloud]
    f = frames(points=pts)  # sparse: 0.2 m grid, small boxes have < min_lidar_points inside
    # table_on_background: the support rule on the class the random model labels most
    # pixels with (background), so that detections of its other classes find object points
    support = (0,) if cloud == "table_on_background" else core._support_classes
    out, ref = run_with_support(core, f, support)
    assert len(out.detections) == len(ref) == 2 * 12
    for det, (cam, cls, score, box, pos, src) in zip(out.detections, ref, strict=True):
        assert (det.camera_index, det.class_index) == (cam, cls)
        assert det.score == pytest.approx(score, abs=1e-6)
        np.testing.assert_allclose(det.box_xyxy, box, atol=1e-4)
        assert int(det.position_source) == src
        if src == int(PositionSource.NONE):
            assert det.position is None
        else:
            np.testing.assert_allclose(det.position, pos, atol=1e-5)
    sources = {int(d.position_source) for d in out.detections}
    if cloud == "wall":
        assert sources == {int(PositionSource.LIDAR)}
    if cloud == "none":
        assert sources == {int(PositionSource.PREDICTED_DEPTH)}
    if cloud == "sparse":
        assert sources == {int(PositionSource.LIDAR), int(PositionSource.PREDICTED_DEPTH)}
    if cloud.startswith("table"):  # a support plane is seen: the rule decides positions
        box_rule, _ = run_with_support(core, f, ())
        changed = [(int(a.position_source), int(b.position_source)) for a, b in
                   zip(out.detections, box_rule.detections, strict=True)
                   if a.position_source != b.position_source
                   or not np.allclose(a.position, b.position)]
        assert len(changed) >= 2
        if cloud == "table_on_background":  # object centres from the LiDAR
            lidar = int(PositionSource.LIDAR)
            assert changed.count((lidar, lidar)) >= 2


@pytest.mark.slow
def test_no_host_read_inside_the_region(monkeypatch: pytest.MonkeyPatch) -> None:
    """With static shapes (the CUDA mode) nothing between the forward and the final copy
    reads a device value on the host: .item/.cpu/.tolist/.nonzero/bool()/int() raise there."""
    core = PerceptionCore(core_config(num_threads=1))
    region: DeviceRegion = core.region
    region.static = True
    f = frames(points=wall_points(3.0))
    expected = core.process(f)
    staged = {}
    real_download = DeviceRegion._download

    def guarded_download(self, raw, clock):  # the region ends here: lift the guard
        monkeypatch.undo()
        staged["called"] = True
        return real_download(self, raw, clock)

    def boom(*_a, **_k):
        raise AssertionError("host read inside the device region")

    real_run = DeviceRegion.run

    def guarded_run(self, *a, **k):
        for name in ("item", "cpu", "tolist", "nonzero", "__bool__", "__int__", "__float__",
                     "numpy"):
            monkeypatch.setattr(torch.Tensor, name, boom)
        monkeypatch.setattr(DeviceRegion, "_download", guarded_download)
        return real_run(self, *a, **k)

    monkeypatch.setattr(DeviceRegion, "run", guarded_run)
    out = core.process(f)
    assert staged.get("called")
    got = [(d.camera_index, d.class_index, d.score, int(d.position_source))
           for d in out.detections]
    assert got == [(d.camera_index, d.class_index, d.score, int(d.position_source))
                   for d in expected.detections]
    np.testing.assert_array_equal(out.depths[0], expected.depths[0])


@pytest.mark.slow
def test_16uc1_and_stride_match_the_float_full_resolution_maps() -> None:
    ref_core = cached_core()
    ref_core.region.static = False
    f = frames(points=wall_points(3.0))
    ref = ref_core.process(f)
    for stride in (2, 4, 8):
        core = PerceptionCore(core_config(num_threads=1, depth_encoding="16UC1",
                                          output_stride=stride))
        out = core.process(f)
        hs, ws = -(-H // stride), -(-W // stride)
        assert out.depth_encoding == "16UC1" and out.output_stride == stride
        for cam in range(len(CAMERAS)):
            assert out.masks[cam].shape == (hs, ws) and out.depths[cam].dtype == np.uint16
            np.testing.assert_array_equal(out.masks[cam], ref.masks[cam][::stride, ::stride])
            mm = np.round(ref.depths[cam][::stride, ::stride].astype(np.float64) * 1000)
            np.testing.assert_array_equal(out.depths[cam], mm.astype(np.uint16))
        # detections and positions do not depend on the output format
        assert [(d.score, int(d.position_source)) for d in out.detections] == \
            [(d.score, int(d.position_source)) for d in ref.detections]


def test_encode_depth_16uc1_no_value_cases() -> None:
    d = torch.tensor([0.0, -1.0, float("nan"), float("inf"), 1.2344, 65.535, 65.6])
    assert encode_depth(d, "16UC1").tolist() == [0, 0, 0, 0, 1234, 65535, 0]
    assert encode_depth(d, "32FC1") is d


@pytest.mark.parametrize("kw,fragment", [
    ({"depth_encoding": "16UC2"}, "parameter 'output.depth_encoding' = '16UC2'"),
    ({"output_stride": 3}, "parameter 'output.stride' = 3"),
    ({"nms_rounds": 0}, "parameter 'detection.nms_rounds' = 0"),
])
def test_bad_output_config_names_the_parameter(kw: dict, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(")):
        core_config(**kw)


@pytest.mark.slow
def test_long_nms_chain_takes_the_exact_slow_path() -> None:
    """nms_rounds = 1 cannot finish the suppression chains of random weights (static mode):
    the flag is set and the result is still the exact greedy NMS (= the CPU mode's)."""
    f = frames(points=wall_points(3.0))
    exact = cached_core().process(f)
    core = PerceptionCore(core_config(num_threads=1, nms_rounds=1,
                                      model=core_config().model.__class__.tiny(
                                          base_width=8, fpn_channels=32, score_threshold=0.0,
                                          max_detections=12, nms_iou=0.05)))
    core.region.static = True  # the CUDA mode: fixed rounds, no host read in the region
    ref = PerceptionCore(core_config(num_threads=1, model=core.config.model)).process(f)
    out = core.process(f)
    assert out.nms_fallback and not ref.nms_fallback
    assert [(d.score, d.class_index) for d in out.detections] == \
        [(d.score, d.class_index) for d in ref.detections]
    assert len(exact.detections) == 24


@pytest.mark.slow
def test_compiled_region_equals_the_plain_region() -> None:
    """region_compile (on by default on CUDA): the torch.compile'd element-wise steps give
    the plain static region's detections, positions and maps, for every cloud case, and the
    compilation really ran (no fallback recorded). On the CPU inductor emits C++."""
    from kestrel_models.perception import compiled as comp
    core = cached_core()
    core.region.static = True
    f_cases = [frames(points=p) for p in (wall_points(3.0), None, wall_points(2.0, step=0.2))]
    try:
        core.region.compile = False
        plain = [core.process(f) for f in f_cases]
        core.region.compile = True
        got = [core.process(f) for f in f_cases]
    finally:
        core.region.compile = False
    assert comp.errors == [], comp.errors
    assert comp._CACHE, "nothing was compiled"
    for a, b in zip(plain, got, strict=True):
        assert len(a.detections) == len(b.detections) > 0
        for x, y in zip(a.detections, b.detections, strict=True):
            assert (x.camera_index, x.class_index) == (y.camera_index, y.class_index)
            assert x.score == pytest.approx(y.score, abs=1e-6)
            np.testing.assert_allclose(x.box_xyxy, y.box_xyxy, atol=1e-4)
            assert x.position_source == y.position_source
            if x.position is not None:
                np.testing.assert_allclose(x.position, y.position, atol=1e-6)
        for cam in range(len(CAMERAS)):
            np.testing.assert_array_equal(a.masks[cam], b.masks[cam])
            np.testing.assert_allclose(a.depths[cam], b.depths[cam], rtol=1e-6)
