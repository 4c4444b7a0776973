"""Captured device region (region_graph.py) with an emulated capture on the CPU: replays read
only their static inputs (a new frame's values are copied in), equal the eager region frame
after frame, one capture per input signature, and a failing capture falls back to eager."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from kestrel_perception.core import PerceptionCore
from kestrel_perception.core.device_region import DeviceRegion
from kestrel_perception.core.region_graph import EmulatedCapture, RegionGraphs

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_perception_core import H, W, core_config, frames, table_points, wall_points  # noqa: E402,E501

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def core() -> PerceptionCore:
    return PerceptionCore(core_config(num_threads=1, point_buckets=(1024, 4096)))


def region_inputs(core: PerceptionCore, seed: int, points: np.ndarray | None,
                  heads: frozenset[str] | None = None):
    """The eager forward of frames(seed) and the staged cloud/cameras (as process() does)."""
    f = frames(stamp=seed, points=points)
    x = torch.from_numpy(np.stack(f.images)).permute(0, 3, 1, 2)
    with torch.inference_mode():
        raw = core.model(x, heads or core.heads)
    staged, cams = core._lidar_inputs(f)
    pts = None if staged.points is None else staged.points.clone()
    return raw, pts, {k: v.clone() for k, v in cams.items()}


def det_settings(core: PerceptionCore) -> dict:
    m = core.config.model
    return {"score_thr": m.score_threshold, "iou_thr": m.nms_iou, "max_det": m.max_detections,
            "pre_nms_top_k": m.pre_nms_top_k, "class_offset": m.det_class_offset,
            "min_points": core.config.min_lidar_points,
            "num_classes": len(core.config.class_names)}


def fields(res) -> dict[str, np.ndarray]:
    return {k: np.copy(getattr(res, k)) for k in ("boxes", "scores", "classes", "valid", "pos",
                                                  "src", "masks", "depths")}


def assert_same(a: dict, b: dict) -> None:
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.slow
def test_replay_equals_eager_frame_after_frame(core: PerceptionCore) -> None:
    graphs = RegionGraphs(EmulatedCapture())
    graphed = DeviceRegion(torch.device("cpu"), "16UC1", 2, 8, static=True, graphs=graphs)
    eager = DeviceRegion(torch.device("cpu"), "16UC1", 2, 8, static=True)
    det = det_settings(core)
    outs = []
    for seed, depth in ((11, 3.0), (12, 2.0), (13, 4.0)):  # different images and clouds
        raw, pts, cams = region_inputs(core, seed, wall_points(depth, step=0.05))
        a = fields(graphed.run(raw, (H, W), det, pts, cams))
        b = fields(eager.run(raw, (H, W), det, pts, cams))
        assert_same(a, b)
        assert (b["src"] == 1).any()  # LiDAR positions exercised
        outs.append(a)
    assert len(graphs.entries) == 1 and graphs.replays == 3 and not graphs.failed
    # the inputs really changed between frames (a replay on stale inputs would repeat frame 0)
    assert not np.array_equal(outs[0]["pos"], outs[1]["pos"])
    assert not np.array_equal(outs[0]["boxes"], outs[2]["boxes"])


@pytest.mark.slow
def test_replay_equals_eager_with_the_support_rule(core: PerceptionCore) -> None:
    """The support rule's steps (point classes from the seg logits, support height, object
    medians in class lanes, centre depth) inside the captured fusion graph: replay == eager,
    frame after frame, and its positions differ from the box median's."""
    graphs = RegionGraphs(EmulatedCapture())
    graphed = DeviceRegion(torch.device("cpu"), "16UC1", 2, 8, static=True, graphs=graphs)
    eager = DeviceRegion(torch.device("cpu"), "16UC1", 2, 8, static=True)
    # support: background, the class the random model labels most pixels with
    det = {**det_settings(core), "support_classes": (0,), "support_tolerance": 0.01}
    for seed in (21, 22):
        raw, pts, cams = region_inputs(core, seed, table_points())
        a = fields(graphed.run(raw, (H, W), det, pts, cams))
        assert_same(a, fields(eager.run(raw, (H, W), det, pts, cams)))
        box = fields(eager.run(raw, (H, W), det_settings(core), pts, cams))
        lidar = (a["src"] == 1) & (box["src"] == 1)
        assert (lidar & ~np.isclose(a["pos"], box["pos"]).all(axis=-1)).any()
    assert len(graphs.entries) == 1 and graphs.replays == 2 and not graphs.failed


