"""kestrel_models.perception.train: FCOS target assignment, losses, train loop, evaluation."""

from __future__ import annotations

import math

import pytest
import torch
from kestrel_models.perception import MultiTaskPerceptionModel, PerceptionConfig
from kestrel_models.perception.postprocess import level_points
from kestrel_models.perception.train import (
    Batch,
    assign_targets,
    centerness,
    compute_losses,
    evaluate,
    giou_loss_ltrb,
    sigmoid_focal_loss,
    train,
)

torch.set_num_threads(1)

H, W = 64, 96  # px
STRIDES = (8, 16, 32)


def points(h: int = H, w: int = W) -> list[torch.Tensor]:
    return [level_points(math.ceil(h / s), math.ceil(w / s), s, torch.device("cpu"))
            for s in STRIDES]


def loc_index(pts: list[torch.Tensor], level: int, x: float, y: float) -> int:
    """Index into the concatenated locations of the point (x, y) px of `level`."""
    p = pts[level]
    i = int(((p[:, 0] == x) & (p[:, 1] == y)).nonzero()[0, 0])
    return sum(q.shape[0] for q in pts[:level]) + i


def test_location_inside_one_box_gets_its_class_and_ltrb() -> None:
    pts = points()
    boxes = torch.tensor([[10.0, 6.0, 40.0, 30.0]])  # 30 x 24 px -> P3 (max side < 64)
    labels = torch.tensor([3])
    cls, ltrb, ctr = assign_targets(pts, boxes, labels, center_radius=0.0, class_offset=1)
    i = loc_index(pts, 0, 20.0, 12.0)
    assert int(cls[i]) == 2  # class 3 - offset 1
    assert torch.allclose(ltrb[i], torch.tensor([10.0, 6.0, 20.0, 18.0]))
    expected = math.sqrt((10 / 20) * (6 / 18))
    assert float(ctr[i]) == pytest.approx(expected, rel=1e-5)
    # outside the box: background; P4/P5 locations are out of the size range
    assert int(cls[loc_index(pts, 0, 60.0, 12.0)]) == -1
    assert (cls[pts[0].shape[0]:] == -1).all()


def test_overlapping_boxes_take_the_smallest_and_levels_follow_size() -> None:
    pts = points(256, 320)
    big = [0.0, 0.0, 300.0, 200.0]  # max distance > 128 -> P5
    small = [150.0, 90.0, 170.0, 110.0]  # 20 px cube in the middle -> P3
    cls, ltrb, _ = assign_targets(pts, torch.tensor([big, small]), torch.tensor([1, 2]),
                                  center_radius=0.0, class_offset=1)
    i = loc_index(pts, 0, 164.0, 100.0)  # inside both boxes
    assert int(cls[i]) == 1  # the small one (class 2)
    assert torch.allclose(ltrb[i], torch.tensor([14.0, 10.0, 6.0, 10.0]))
    j = loc_index(pts, 2, 144.0, 112.0)  # P5 location near the big box centre
    assert int(cls[j]) == 0
    n3, n4 = pts[0].shape[0], pts[1].shape[0]
    assert ((cls[:n3] == 0).sum() == 0)  # big box never on P3 (max side too large)
    assert (cls[n3:n3 + n4] == 1).sum() == 0  # small box never on P4


def test_center_sampling_limits_positives_and_empty_image() -> None:
    pts = points(256, 320)
    box = torch.tensor([[0.0, 0.0, 300.0, 200.0]])
    cls_all, _, _ = assign_targets(pts, box, torch.tensor([1]), center_radius=0.0)
    cls_c, _, _ = assign_targets(pts, box, torch.tensor([1]), center_radius=1.5)
    assert 0 < int((cls_c >= 0).sum()) <= 9 < int((cls_all >= 0).sum())
    cls, ltrb, ctr = assign_targets(pts, torch.zeros(0, 4), torch.zeros(0, dtype=torch.long))
    assert (cls == -1).all() and ltrb.abs().sum() == 0 and ctr.sum() == 0


