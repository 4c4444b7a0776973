"""BEV fusion block: pillar scatter values, shapes, model integration, config validation."""

from __future__ import annotations

import pytest
import torch

from kestrel_models.perception import MultiTaskPerceptionModel, PerceptionConfig
from kestrel_models.perception.bev import BEVFusion, PillarScatter, camera_attention_bias


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


def _forward_camera(yaw: float = 0.0) -> torch.Tensor:
    """T_cam_from_base [4, 4] of a camera at the base origin, optical axis along base
    (cos yaw, sin yaw, 0), image x to the right, y down."""
    c, s = torch.cos(torch.tensor(yaw)), torch.sin(torch.tensor(yaw))
    fwd = torch.stack([c, s, torch.tensor(0.0)])
    right = torch.stack([s, -c, torch.tensor(0.0)])
    down = torch.tensor([0.0, 0.0, -1.0])
    T = torch.eye(4)
    T[:3, :3] = torch.stack([right, down, fwd])  # rows: camera axes in base coordinates
    return T


def test_camera_bias_points_each_cell_at_its_projection() -> None:
    """A 4x4 grid of 5 m cells (x, y in [-10, 10) m) at z = 0, two cameras of a 64x64 px image
    (f = 32 px) looking along +x and -x, tokens of 16 px (4x4): a cell in front of camera 0
    is biased to the token of its projection and masked in camera 1 (behind it); a cell
    at the side, seen by neither, has no bias."""
    K = torch.tensor([[32.0, 0.0, 32.0], [0.0, 32.0, 32.0], [0.0, 0.0, 1.0]])
    T = torch.stack([_forward_camera(0.0), _forward_camera(torch.pi)])
    bias = camera_attention_bias(T, K.repeat(2, 1, 1), (64, 64), (4, 4), 16.0, grid=4,
                                 half_range=10.0, z=0.0)
    assert bias.shape == (16, 2 * 16)
    # cell (3, 1): centre x = 7.5, y = -2.5 -> camera 0: u = 32 + 32 * 2.5 / 7.5 = 42.7 px
    # (token column 2), v = 32 (between token rows 1 and 2)
    row = bias[3 * 4 + 1]
    cam0, cam1 = row[:16].view(4, 4), row[16:].view(4, 4)
    assert (cam1 == -1e4).all()  # behind camera 1
    best = torch.nonzero(cam0 == cam0.max())
    assert {tuple(t.tolist()) for t in best} <= {(1, 2), (2, 2)}
    assert cam0.max() > -0.5 and cam0.min() < -3.0  # falls off with the token distance
    # cell (0, 0): x = -7.5, y = -7.5: in front of camera 1, at 45 deg: u = 32 + 32 = 64 px,
    # just outside the image; cell (1, 0): x = -2.5, y = -7.5: outside both images -> no bias
    assert (bias[1 * 4 + 0] == 0).all()


def test_camera_bias_is_fp32_geometry_under_bf16_autocast() -> None:
    """The projection runs outside autocast (einsum would drop to bf16 and flip cells at the
    image border in and out of view)."""
    K = torch.tensor([[300.0, 0.0, 320.0], [0.0, 300.0, 240.0], [0.0, 0.0, 1.0]])
    T = torch.stack([_forward_camera(0.3), _forward_camera(2.0)])
    args = (T, K.repeat(2, 1, 1), (480, 640), (15, 20), 32.0, 64, 25.6, 1.0)
    ref = camera_attention_bias(*args)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = camera_attention_bias(*args)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref)


def test_bev_geometry_changes_the_occupancy_and_stays_finite() -> None:
    torch.manual_seed(0)
    bev = BEVFusion(channels=16, grid=8, half_range=10.0, z_range=(-2, 4), heads=4).eval()
    pts = torch.randn(1, 100, 3) * 4
    feats = torch.randn(2, 16, 4, 4)  # 1 sample x 2 cameras
    K = torch.tensor([[32.0, 0.0, 32.0], [0.0, 32.0, 32.0], [0.0, 0.0, 1.0]]).repeat(2, 1, 1)
    T = torch.stack([_forward_camera(0.0), _forward_camera(torch.pi)])
    with torch.no_grad():
        free = bev(pts, feats)
        lifted = bev(pts, feats, (T, K, (64, 64), 16.0))
        turned = bev(pts, feats, (T.flip(0), K, (64, 64), 16.0))  # cameras swapped
    assert torch.isfinite(lifted).all() and not torch.allclose(free, lifted)
    assert not torch.allclose(lifted, turned)  # the geometry decides which image a cell sees


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
