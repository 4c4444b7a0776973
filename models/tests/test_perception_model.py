"""MultiTaskPerceptionModel: config validation, shapes, heads switching, decode + NMS."""

from __future__ import annotations

import math

import pytest
import torch
from kestrel_models.perception import (
    MultiTaskPerceptionModel,
    PerceptionConfig,
    ResNetBackbone,
    batched_nms,
    box_iou,
    count_parameters,
    decode_detections,
    nms,
)

torch.set_num_threads(1)

H, W = 70, 100  # deliberately not multiples of 32: padded to 96 x 128 inside


def tiny(**kw: object) -> PerceptionConfig:
    base: dict[str, object] = dict(backbone_depth=18, base_width=8, fpn_channels=16,
                                   head_convs=1)
    base.update(kw)
    return PerceptionConfig(**base)  # type: ignore[arg-type]


def build(cfg: PerceptionConfig, seed: int = 0) -> MultiTaskPerceptionModel:
    torch.manual_seed(seed)
    return MultiTaskPerceptionModel(cfg).eval()


def images(b: int = 2, h: int = H, w: int = W, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (b, 3, h, w), dtype=torch.uint8, generator=g)


# ---- config -------------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [
    ("backbone_depth", 101), ("base_width", 6), ("fpn_channels", 12), ("num_classes", 1),
    ("score_threshold", 1.5), ("nms_iou", -0.1), ("max_detections", 0), ("max_depth", 0.0),
    ("dense_stride", 16), ("depth_activation", "relu"), ("heads", frozenset({"pose"})),
    ("heads", frozenset()),
])
def test_config_rejects_bad_values_naming_field_and_value(field: str, value: object) -> None:
    with pytest.raises(ValueError) as err:
        PerceptionConfig(**{field: value})
    msg = str(err.value)
    assert f"'{field}'" in msg
    assert (str(sorted(value)) if isinstance(value, frozenset) else repr(value)) in msg


def test_config_detection_classes_exclude_background() -> None:
    assert PerceptionConfig(num_classes=7).num_det_classes == 6
    assert PerceptionConfig(num_classes=7).det_class_offset == 1
    assert PerceptionConfig(num_classes=7, background_class=False).num_det_classes == 7


# ---- shapes -------------------------------------------------------------------------------
@pytest.mark.parametrize("depth", [18, 34, 50])
def test_output_shapes_all_depths(depth: int) -> None:
    cfg = tiny(backbone_depth=depth, num_classes=5)
    model = build(cfg)
    with torch.inference_mode():
        out = model(images())
    assert set(out) == {"det_cls", "det_ltrb", "det_ctr", "seg", "depth"}
    # padded 96 x 128 -> P3 12x16, P4 6x8, P5 3x4
    for level, (h, w) in enumerate([(12, 16), (6, 8), (3, 4)]):
        assert out["det_cls"][level].shape == (2, 4, h, w)  # 5 classes - background
        assert out["det_ltrb"][level].shape == (2, 4, h, w)
        assert out["det_ctr"][level].shape == (2, 1, h, w)
        assert (out["det_ltrb"][level] > 0).all()
    assert out["seg"].shape == (2, 5, H, W)
    assert out["depth"].shape == (2, 1, H, W)
    assert torch.isfinite(out["depth"]).all()
    assert (out["depth"] > 0).all() and (out["depth"] <= cfg.max_depth).all()


def test_backbone_channels_and_strides() -> None:
    bb = ResNetBackbone(50, 8).eval()
    with torch.inference_mode():
        feats = bb(torch.zeros(1, 3, 64, 96))
    assert bb.out_channels == [32, 64, 128, 256]  # base_width * 2^i * expansion 4
    assert [tuple(f.shape[-2:]) for f in feats] == [(16, 24), (8, 12), (4, 6), (2, 3)]


def test_real_resnet_parameter_counts_without_running() -> None:
    # torchvision's ResNet-50 has 25,557,032 parameters, 2,049,000 of them in the classifier;
    # ResNet-18: 11,689,512 with 513,000 in the classifier. Built on "meta": no memory, no run.
    with torch.device("meta"):
        r50 = ResNetBackbone(50, 64)
        r18 = ResNetBackbone(18, 64)
        full = MultiTaskPerceptionModel(PerceptionConfig())
    assert count_parameters(r50) == 25_557_032 - 2_049_000
    assert count_parameters(r18) == 11_689_512 - 513_000
    assert 25e6 < count_parameters(full) < 40e6  # + 256-ch FPN and heads


def test_dense_stride_4_and_sigmoid_depth() -> None:
    cfg = tiny(dense_stride=4, depth_activation="sigmoid", max_depth=5.0,
               heads=frozenset({"segmentation", "depth"}))
    model = build(cfg)
    assert model.fpn.with_p2 and model.det_head is None
    with torch.inference_mode():
        out = model(images(1))
    assert set(out) == {"seg", "depth"}
    assert out["seg"].shape == (1, 7, H, W)
    assert (out["depth"] > 0).all() and (out["depth"] < 5.0).all()


