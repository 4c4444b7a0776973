"""LiDAR geometry: projection with known cameras, bucketing, 3D box positions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kestrel_models.perception import (
    PositionSource,
    box_position,
    box_positions,
    bucket_points,
    project_points,
)

torch.set_num_threads(1)

IMG_HW = (80, 100)  # H, W px
K = torch.tensor([[100.0, 0, 50], [0, 100.0, 40], [0, 0, 1]], dtype=torch.float64)

# camera 1 looks along base +x: cam z = base x, cam x = -base y, cam y = -base z; its optical
# centre is at base (0, 0, 1)
R_CAM1_FROM_BASE = torch.tensor([[0.0, -1, 0], [0, 0, -1], [1, 0, 0]], dtype=torch.float64)


def t_cam1_from_base() -> torch.Tensor:
    T = torch.eye(4, dtype=torch.float64)
    T[:3, :3] = R_CAM1_FROM_BASE
    T[:3, 3] = -R_CAM1_FROM_BASE @ torch.tensor([0.0, 0, 1], dtype=torch.float64)
    return T


def two_cameras() -> tuple[torch.Tensor, torch.Tensor]:
    T = torch.stack([torch.eye(4, dtype=torch.float64), t_cam1_from_base()])
    return T, torch.stack([K, K])


def test_projection_known_points_exact_pixels() -> None:
    T, Ks = two_cameras()
    pts = torch.tensor([[0.2, -0.4, 2.0],    # cam0: u = 100*0.1+50 = 60, v = 100*-0.2+40 = 20
                        [4.0, -0.4, 0.2]],   # cam1: p_cam = (0.4, 0.8, 4) -> (60, 60)
                       dtype=torch.float64)
    uv, depth, valid = project_points(pts, T, Ks, IMG_HW)
    assert uv.shape == (2, 2, 2) and depth.shape == (2, 2) and valid.shape == (2, 2)
    torch.testing.assert_close(uv[0, 0], torch.tensor([60.0, 20.0], dtype=torch.float64))
    torch.testing.assert_close(depth[0, 0].item(), 2.0)
    torch.testing.assert_close(uv[1, 1], torch.tensor([60.0, 60.0], dtype=torch.float64))
    torch.testing.assert_close(depth[1, 1].item(), 4.0)
    # point 1 is at cam0 z = 0.2, u = 100*20+50: far outside; point 0 is behind camera 1
    assert valid.tolist() == [[True, False], [False, True]]


def test_projection_drops_behind_outside_and_nan() -> None:
    pts = torch.tensor([[0.0, 0.0, -2.0],        # behind (would project to the centre)
                        [0.0, 0.0, 0.0],         # on the camera centre
                        [0.6, 0.0, 1.0],         # u = 110 > W
                        [-0.505, 0.0, 1.0],      # u = -0.5: first column's left edge, inside
                        [0.495, 0.395, 1.0],     # u = 99.5, v = 79.5: just outside
                        [float("nan"), 0.0, 1.0],
                        [0.1, 0.1, 1.0]],        # (60, 50), inside
                       dtype=torch.float32)
    uv, depth, valid = project_points(pts, torch.eye(4)[None], K[None].float(), IMG_HW)
    assert valid[0].tolist() == [False, False, False, True, False, False, True]
    assert torch.isfinite(uv[0, 0]).all()  # no inf from dividing by z <= 0
    torch.testing.assert_close(uv[0, 6], torch.tensor([60.0, 50.0]))


def test_bucketing_pads_with_nan_and_truncates() -> None:
    pts = np.arange(30, dtype=np.float32).reshape(10, 3)
    padded, n_valid, n_trunc = bucket_points(pts)
    assert padded.shape == (16384, 3) and padded.dtype == np.float32
    assert (n_valid, n_trunc) == (10, 0)
    np.testing.assert_array_equal(padded[:10], pts)
    assert np.isnan(padded[10:]).all()
    assert bucket_points(np.zeros((16384, 3), np.float32))[0].shape == (16384, 3)
    assert bucket_points(np.zeros((16385, 3), np.float32))[0].shape == (32768, 3)
    big, n_valid, n_trunc = bucket_points(np.ones((140_000, 3), np.float32))
    assert big.shape == (131072, 3) and (n_valid, n_trunc) == (131072, 140_000 - 131072)
    assert not np.isnan(big).any()
    t, n_valid, n_trunc = bucket_points(torch.ones(5, 3, dtype=torch.float64), buckets=(4, 8))
    assert isinstance(t, torch.Tensor) and t.shape == (8, 3) and t.dtype == torch.float64
    assert (n_valid, n_trunc) == (5, 0) and torch.isnan(t[5:]).all()
    with pytest.raises(ValueError, match="'buckets'"):
        bucket_points(pts, buckets=())


def test_a_cloud_past_the_largest_bucket_is_subsampled_over_the_whole_scan() -> None:
    """Rows i = 0..N-1 with x = i: the kept rows span the whole cloud (first 0, last near
    N-1, evenly spaced, in order), not its first Nb rows; numpy and torch agree."""
    n = 1000
    pts = np.stack([np.arange(n, dtype=np.float32)] * 3, axis=1)
    out, kept, cut = bucket_points(pts, buckets=(64, 256))
    assert out.shape == (256, 3) and (kept, cut) == (256, 744)
    x = out[:, 0]
    assert x[0] == 0 and x[-1] > 0.99 * (n - 1) - n / 256
    assert np.all(np.diff(x) >= 3) and np.all(np.diff(x) <= 4)  # n / 256 = 3.9 apart
    t, kept_t, cut_t = bucket_points(torch.from_numpy(pts), buckets=(64, 256))
    assert (kept_t, cut_t) == (kept, cut)
    np.testing.assert_array_equal(t.numpy(), out)


def _cam1_points_to_base(u: torch.Tensor, v: torch.Tensor, z: float) -> torch.Tensor:
    """Pixels (u, v) [N] of camera 1 at depth z m -> base-frame points [N,3]."""
    p_cam = torch.stack([(u - 50) / 100 * z, (v - 40) / 100 * z, torch.full_like(u, z)], dim=1)
    T_base_from_cam = torch.linalg.inv(t_cam1_from_base())
    return p_cam @ T_base_from_cam[:3, :3].T + T_base_from_cam[:3, 3]


def _object_scene(n_obj: int, n_outliers: int) -> torch.Tensor:
    """Base-frame points [N,3] seen by camera 1: n_obj on a plane at 3 m covering pixels
    [40,80]x[30,50], n_outliers in that region at 10 m and as many at 1 m, and a wall at 10 m
    on a 4 px grid everywhere outside the region [36,84]x[26,54]."""
    g = torch.Generator().manual_seed(0)

    def region(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.rand(n, generator=g, dtype=torch.float64) * 40 + 40,
                torch.rand(n, generator=g, dtype=torch.float64) * 20 + 30)

    gu, gv = torch.meshgrid(torch.arange(0, 100, 4.0, dtype=torch.float64),
                            torch.arange(0, 80, 4.0, dtype=torch.float64), indexing="ij")
    gu, gv = gu.flatten(), gv.flatten()
    out = ~((gu >= 36) & (gu <= 84) & (gv >= 26) & (gv <= 54))
    return torch.cat([_cam1_points_to_base(*region(n_obj), 3.0),
                      _cam1_points_to_base(*region(n_outliers), 10.0),
                      _cam1_points_to_base(*region(n_outliers), 1.0),
                      _cam1_points_to_base(gu[out], gv[out], 10.0)])


def test_box_position_from_lidar_median() -> None:
    pts = _object_scene(n_obj=51, n_outliers=20)
    T = t_cam1_from_base()
    uv, depth, valid = project_points(pts, T[None], K[None], IMG_HW)
    box = torch.tensor([40.0, 30, 80, 50])  # 51 points at 3 m, 20 at 10 m, 20 at 1 m
    pos, src = box_position(box, uv[0], depth[0], valid[0], None, K, T, min_points=5)
    assert src == PositionSource.LIDAR
    # centre (60, 40) at z = 3 in camera 1 -> cam (0.3, 0, 3) -> base (3, -0.3, 1)
    torch.testing.assert_close(pos, torch.tensor([3.0, -0.3, 1.0], dtype=torch.float64))


def test_box_position_falls_back_to_predicted_depth_then_none() -> None:
    pts = _object_scene(n_obj=4, n_outliers=0)  # too few points inside the box
    T = t_cam1_from_base()
    uv, depth, valid = project_points(pts, T[None], K[None], IMG_HW)
    box = torch.tensor([40.0, 30, 80, 50])
    inside = ((uv[0, :, 0] >= 40) & (uv[0, :, 0] <= 80) & (uv[0, :, 1] >= 30)
              & (uv[0, :, 1] <= 50) & valid[0])
    assert int(inside.sum()) == 4 and int(valid[0].sum()) > 100
    depth_map = torch.full(IMG_HW, 8.0)
    depth_map[30:51, 40:81] = 2.0
    pos, src = box_position(box, uv[0], depth[0], valid[0], depth_map, K, T, min_points=5)
    assert src == PositionSource.PREDICTED_DEPTH
    # centre (60, 40) at z = 2 -> cam (0.2, 0, 2) -> base (2, -0.2, 1)
    torch.testing.assert_close(pos, torch.tensor([2.0, -0.2, 1.0], dtype=torch.float64))
    none_pos, none_src = box_position(box, uv[0], depth[0], valid[0], None, K, T)
    assert none_src == PositionSource.NONE and none_pos is None


def test_box_positions_batch_and_empty_cloud() -> None:
    T = torch.eye(4, dtype=torch.float64)
    depth_map = torch.full(IMG_HW, 5.0)
    boxes = torch.tensor([[0.0, 0, 100, 80], [50, 40, 50, 40]])  # 2nd: empty box
    empty = torch.zeros((0, 2))
    pos, src = box_positions(boxes, empty, empty[:, 0], empty[:, 0].bool(), depth_map, K, T)
    assert src.tolist() == [int(PositionSource.PREDICTED_DEPTH), int(PositionSource.NONE)]
    torch.testing.assert_close(pos[0], torch.tensor([0.0, 0.0, 5.0], dtype=torch.float64))
    assert torch.isnan(pos[1]).all()
    pos0, src0 = box_positions(torch.zeros((0, 4)), empty, empty[:, 0], empty[:, 0].bool(),
                               depth_map, K, T)
    assert pos0.shape == (0, 3) and src0.shape == (0,)


def test_lidar_median_equals_numpy_lower_median() -> None:
    g = torch.Generator().manual_seed(5)
    n = 3000
    uv = torch.rand(n, 2, generator=g) * torch.tensor([100.0, 80.0])
    depth = torch.rand(n, generator=g) * 9 + 1
    valid = torch.rand(n, generator=g) > 0.2
    xy = torch.rand(40, 2, generator=g) * torch.tensor([90.0, 70.0])
    boxes = torch.cat([xy, xy + torch.rand(40, 2, generator=g) * 30 + 0.5], dim=1)
    T = torch.eye(4, dtype=torch.float64)
    pos, src = box_positions(boxes, uv, depth, valid, None, K, T, min_points=3)
    u, v, z, ok = uv[:, 0].numpy(), uv[:, 1].numpy(), depth.numpy(), valid.numpy()
    checked = 0
    for i, (x1, y1, x2, y2) in enumerate(boxes.tolist()):
        sel = np.sort(z[ok & (u >= x1) & (u <= x2) & (v >= y1) & (v <= y2)])
        if sel.size >= 3:
            assert src[i] == PositionSource.LIDAR
            assert pos[i, 2].item() == pytest.approx(float(sel[(sel.size - 1) // 2]))
            checked += 1
        else:
            assert src[i] == PositionSource.NONE
    assert checked > 20
