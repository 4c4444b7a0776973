"""Batched (all cameras at once, static shapes, no host sync) decode / NMS / LiDAR fusion ==
the per-camera reference path (`decode_detections`, `nms`, `box_positions`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kestrel_models.perception.lidar import (
    PositionSource,
    box_positions,
    box_positions_batched,
    project_points,
)
from kestrel_models.perception.postprocess import (
    batched_nms_dense,
    decode_detections,
    decode_detections_batched,
    finish_nms,
    nms,
)

torch.set_num_threads(1)
STRIDES = (8, 16, 32)


def random_raw(seed: int, b: int, hw: tuple[int, int], nc: int, spread: float) -> dict:
    """FCOS-like raw outputs over 3 levels for images of size hw (levels padded up)."""
    g = torch.Generator().manual_seed(seed)
    raw: dict = {"det_cls": [], "det_ltrb": [], "det_ctr": []}
    for s in STRIDES:
        h, w = -(-hw[0] // s) + 1, -(-hw[1] // s) + 1  # one padded row/col
        raw["det_cls"].append(torch.randn(b, nc, h, w, generator=g) * 2)
        raw["det_ctr"].append(torch.randn(b, 1, h, w, generator=g))
        raw["det_ltrb"].append(torch.rand(b, 4, h, w, generator=g) * spread * s)
    return raw


def assert_same(ref, got) -> None:
    assert len(ref) == len(got)
    for r, d in zip(ref, got, strict=True):
        assert r.scores.shape == d.scores.shape
        torch.testing.assert_close(d.scores, r.scores)
        torch.testing.assert_close(d.boxes, r.boxes)
        assert torch.equal(d.classes, r.classes)


@pytest.mark.slow
@pytest.mark.parametrize("seed,thr,top_k,iou,max_det", [
    (0, 0.0, 200, 0.5, 20), (1, 0.3, 1000, 0.5, 100), (2, 0.5, 50, 0.3, 5),
    (3, 0.0, 300, 0.7, 300), (4, 0.99, 100, 0.5, 10), (5, 0.0, 40, 0.5, 100)])
def test_decode_batched_equals_per_image(seed, thr, top_k, iou, max_det) -> None:
    hw = (60, 90)
    raw = random_raw(seed, 3, hw, 4, spread=3.0)
    ref = decode_detections(raw, hw, thr, iou, max_det, pre_nms_top_k=top_k, class_offset=1)
    for static in (True, False):
        got = decode_detections_batched(raw, hw, thr, iou, max_det, pre_nms_top_k=top_k,
                                        class_offset=1, nms_rounds=top_k + 1, static=static)
        assert bool(got.nms_converged)
        assert got.boxes.shape == (3, max_det, 4)  # static slots
        assert_same(ref, got.to_list())
        # valid slots first, the rest zero
        for v in got.valid:
            n = int(v.sum())
            assert v[:n].all() and not v[n:].any()
    total = sum(r.scores.numel() for r in ref)
    assert total == 0 if thr > 0.9 else total >= 3  # both empty and non-empty images tested


def test_nms_chain_needs_rounds_and_finish_is_exact() -> None:
    """Hand-made chain A > B > C > D of same-class boxes, each overlapping only the next:
    greedy NMS keeps A and C (B is suppressed by A, so it cannot suppress C)."""
    boxes = torch.tensor([[0.0, 0, 10, 10], [5, 0, 15, 10], [10, 0, 20, 10], [15, 0, 25, 10],
                          [100, 100, 110, 110]])
    scores = torch.tensor([0.9, 0.8, 0.7, 0.6, 0.5])
    classes = torch.zeros(5, dtype=torch.long)
    ref = nms(boxes, scores, 0.3)
    assert ref.tolist() == [0, 2, 4]
    b, c, v = boxes[None], classes[None], torch.ones(1, 5, dtype=torch.bool)
    keep, conv = batched_nms_dense(b, scores[None], c, v, 0.3, rounds=1)
    assert not bool(conv)  # the chain is longer than one round
    exact = finish_nms(b, c, v, keep, 0.3)
    assert exact[0].nonzero().flatten().tolist() == [0, 2, 4]
    keep, conv = batched_nms_dense(b, scores[None], c, v, 0.3, rounds=4)
    assert bool(conv) and keep[0].nonzero().flatten().tolist() == [0, 2, 4]
    # B in another class: nothing suppresses B (A is class 0), B cannot suppress C (other
    # class), C suppresses D -> A, B, C and E kept
    c2 = torch.tensor([[0, 1, 0, 0, 0]])
    keep, conv = batched_nms_dense(b, scores[None], c2, v, 0.3, rounds=6)
    assert bool(conv) and keep[0].tolist() == [True, True, True, False, True]


def cameras(c: int, hw: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """c cameras at the origin with different yaw, optical z forward; K, T_cam_from_base."""
    h, w = hw
    K = torch.tensor([[w / 2, 0, w / 2], [0, w / 2, h / 2], [0, 0, 1.0]], dtype=torch.float64)
    Ts = []
    for i in range(c):
        a = 2 * np.pi * i / c
        yaw = np.array([[np.cos(a), -np.sin(a), 0], [np.sin(a), np.cos(a), 0], [0, 0, 1.0]])
        R_base_from_cam = yaw @ np.array([[0, 0, 1.0], [-1, 0, 0], [0, -1, 0]])
        T = np.eye(4)
        T[:3, :3], T[:3, 3] = R_base_from_cam, (0.1 * i, 0.0, 1.0)
        Ts.append(np.linalg.inv(T))
    return K.expand(c, 3, 3).clone(), torch.tensor(np.stack(Ts))


@pytest.mark.parametrize("seed,with_map,min_points", [(0, True, 5), (1, False, 3), (2, True, 50)])
def test_fusion_batched_equals_per_camera(seed, with_map, min_points) -> None:
    g = torch.Generator().manual_seed(seed)
    c, d, hw = 3, 12, (48, 64)
    K, T_cam = cameras(c, hw)
    n = 4000
    r = 1 + 9 * torch.rand(n, generator=g, dtype=torch.float64)
    a = 2 * np.pi * torch.rand(n, generator=g, dtype=torch.float64)
    pts = torch.stack([r * a.cos(), r * a.sin(), 3 * torch.rand(n, generator=g,
                                                                 dtype=torch.float64)], 1)
    pts = torch.cat([pts.float(), torch.full((96, 3), float("nan"))])  # bucket padding
    uv, z, ok = project_points(pts, T_cam, K, hw)
    xy = torch.rand(c, d, 2, generator=g) * torch.tensor([hw[1], hw[0]])
    wh = torch.rand(c, d, 2, generator=g) * 30
    boxes = torch.cat([xy, (xy + wh)], 2).clamp(min=0)
    boxes[..., 2] = boxes[..., 2].clamp(max=hw[1])
    boxes[..., 3] = boxes[..., 3].clamp(max=hw[0])
    boxes[0, 0] = torch.tensor([10.0, 10.0, 10.2, 10.2])  # tiny: no LiDAR, 1-pixel map rect
    dmap = 1 + 5 * torch.rand(c, *hw, generator=g) if with_map else None
    if dmap is not None:
        dmap[1, :20, :30] = float("nan")
    valid = torch.ones(c, d, dtype=torch.bool)
    valid[2, 8:] = False  # unused slots
    T_base = torch.linalg.inv(T_cam)
    for static in (True, False):
        pos, src = box_positions_batched(boxes, valid, uv, z, ok, dmap, torch.linalg.inv(K),
                                         T_base, min_points, chunk_elems=5000, static=static)
        for cam in range(c):
            rp, rs = box_positions(boxes[cam], uv[cam], z[cam], ok[cam],
                                   None if dmap is None else dmap[cam], K[cam], T_cam[cam],
                                   min_points)
            v = valid[cam]
            assert torch.equal(src[cam][v], rs[v])
            torch.testing.assert_close(pos[cam][v], rp[v], equal_nan=True, atol=1e-6,
                                       rtol=1e-6)
            assert (src[cam][~v] == int(PositionSource.NONE)).all()
            assert pos[cam][~v].isnan().all()
    counts = {int(s) for s in src.flatten()}
    assert int(PositionSource.LIDAR) in counts
    if with_map:
        assert int(PositionSource.PREDICTED_DEPTH) in counts