@pytest.mark.slow
def test_one_capture_per_signature(core: PerceptionCore) -> None:
    graphs = RegionGraphs(EmulatedCapture())
    region = DeviceRegion(torch.device("cpu"), "16UC1", 2, 8, static=True, graphs=graphs)
    det = det_settings(core)
    for pts in (wall_points(3.0, step=0.05), wall_points(3.0, step=0.1), None):
        raw, p, cams = region_inputs(core, 5, pts)
        region.run(raw, (H, W), det, p, cams)
    raw, p, cams = region_inputs(core, 5, None, frozenset({"depth"}))
    region.run(raw, (H, W), det, p, cams)
    # buckets 4096 (3,300 points) and 1024 (825), no cloud, another head set: 4 signatures
    assert len(graphs.entries) == 4 and graphs.replays == 4
    region.run(raw, (H, W), {**det, "score_thr": 0.5, "iou_thr": 0.2}, p, cams)
    assert len(graphs.entries) == 4  # thresholds are device tensors: no new capture
    assert graphs.replays == 5


@pytest.mark.slow
def test_changed_thresholds_take_effect_without_a_new_capture(core: PerceptionCore) -> None:
    """`ros2 param set score_threshold / nms_iou`: the captured graph reads the thresholds
    from the region's device buffer, so the replay gives the new thresholds' result (as an
    eager region) with no recapture, and going back gives the old result again."""
    graphs = RegionGraphs(EmulatedCapture())
    region = DeviceRegion(torch.device("cpu"), "16UC1", 2, 8, static=True, graphs=graphs)
    det = det_settings(core)
    raw, pts, cams = region_inputs(core, 61, wall_points(3.0, step=0.05))
    eager = DeviceRegion(torch.device("cpu"), "16UC1", 2, 8, static=True)
    first = fields(eager.run(raw, (H, W), det, pts, cams))
    mid = float(np.median(first["scores"][first["valid"]]))  # about half of them pass
    results = {}
    for score, iou in ((det["score_thr"], det["iou_thr"]), (mid, 0.1), (mid, 0.9),
                       (det["score_thr"], det["iou_thr"])):
        d = {**det, "score_thr": score, "iou_thr": iou}
        got = fields(region.run(raw, (H, W), d, pts, cams))
        want = fields(DeviceRegion(torch.device("cpu"), "16UC1", 2, 8, static=True).run(
            raw, (H, W), d, pts, cams))
        assert_same(got, want)
        results[(score, iou)] = got
    assert len(graphs.entries) == 1 and graphs.replays == 4 and not graphs.failed
    counts = {k: int(v["valid"].sum()) for k, v in results.items()}
    n0 = counts[(det["score_thr"], det["iou_thr"])]
    assert 0 < counts[(mid, 0.9)] < n0, counts  # the new score threshold took effect


