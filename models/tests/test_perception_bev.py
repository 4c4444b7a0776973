"""BEV fusion block: pillar scatter values, shapes, model integration, config validation."""

from __future__ import annotations

import pytest
import torch

from kestrel_models.perception import MultiTaskPerceptionModel, PerceptionConfig
from kestrel_models.perception.bev import BEVFusion, PillarScatter


@pytest.fixture(autouse=True)
def _threads() -> None:
    torch.set_num_threads(1)


def test_pillar_scatter_means_points_per_cell_and_drops_invalid() -> None:
    torch.manual_seed(0)
    ps = PillarScatter(channels=8, grid=4, half_range=2.0, z_range=(-1.0, 1.0))  # 1 m cells
    nan = float("nan")
    pts = torch.tensor([[[-1.5, -1.5, 0.0],   # cell (0, 0)
                         [-1.2, -1.8, 0.5],   # cell (0, 0)
                         [1.5, 0.5, 0.0],     # cell (3, 2)
                         [5.0, 0.0, 0.0],     # outside x range
                         [0.5, 0.5, 3.0],     # above z range
                         [nan, nan, nan]]])   # bucket padding
    out = ps(pts)
    assert out.shape == (1, 8, 4, 4)
    feats = ps.mlp(torch.tensor([[-1.5 / 2, -1.5 / 2, 0.0, 0.0, 0.0],
                                 [-1.2 / 2, -1.8 / 2, 0.5, 0.3, -0.3],
                                 [1.5 / 2, 0.5 / 2, 0.0, 0.0, 0.0]]))
    torch.testing.assert_close(out[0, :, 0, 0], (feats[0] + feats[1]) / 2)
    torch.testing.assert_close(out[0, :, 3, 2], feats[2])
    occupied = out[0].abs().sum(0) > 0
    assert occupied.sum() == 2  # invalid points leave no trace
    assert torch.isfinite(out).all()


def test_bev_fusion_shapes_and_image_dependence() -> None:
    torch.manual_seed(0)
    bev = BEVFusion(channels=16, grid=8, half_range=10.0, z_range=(-2, 4), heads=4).eval()
    pts = torch.randn(2, 100, 3) * 4
    feats = torch.randn(2 * 3, 16, 5, 6)  # 2 samples x 3 cameras
    out = bev(pts, feats)
    assert out.shape == (2, 1, 8, 8)
    feats2 = feats.clone()
    feats2[3:] = torch.randn(3, 16, 5, 6)  # other images for sample 1 only
    out2 = bev(pts, feats2)
    torch.testing.assert_close(out2[0], out[0])  # sample 0 unaffected
    assert not torch.allclose(out2[1], out[1])  # cross-attention sees sample 1's images
    with pytest.raises(ValueError, match="split"):
        bev(pts, torch.randn(5, 16, 5, 6))


def test_model_with_bev_outputs_occupancy_only_when_points_given() -> None:
    torch.manual_seed(0)
    cfg = PerceptionConfig.tiny(bev=True, bev_grid=12)
    model = MultiTaskPerceptionModel(cfg).eval()
    img = torch.randint(0, 256, (4, 3, 64, 64), dtype=torch.uint8)
    with torch.no_grad():
        assert "bev_occ" not in model(img)
        out = model(img, points=torch.randn(2, 300, 3) * 5)  # 2 samples x 2 cameras
    assert out["bev_occ"].shape == (2, 1, 12, 12)
    assert "bev" not in dict(MultiTaskPerceptionModel(PerceptionConfig.tiny()).named_children())


@pytest.mark.parametrize("field,value", [("bev_grid", 2), ("bev_range", 0.0),
                                         ("bev_z_range", (1.0, 0.0)), ("bev_heads", 3)])
def test_bev_config_is_validated(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        PerceptionConfig.tiny(**{field: value})