# ---- heads switching ----------------------------------------------------------------------
def test_heads_switch_at_runtime_with_same_weights() -> None:
    model = build(tiny())
    x = images(1)
    with torch.inference_mode():
        full = model(x)
        only_depth = model(x, frozenset({"depth"}))
        only_det = model(x, frozenset({"detection"}))
    assert set(only_depth) == {"depth"}
    assert set(only_det) == {"det_cls", "det_ltrb", "det_ctr"}
    torch.testing.assert_close(only_depth["depth"], full["depth"])
    torch.testing.assert_close(only_det["det_cls"][0], full["det_cls"][0])


def test_disabled_head_is_not_built_and_cannot_be_requested() -> None:
    model = build(tiny(heads=frozenset({"detection"})))
    assert model.seg_head is None and model.depth_head is None and model.dense_neck is None
    with pytest.raises(ValueError, match="subset of the built heads"):
        model(images(1), frozenset({"segmentation"}))


def test_normalisation_inside_model() -> None:
    cfg = tiny()
    model = build(cfg)
    mean_rgb = torch.tensor(cfg.image_mean) * 255.0
    img = mean_rgb.round().to(torch.uint8).view(1, 3, 1, 1).expand(1, 3, 32, 32)
    x = model.normalise(img)
    assert x.dtype == torch.float32 and x.shape == (1, 3, 32, 32)
    assert x.abs().max() < 0.01  # the mean colour maps to ~0
    white = model.normalise(torch.full((1, 3, 40, 50), 255, dtype=torch.uint8))
    assert white.shape == (1, 3, 64, 64)  # padded to multiples of 32 with 0 (= mean)
    expect = (1.0 - torch.tensor(cfg.image_mean)) / torch.tensor(cfg.image_std)
    torch.testing.assert_close(white[0, :, 0, 0], expect)
    assert (white[..., 40:, :] == 0).all() and (white[..., 50:] == 0).all()