@pytest.mark.slow
def test_switching_image_sizes_reuses_buffers_and_graphs(core: PerceptionCore) -> None:
    """A camera set that alternates between two sizes (the runtime runs the odd one eager):
    each size keeps its buffers and its captured graph, so after the first frame of each
    size no frame reallocates or recaptures, and every frame equals the eager region."""
    graphs = RegionGraphs(EmulatedCapture())
    region = DeviceRegion(torch.device("cpu"), "16UC1", 2, 8, static=True, graphs=graphs)
    eager = DeviceRegion(torch.device("cpu"), "16UC1", 2, 8, static=True)
    det = det_settings(core)
    raw_a, _, cams = region_inputs(core, 71, None)
    x = torch.from_numpy(np.stack(frames(stamp=72).images)).permute(0, 3, 1, 2)
    x = torch.nn.functional.interpolate(x.float(), size=(H // 2, W // 2)).to(torch.uint8)
    with torch.inference_mode():
        raw_b = core.model(x, core.heads)  # the same cameras at half the size
    stages = {}
    for k, (raw, hw) in enumerate([(raw_a, (H, W)), (raw_b, (H // 2, W // 2))] * 3):
        got = fields(region.run(raw, hw, det, None, cams))
        assert_same(got, fields(eager.run(raw, hw, det, None, cams)))
        stage = region._stage.raw.data_ptr()
        assert stages.setdefault(hw, stage) == stage, k  # the same buffer for a size
    assert len(graphs.entries) == 2 and graphs.replays == 6 and not graphs.failed


@pytest.mark.slow
def test_inputs_at_fixed_addresses_are_not_copied(core: PerceptionCore,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The node's region inputs live in fixed buffers (the runtime's CUDA-graph outputs, the
    input staging): the graph adopts them as its static inputs, a frame written into the same
    buffers is replayed without copying them, and the result is that frame's."""
    graphs = RegionGraphs(EmulatedCapture())
    region = DeviceRegion(torch.device("cpu"), "16UC1", 2, 8, static=True, graphs=graphs)
    eager = DeviceRegion(torch.device("cpu"), "16UC1", 2, 8, static=True)
    det = det_settings(core)
    raw, pts, cams = region_inputs(core, 41, wall_points(3.0, step=0.05))
    first = fields(region.run(raw, (H, W), det, pts, cams, persistent=True))  # adopted
    raw2, pts2, cams2 = region_inputs(core, 42, wall_points(2.0, step=0.05))
    assert pts2.shape == pts.shape  # same bucket: the same graph
    with torch.inference_mode():  # the next frame written in place, as the buffers are
        for key, v in raw.items():
            for dst, src in (zip(v, raw2[key], strict=True) if isinstance(v, list)
                             else ((v, raw2[key]),)):
                dst.copy_(src)
        pts.copy_(pts2)
    inputs = [t for x in (raw, pts, cams) for t in
              (x.values() if isinstance(x, dict) else [x])]
    ptrs = {t.data_ptr() for x in inputs for t in (x if isinstance(x, list) else [x])}
    copies = []
    real_copy = torch.Tensor.copy_

    def spy(self, src, *a, **k):  # an input copied anywhere (into a static copy of it)
        if isinstance(src, torch.Tensor) and src.data_ptr() in ptrs:
            copies.append(tuple(src.shape))
        return real_copy(self, src, *a, **k)

    monkeypatch.setattr(torch.Tensor, "copy_", spy)
    got = fields(region.run(raw, (H, W), det, pts, cams, persistent=True))
    monkeypatch.undo()
    assert copies == [] and graphs.replays == 2 and len(graphs.entries) == 1
    assert_same(got, fields(eager.run(raw, (H, W), det, pts, cams)))
    assert not np.array_equal(got["pos"], first["pos"])  # frame 42's, not a repeat of 41


@pytest.mark.slow
def test_inputs_not_declared_persistent_are_never_written(core: PerceptionCore) -> None:
    """Without `persistent` the graph keeps copies: frames X, Y, X again give X's, Y's and
    X's results, and the caller's X tensors are untouched (adopted inputs would have been
    overwritten by Y's values)."""
    graphs = RegionGraphs(EmulatedCapture())
    region = DeviceRegion(torch.device("cpu"), "16UC1", 2, 8, static=True, graphs=graphs)
    eager = DeviceRegion(torch.device("cpu"), "16UC1", 2, 8, static=True)
    det = det_settings(core)
    x = region_inputs(core, 51, wall_points(3.0, step=0.05))
    y = region_inputs(core, 52, wall_points(2.0, step=0.05))
    seg_before = x[0]["seg"].clone()
    want = [fields(eager.run(*f[:1], (H, W), det, *f[1:])) for f in (x, y)]
    for f, ref in ((x, want[0]), (y, want[1]), (x, want[0])):
        assert_same(fields(region.run(f[0], (H, W), det, f[1], f[2])), ref)
    assert torch.equal(x[0]["seg"], seg_before)
    assert len(graphs.entries) == 1 and graphs.replays == 3


class FailingCapture(EmulatedCapture):
    def capture(self, fn):
        raise RuntimeError("operation not permitted when stream is capturing")


@pytest.mark.slow
def test_failed_capture_runs_eager_with_the_same_results(core: PerceptionCore) -> None:
    graphs = RegionGraphs(FailingCapture())
    region = DeviceRegion(torch.device("cpu"), "16UC1", 2, 8, static=True, graphs=graphs)
    eager = DeviceRegion(torch.device("cpu"), "16UC1", 2, 8, static=True)
    det = det_settings(core)
    for seed in (21, 22):
        raw, pts, cams = region_inputs(core, seed, wall_points(3.0, step=0.05))
        assert_same(fields(region.run(raw, (H, W), det, pts, cams)),
                    fields(eager.run(raw, (H, W), det, pts, cams)))
    assert not graphs.entries and graphs.replays == 0
    assert len(graphs.failed) == 1 and "capture failed" in next(iter(graphs.failed.values()))


def test_core_builds_no_graphs_on_the_cpu(core: PerceptionCore) -> None:
    assert core.config.region_graph and core.region.graphs is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graphed_core_equals_the_launched_region() -> None:
    """Real CUDA graphs of the compiled region (both defaults): captured at warm-up for every
    head set x bucket, validated, and the node-facing outputs equal those of the same core
    without graphs and without compilation."""
    from kestrel_models.perception import compiled
    kw = dict(num_threads=1, device="cuda", point_buckets=(1024, 4096))
    graphed = PerceptionCore(core_config(**kw))
    plain = PerceptionCore(core_config(region_graph=False, region_compile=False, **kw))
    assert graphed.region.compile and not plain.region.compile
    assert compiled.errors == [], compiled.errors
    g = graphed.region.graphs
    assert g is not None and not g.failed, g.failed
    assert len(g.entries) == 3 * 7  # (no cloud + 2 buckets) x head subsets, at warm-up
    n0 = len(g.entries)
    for seed, pts in ((31, wall_points(3.0, step=0.05)), (32, None), (33, wall_points(2.0)),
                      (34, table_points())):  # table: the support rule in the graph
        a = graphed.process(frames(stamp=seed, points=pts))
        b = plain.process(frames(stamp=seed, points=pts))
        assert len(a.detections) == len(b.detections) > 0
        for x, y in zip(a.detections, b.detections, strict=True):
            assert (x.camera_index, x.class_index, int(x.position_source)) == \
                (y.camera_index, y.class_index, int(y.position_source))
            np.testing.assert_allclose(x.box_xyxy, y.box_xyxy, atol=1e-4)
            if x.position is not None:
                np.testing.assert_allclose(x.position, y.position, atol=1e-4)
        for m, n in zip(a.masks, b.masks, strict=True):
            np.testing.assert_array_equal(m, n)
        for m, n in zip(a.depths, b.depths, strict=True):
            assert np.abs(m.astype(np.int64) - n.astype(np.int64)).max() <= 1
    assert len(g.entries) == n0 and g.replays >= 3  # no capture in the hot path
    assert compiled.errors == [], compiled.errors  # still compiled after the frames


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_region_graphs_adopt_the_runtime_graph_outputs() -> None:
    """A CUDA-graph runtime (its outputs are fixed buffers, one set per head set, in
    one shared pool): the region graphs adopt those outputs (no copy per frame) and, with the
    head sets alternating, every frame equals the launched region on the same outputs."""
    from kestrel_models.perception import compiled
    core = PerceptionCore(core_config(num_threads=1, device="cuda", point_buckets=(1024, 4096),
                                      precision="bf16", compile="off", cuda_graph=True,
                                      optimize=False))
    g, rt = core.region.graphs, core.runtime
    assert g is not None and not g.failed and rt is not None and rt.spec.cuda_graph
    every = frozenset(core.heads)
    for i, hs in enumerate((every, frozenset({"depth"}), frozenset({"detection"}), every,
                            frozenset({"segmentation", "detection"}))):
        f = frames(stamp=60 + i, points=wall_points(3.0, step=0.05))
        a = core.process(f, hs)
        core.region.graphs = None  # the launched region, on the same runtime outputs
        try:
            b = core.process(f, hs)
        finally:
            core.region.graphs = g
        assert [(d.camera_index, d.class_index, d.score, int(d.position_source))
                for d in a.detections] == [(d.camera_index, d.class_index, d.score,
                                            int(d.position_source)) for d in b.detections]
        for m, n in zip(a.masks + a.depths, b.masks + b.depths, strict=True):
            np.testing.assert_array_equal(m, n)
    out = rt._graphs[every][1]  # the all-heads graph's output tensors
    adopted = [e for e in g.entries.values()
               if e.inputs[0].get("det_cls") is not None
               and e.inputs[0]["det_cls"][0].data_ptr() == out["det_cls"][0].data_ptr()
               and e.inputs[0]["seg"].data_ptr() == out["seg"].data_ptr()]
    assert len(adopted) == 3  # no cloud + 2 buckets, all heads
    assert compiled.errors == [], compiled.errors
