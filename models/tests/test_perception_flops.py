"""FLOP count of the perception model (meta device: no compute)."""

from __future__ import annotations

import pytest
import torch

from kestrel_models.perception import PerceptionConfig
from kestrel_models.perception.flops import count_flops


@pytest.fixture(autouse=True)
def _threads() -> None:
    torch.set_num_threads(1)


@pytest.mark.slow
def test_resnet50_trunk_matches_the_published_figure() -> None:
    # ResNet-50 at 224 x 224: 4.09 GMAC (torchvision, fc included) = ~8.2 GFLOP
    rep = count_flops(PerceptionConfig(), images=1, image_hw=(224, 224))
    assert rep.parts_gflop["trunk"] == pytest.approx(8.17, rel=0.01)


@pytest.mark.slow
def test_reference_config_split_and_floor() -> None:
    rep = count_flops(PerceptionConfig(), images=6, image_hw=(640, 640))
    assert set(rep.parts_gflop) == {"trunk", "fpn", "detection", "dense_neck", "segmentation",
                                    "depth"}
    assert rep.total_gflop == pytest.approx(sum(rep.parts_gflop.values()), rel=1e-6)
    assert 1000 < rep.total_gflop < 1200  # ~1.1 TFLOP for the full model at 6 x 640x640
    assert rep.parts_gflop["trunk"] == pytest.approx(6 * 8.17 * (640 / 224) ** 2, rel=0.01)
    assert rep.floor_ms(790.0) == pytest.approx(rep.total_gflop / 790.0)
    # FLOPs scale with the number of images; fewer tower convs -> a lighter detection head
    one = count_flops(PerceptionConfig(), images=1, image_hw=(640, 640))
    assert rep.total_gflop == pytest.approx(6 * one.total_gflop, rel=1e-6)
    light = count_flops(PerceptionConfig(head_convs=3), images=6, image_hw=(640, 640))
    assert light.parts_gflop["detection"] < rep.parts_gflop["detection"]
    assert light.parts_gflop["trunk"] == rep.parts_gflop["trunk"]


@pytest.mark.slow
def test_bev_part_only_with_points_and_bad_args() -> None:
    cfg = PerceptionConfig.tiny(bev=True, bev_grid=16)
    assert "bev" in count_flops(cfg, 1, (64, 64), lidar_points=128).parts_gflop
    assert "bev" not in count_flops(cfg, 1, (64, 64)).parts_gflop
    with pytest.raises(ValueError, match="'images' = 0"):
        count_flops(cfg, 0)
    with pytest.raises(ValueError, match="'tflops'"):
        count_flops(cfg, 1, (64, 64)).floor_ms(0.0)