def test_loss_functions_values() -> None:
    t = torch.tensor([[5.0, 5.0, 5.0, 5.0]])
    assert float(giou_loss_ltrb(t, t)[0]) == pytest.approx(0.0, abs=1e-6)
    assert float(giou_loss_ltrb(t * 2, t)[0]) == pytest.approx(0.75, abs=1e-5)  # IoU 1/4
    assert float(centerness(t)[0]) == pytest.approx(1.0)
    logits = torch.tensor([10.0, -10.0])
    assert float(sigmoid_focal_loss(logits, torch.tensor([1.0, 0.0]))) < 1e-6
    assert float(sigmoid_focal_loss(logits, torch.tensor([0.0, 1.0]))) > 1.0


def tiny_batch(n: int = 2) -> Batch:
    """Flat grey images with a red square (class 2) on a blue table (class 1)."""
    imgs = torch.full((n, 3, H, W), 90, dtype=torch.uint8)
    seg = torch.zeros(n, H, W, dtype=torch.long)
    imgs[:, :, 32:, :] = torch.tensor([40, 40, 200], dtype=torch.uint8).view(3, 1, 1)
    seg[:, 32:, :] = 1
    boxes, labels = [], []
    for k in range(n):
        x0 = 16 + 24 * k
        imgs[k, :, 12:28, x0:x0 + 16] = torch.tensor([220, 20, 20],
                                                     dtype=torch.uint8).view(3, 1, 1)
        seg[k, 12:28, x0:x0 + 16] = 2
        boxes.append(torch.tensor([[float(x0), 12.0, x0 + 16.0, 28.0],
                                   [0.0, 32.0, float(W), float(H)]]))
        labels.append(torch.tensor([2, 1]))
    depth = torch.where(seg > 0, 1.0, 2.0).float()
    depth[:, 0, 0] = math.inf  # an invalid pixel
    return Batch(imgs, seg, depth, boxes, labels)


def small_model() -> MultiTaskPerceptionModel:
    torch.manual_seed(0)
    cfg = PerceptionConfig.tiny(base_width=8, fpn_channels=32, num_classes=3)
    return MultiTaskPerceptionModel(cfg)


@pytest.mark.slow
def test_losses_are_finite_and_decrease_with_training() -> None:
    model = small_model()
    batch = tiny_batch()
    with torch.no_grad():
        before = compute_losses(model(batch.images), batch)
    assert set(before) == {"cls", "box", "ctr", "seg", "depth"}
    assert all(math.isfinite(float(v)) for v in before.values())
    log = train(model, [batch], steps=30, lr=3e-3, warmup_steps=3, log_every=10, log=None)
    assert log.steps == 30 and len(log.history) == 3
    model.train()  # compare like with like (BatchNorm in training mode)
    with torch.no_grad():
        after = compute_losses(model(batch.images), batch)
    for k in ("cls", "seg", "depth"):
        assert float(after[k]) < 0.7 * float(before[k]), (k, before[k], after[k])
    assert log.history[-1]["total"] < log.history[0]["total"]


def test_time_budget_stops_training_and_bad_args() -> None:
    model = small_model()
    log = train(model, [tiny_batch(1)], steps=10_000, time_budget_s=0.5, log=None)
    assert 1 <= log.steps < 10_000
    with pytest.raises(ValueError, match="'steps'"):
        train(model, [tiny_batch(1)], steps=0)
    with pytest.raises(ValueError, match="'time_budget_s'"):
        train(model, [tiny_batch(1)], steps=1, time_budget_s=-1.0)


def test_evaluate_counts_perfect_and_empty_predictions(monkeypatch) -> None:
    model = small_model()
    batch = tiny_batch(1)
    names = ("background", "table", "red")

    def perfect(images, heads=None):  # logits that reproduce the GT exactly
        seg = torch.nn.functional.one_hot(batch.seg, 3).permute(0, 3, 1, 2).float() * 10
        return {"seg": seg}

    monkeypatch.setattr(model, "forward", perfect)
    res = evaluate(model, [batch], names)
    assert res["miou"] == pytest.approx(1.0) and res["images"] == 1
    monkeypatch.undo()
    model.eval()
    res = evaluate(model, [batch], names, score_thr=1.0)  # nothing passes the threshold
    assert res["det"]["red"]["recall"] == 0.0 and res["det"]["red"]["gt"] == 1
    assert res["det"]["red"]["precision"] is None
