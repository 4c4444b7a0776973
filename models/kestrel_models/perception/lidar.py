"""LiDAR <-> camera geometry: batched projection, static-shape bucketing, 3D box positions.

Conventions: points are in the base (or world) frame, m. T_cam_from_base [4,4] maps base
coordinates to the camera optical frame (x right, y down, z forward). K [3,3] is the pinhole
matrix of the (rectified) image; pixel (0, 0) is the centre of the top-left pixel, so a
projection is inside an image of size (H, W) when -0.5 <= u < W - 0.5 and -0.5 <= v < H - 0.5.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np
import torch

DEFAULT_BUCKETS: tuple[int, ...] = (16384, 32768, 65536, 131072)


class PositionSource(IntEnum):
    """Where a detection's 3D position came from (= Detection2D.POSITION_* constants)."""

    NONE = 0
    LIDAR = 1
    PREDICTED_DEPTH = 2


def project_points(points_xyz: torch.Tensor, T_cam_from_base: torch.Tensor, K: torch.Tensor,
                   image_hw: tuple[int, int], min_depth: float = 1e-3
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Project N points into C cameras in one batched op.

    points_xyz: [N,3] m (base frame; NaN rows allowed, e.g. bucket padding, they are invalid)
    T_cam_from_base: [C,4,4]; K: [C,3,3]; image_hw: (H, W) px, shared by the cameras.
    Returns uv [C,N,2] px, depth [C,N] m (z in the camera frame), valid [C,N] bool: finite,
    in front of the camera (z > min_depth) and inside the image.
    """
    pts = points_xyz.to(T_cam_from_base.dtype)
    R, t = T_cam_from_base[:, :3, :3], T_cam_from_base[:, :3, 3]
    pc = torch.einsum("cij,nj->cni", R, pts) + t[:, None, :]  # [C,N,3] camera frame, m
    z = pc[..., 2]
    front = z > min_depth  # False for NaN
    uvw = torch.einsum("cij,cnj->cni", K.to(pc.dtype), pc)  # [C,N,3]
    safe_z = torch.where(front, z, torch.ones_like(z))  # no division by ~0 / negative z
    uv = uvw[..., :2] / safe_z[..., None]
    h, w = image_hw
    u, v = uv[..., 0], uv[..., 1]
    valid = front & (u >= -0.5) & (u < w - 0.5) & (v >= -0.5) & (v < h - 0.5)
    return uv, z, valid


def bucket_size(n: int, buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> int:
    """Smallest bucket >= n, or the largest bucket when n exceeds them all."""
    for b in sorted(buckets):
        if b >= n:
            return b
    return max(buckets)


def bucket_points(points: np.ndarray | torch.Tensor, buckets: tuple[int, ...] = DEFAULT_BUCKETS
                  ) -> tuple[np.ndarray | torch.Tensor, int, int]:
    """Pad (with NaN) or truncate points [N,3] to a fixed bucket size so shapes stay static.

    Returns (padded [Nb,3] of the input's type/dtype/device, valid_count, truncated_count):
    rows [0, valid_count) are the input's first rows, the rest NaN; truncated_count points
    beyond the largest bucket were dropped.
    """
    if not buckets or min(buckets) <= 0:
        raise ValueError(f"parameter 'buckets' = {buckets!r}: must be positive sizes")
    n = int(points.shape[0])
    nb = bucket_size(n, buckets)
    keep = min(n, nb)
    if isinstance(points, torch.Tensor):
        out_t = torch.full((nb, 3), float("nan"), dtype=points.dtype, device=points.device)
        out_t[:keep] = points[:keep]
        return out_t, keep, n - keep
    out = np.full((nb, 3), np.nan, dtype=points.dtype)
    out[:keep] = points[:keep]
    return out, keep, n - keep


def _backproject_to_base(u: torch.Tensor, v: torch.Tensor, z: torch.Tensor, K: torch.Tensor,
                         T_cam_from_base: torch.Tensor) -> torch.Tensor:
    """Pixels (u, v) [D] at depth z [D] m -> base-frame points [D,3] (inverse extrinsic)."""
    pix = torch.stack([u, v, torch.ones_like(u)], dim=1)  # [D,3]
    rays = torch.linalg.solve(K, pix.T).T  # [D,3], z component 1
    p_cam = rays * z[:, None]
    T_base_from_cam = torch.linalg.inv(T_cam_from_base)
    return p_cam @ T_base_from_cam[:3, :3].T + T_base_from_cam[:3, 3]


def box_positions(boxes: torch.Tensor, uv: torch.Tensor, depth: torch.Tensor,
                  valid: torch.Tensor, depth_map: torch.Tensor | None, K: torch.Tensor,
                  T_cam_from_base: torch.Tensor, min_points: int = 5
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """3D positions of D boxes of one camera.

    boxes [D,4] xyxy px; uv [N,2], depth [N], valid [N]: this camera's `project_points`
    output (N may be 0); depth_map [H,W] m predicted depth, or None; K [3,3]; T [4,4].
    Depth of a box = (lower) median LiDAR depth of the valid projections inside the box when
    there are >= min_points of them, else the median predicted depth inside the box, else none.
    The box centre is back-projected at that depth and moved to the base frame.
    Returns positions [D,3] m (NaN where none) and sources [D] int64 (PositionSource).
    """
    dt = torch.float64
    boxes, K, T = boxes.to(dt), K.to(dt), T_cam_from_base.to(dt)
    d = boxes.shape[0]
    z = torch.full((d,), float("nan"), dtype=dt, device=boxes.device)
    src = torch.full((d,), int(PositionSource.NONE), dtype=torch.long, device=boxes.device)
    if d == 0:
        return torch.zeros((0, 3), dtype=dt, device=boxes.device), src
    keep = valid.nonzero().flatten()
    if keep.numel() > 0:
        zs, order = depth[keep].float().sort()  # [M] ascending depth, m
        u, v = uv[keep[order], 0].float(), uv[keep[order], 1].float()  # [M] px
        bx = boxes.float()
        chunk = max(1, (1 << 22) // keep.numel())  # bound the [D, M] masks to ~4M entries
        for s in range(0, d, chunk):
            b = bx[s:s + chunk]
            inside = ((u[None] >= b[:, 0:1]) & (u[None] <= b[:, 2:3])
                      & (v[None] >= b[:, 1:2]) & (v[None] <= b[:, 3:4]))  # [d_chunk, M]
            count = inside.sum(dim=1)  # [d_chunk]
            # lower median without a per-box sort: points are depth-sorted, so it is the
            # point where the running count of inside points reaches ceil(count / 2)
            rank = inside.cumsum(dim=1, dtype=torch.int32)  # [d_chunk, M]
            first = (rank >= ((count + 1) // 2)[:, None]).to(torch.uint8).argmax(dim=1)
            use = count >= max(1, min_points)
            z[s:s + chunk] = torch.where(use, zs[first].to(dt), z[s:s + chunk])
            src[s:s + chunk][use] = int(PositionSource.LIDAR)
    if depth_map is not None:
        h, w = depth_map.shape[-2:]
        for i in torch.nonzero(src == int(PositionSource.NONE)).flatten().tolist():
            x1, y1, x2, y2 = boxes[i].tolist()
            c0, c1 = max(0, int(np.floor(x1))), min(w, int(np.ceil(x2)))
            r0, r1 = max(0, int(np.floor(y1))), min(h, int(np.ceil(y2)))
            if c1 <= c0 or r1 <= r0:
                continue
            # depth_map may live on another device (e.g. the CPU copy of a CUDA output)
            med = float(torch.nanmedian(depth_map[..., r0:r1, c0:c1].reshape(-1)))
            if np.isfinite(med) and med > 0:
                z[i] = med
                src[i] = int(PositionSource.PREDICTED_DEPTH)
    cu = (boxes[:, 0] + boxes[:, 2]) * 0.5
    cv = (boxes[:, 1] + boxes[:, 3]) * 0.5
    pos = _backproject_to_base(cu, cv, z, K, T)  # NaN rows where z is NaN
    return pos, src


def box_position(box_xyxy: torch.Tensor, uv: torch.Tensor, depth: torch.Tensor,
                 valid: torch.Tensor, depth_map: torch.Tensor | None, K: torch.Tensor,
                 T_cam_from_base: torch.Tensor, min_points: int = 5
                 ) -> tuple[torch.Tensor | None, PositionSource]:
    """One box [4] -> (position (3,) m in the base frame or None, PositionSource)."""
    pos, src = box_positions(box_xyxy.reshape(1, 4), uv, depth, valid, depth_map, K,
                             T_cam_from_base, min_points)
    source = PositionSource(int(src[0]))
    return (None if source == PositionSource.NONE else pos[0]), source