def test_channels_last_and_autocast() -> None:
    model = build(tiny())
    x = images(1)
    with torch.inference_mode():
        ref = model(x)
        model = model.to(memory_format=torch.channels_last)
        cl = model(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            amp = model(x)
    torch.testing.assert_close(cl["depth"], ref["depth"], rtol=1e-4, atol=1e-4)
    assert amp["seg"].shape == ref["seg"].shape
    assert torch.isfinite(amp["depth"].float()).all()
    torch.testing.assert_close(amp["depth"].float(), ref["depth"], rtol=0.1, atol=0.1)


# ---- NMS ----------------------------------------------------------------------------------
def test_box_iou_values() -> None:
    a = torch.tensor([[0.0, 0, 10, 10]])
    b = torch.tensor([[0.0, 0, 10, 10], [5, 0, 15, 10], [20, 20, 30, 30]])
    torch.testing.assert_close(box_iou(a, b), torch.tensor([[1.0, 50 / 150, 0.0]]))


def test_nms_suppresses_overlapping_same_class_keeps_other_class() -> None:
    boxes = torch.tensor([[0.0, 0, 10, 10],     # 0: best
                          [1, 1, 11, 11],        # 1: IoU 0.68 with 0 -> suppressed
                          [0, 0, 10, 10],        # 2: same box, other class -> kept
                          [20, 20, 30, 30],      # 3: far away -> kept
                          [5, 0, 15, 10]])       # 4: IoU 0.33 with 0 -> kept at 0.5
    scores = torch.tensor([0.9, 0.8, 0.7, 0.6, 0.5])
    classes = torch.tensor([1, 1, 2, 1, 1])
    keep = batched_nms(boxes, scores, classes, 0.5)
    assert keep.tolist() == [0, 2, 3, 4]
    assert batched_nms(boxes, scores, classes, 0.3).tolist() == [0, 2, 3]
    # class-agnostic: the identical box of class 2 is suppressed too
    assert nms(boxes, scores, 0.5).tolist() == [0, 3, 4]


def test_nms_chain_matches_greedy() -> None:
    # A suppresses B, B would suppress C, but B is gone so C survives (greedy semantics)
    boxes = torch.tensor([[0.0, 0, 10, 10], [4, 0, 14, 10], [8, 0, 18, 10]])
    assert nms(boxes, torch.tensor([0.9, 0.8, 0.7]), 0.4).tolist() == [0, 2]


def _reference_nms(boxes: torch.Tensor, scores: torch.Tensor, thr: float) -> list[int]:
    order = torch.argsort(scores, descending=True).tolist()
    kept: list[int] = []
    for i in order:
        if all(box_iou(boxes[i:i + 1], boxes[j:j + 1]).item() <= thr for j in kept):
            kept.append(i)
    return kept


@pytest.mark.slow
def test_nms_equals_reference_greedy_on_random_boxes() -> None:
    g = torch.Generator().manual_seed(3)
    for _ in range(5):
        xy = torch.rand(60, 2, generator=g) * 50
        wh = torch.rand(60, 2, generator=g) * 30 + 2
        boxes = torch.cat([xy, xy + wh], dim=1)
        scores = torch.rand(60, generator=g)
        assert nms(boxes, scores, 0.45).tolist() == _reference_nms(boxes, scores, 0.45)


# ---- decode -------------------------------------------------------------------------------
def _raw(batch: int = 1, nc: int = 3, hw: tuple[int, int] = (64, 64)) -> dict:
    """All-background raw outputs for a padded image of size hw."""
    raw: dict = {"det_cls": [], "det_ltrb": [], "det_ctr": []}
    for s in (8, 16, 32):
        h, w = hw[0] // s, hw[1] // s
        raw["det_cls"].append(torch.full((batch, nc, h, w), -20.0))
        raw["det_ltrb"].append(torch.full((batch, 4, h, w), 4.0))
        raw["det_ctr"].append(torch.full((batch, 1, h, w), 10.0))
    return raw


def test_decode_known_boxes_and_classwise_nms() -> None:
    raw = _raw()
    # P3 (stride 8) location (x=3, y=2) -> point (28, 20); class channel 1, ltrb (4, 5, 6, 7)
    raw["det_cls"][0][0, 1, 2, 3] = 10.0
    raw["det_ltrb"][0][0, :, 2, 3] = torch.tensor([4.0, 5, 6, 7])
    # neighbour (x=4): same class, weaker, overlapping box -> suppressed by NMS
    raw["det_cls"][0][0, 1, 2, 4] = 5.0
    raw["det_ltrb"][0][0, :, 2, 4] = torch.tensor([12.0, 5, 0.5, 7])
    # same location, other class (channel 2) -> kept
    raw["det_cls"][0][0, 2, 2, 3] = 8.0
    # P4 (stride 16) location (1, 1) -> point (24, 24), class channel 0, a large box
    raw["det_cls"][1][0, 0, 1, 1] = 6.0
    raw["det_ltrb"][1][0, :, 1, 1] = torch.tensor([30.0, 30, 30, 30])
    dets = decode_detections(raw, (64, 64), 0.3, 0.5, 10, class_offset=1)
    assert len(dets) == 1
    d = dets[0]
    assert d.classes.tolist() == [2, 3, 1]
    torch.testing.assert_close(d.boxes[0], torch.tensor([24.0, 15, 34, 27]))
    torch.testing.assert_close(d.boxes[1], torch.tensor([24.0, 15, 34, 27]))
    torch.testing.assert_close(d.boxes[2], torch.tensor([0.0, 0, 54, 54]))  # clipped at 0
    sig = torch.sigmoid
    expect = torch.tensor([math.sqrt(sig(torch.tensor(s)) * sig(torch.tensor(10.0)))
                           for s in (10.0, 8.0, 6.0)])
    torch.testing.assert_close(d.scores, expect)
    assert decode_detections(raw, (64, 64), 0.3, 0.5, 2)[0].classes.tolist() == [1, 2]


def test_decode_ignores_padding_and_applies_threshold_and_max_det() -> None:
    raw = _raw(batch=2)
    raw["det_cls"][0][1, 0, 7, 7] = 10.0  # point (60, 60): in the padding of a 56x56 image
    raw["det_cls"][0][1, 0, 0, 0] = 10.0  # point (4, 4): inside
    dets = decode_detections(raw, (56, 56), 0.3, 0.5, 10)
    assert dets[0].boxes.shape == (0, 4) and dets[0].scores.shape == (0,)
    assert dets[1].boxes.shape == (1, 4)
    torch.testing.assert_close(dets[1].boxes[0], torch.tensor([0.0, 0, 8, 8]))
    many = decode_detections(_raw(), (64, 64), 0.0, 0.5, 7)[0]
    assert many.boxes.shape[0] == 7


def test_model_output_decodes() -> None:
    cfg = tiny(score_threshold=0.0)
    model = build(cfg)
    with torch.inference_mode():
        raw = model(images(2))
    dets = decode_detections(raw, (H, W), 0.0, 0.5, 15, class_offset=cfg.det_class_offset)
    assert len(dets) == 2
    for d in dets:
        assert d.boxes.shape == (15, 4)
        assert ((d.classes >= 1) & (d.classes < cfg.num_classes)).all()
        assert (d.boxes[:, 0] >= 0).all() and (d.boxes[:, 2] <= W).all()
        assert (d.boxes[:, 1] >= 0).all() and (d.boxes[:, 3] <= H).all()
        assert (d.scores[:-1] >= d.scores[1:]).all()
