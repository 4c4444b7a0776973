"""LiDAR <-> camera geometry: batched projection, static-shape bucketing, 3D box positions
(the box rule here; the support rule for objects on a table in support.py).

Conventions: points are in the base (or world) frame, m. T_cam_from_base [4,4] maps base
coordinates to the camera optical frame (x right, y down, z forward). K [3,3] is the pinhole
matrix of the (rectified) image; pixel (0, 0) is the centre of the top-left pixel, so a
projection is inside an image of size (H, W) when -0.5 <= u < W - 0.5 and -0.5 <= v < H - 0.5.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np
import torch

from kestrel_models.perception import box_median_triton as _bmt
from kestrel_models.perception.compiled import compiled
from kestrel_models.perception.support import (
    TOP_QUANTILES,
    centre_depth,
    class_lanes,
    is_support,
    point_classes,
    support_heights,
    top_height,
)

DEFAULT_BUCKETS: tuple[int, ...] = (16384, 32768, 65536, 131072)
DEFAULT_SUPPORT_TOLERANCE = 0.01  # m, support rule: points up to this above h_s are support
# static medians on CUDA with triton importable run the Triton kernel (box_median_triton.py,
# same values as the torch path); False forces the torch path (tests, benchmarks)
USE_TRITON: bool = True


class PositionSource(IntEnum):
    """Where a detection's 3D position came from (= Detection2D.POSITION_* constants)."""

    NONE = 0
    LIDAR = 1
    PREDICTED_DEPTH = 2


def project_points(points_xyz: torch.Tensor, T_cam_from_base: torch.Tensor, K: torch.Tensor,
                   image_hw: tuple[int, int], min_depth: float = 1e-3, compile: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Project N points into C cameras in one batched op (compile=True: one fused kernel,
    `_project_elementwise`, same values up to float64 rounding).

    points_xyz: [N,3] m (base frame; NaN rows allowed, e.g. bucket padding, they are invalid)
    T_cam_from_base: [C,4,4]; K: [C,3,3]; image_hw: (H, W) px, shared by the cameras.
    Returns uv [C,N,2] px, depth [C,N] m (z in the camera frame), valid [C,N] bool: finite,
    in front of the camera (z > min_depth) and inside the image.
    """
    if compile:
        return compiled(_project_elementwise)(points_xyz, T_cam_from_base, K, image_hw,
                                              min_depth)
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


def _project_elementwise(points_xyz: torch.Tensor, T_cam_from_base: torch.Tensor,
                         K: torch.Tensor, image_hw: tuple[int, int], min_depth: float
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`project_points` written as per-coordinate multiply-adds: compiled, one fused kernel
    (the einsum form runs as two [C,N,3] float64 GEMMs with K = 3, slow for their size)."""
    dt = T_cam_from_base.dtype
    x, y, zb = (points_xyz[:, i].to(dt)[None] for i in range(3))  # each [1,N]
    T, Kd = T_cam_from_base[:, :3, :, None], K.to(dt)[..., None]  # [C,3,4,1], [C,3,3,1]
    pc = [T[:, i, 0] * x + T[:, i, 1] * y + T[:, i, 2] * zb + T[:, i, 3] for i in range(3)]
    z = pc[2]  # [C,N] m, camera frame
    front = z > min_depth  # False for NaN
    safe_z = torch.where(front, z, torch.ones_like(z))  # no division by ~0 / negative z
    u = (Kd[:, 0, 0] * pc[0] + Kd[:, 0, 1] * pc[1] + Kd[:, 0, 2] * z) / safe_z
    v = (Kd[:, 1, 0] * pc[0] + Kd[:, 1, 1] * pc[1] + Kd[:, 1, 2] * z) / safe_z
    h, w = image_hw
    valid = front & (u >= -0.5) & (u < w - 0.5) & (v >= -0.5) & (v < h - 0.5)
    return torch.stack([u, v], dim=2), z, valid


def bucket_size(n: int, buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> int:
    """Smallest bucket >= n, or the largest bucket when n exceeds them all."""
    for b in sorted(buckets):
        if b >= n:
            return b
    return max(buckets)


def bucket_points(points: np.ndarray | torch.Tensor, buckets: tuple[int, ...] = DEFAULT_BUCKETS
                  ) -> tuple[np.ndarray | torch.Tensor, int, int]:
    """Pad (with NaN) or subsample points [N,3] to a fixed bucket size so shapes stay static.

    Returns (padded [Nb,3] of the input's type/dtype/device, valid_count, truncated_count):
    rows [0, valid_count) are input rows in their order, the rest NaN. A cloud larger than
    the largest bucket keeps rows evenly spread over all N (row floor(i * N / Nb)), not its
    first Nb: an organised or time-ordered cloud's first rows are one part of the scan, and
    boxes elsewhere would lose their LiDAR points. truncated_count rows were left out.
    """
    if not buckets or min(buckets) <= 0:
        raise ValueError(f"parameter 'buckets' = {buckets!r}: must be positive sizes")
    n = int(points.shape[0])
    nb = bucket_size(n, buckets)
    keep = min(n, nb)
    if isinstance(points, torch.Tensor):
        out_t = torch.full((nb, 3), float("nan"), dtype=points.dtype, device=points.device)
        if keep < n:
            idx = torch.arange(keep, device=points.device, dtype=torch.int64) * n // keep
            out_t[:keep] = points[idx]
        else:
            out_t[:keep] = points[:keep]
        return out_t, keep, n - keep
    out = np.full((nb, 3), np.nan, dtype=points.dtype)
    out[:keep] = points[np.arange(keep, dtype=np.int64) * n // keep] if keep < n \
        else points[:keep]
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
                  T_cam_from_base: torch.Tensor, min_points: int = 5, *,
                  heights: torch.Tensor | None = None, class_map: torch.Tensor | None = None,
                  box_class: torch.Tensor | None = None, support_classes: tuple[int, ...] = (),
                  support_tolerance: float = DEFAULT_SUPPORT_TOLERANCE
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """3D positions of D boxes of one camera.

    boxes [D,4] xyxy px; uv [N,2], depth [N], valid [N]: this camera's `project_points`
    output (N may be 0); depth_map [H,W] m predicted depth, or None; K [3,3]; T [4,4].
    Box rule: depth of a box = (lower) median LiDAR depth of the valid projections inside the
    box when there are >= min_points of them, else the median predicted depth inside the box,
    else none. The box centre is back-projected at that depth and moved to the base frame.
    Support rule (support.py), with heights [N] m (base-frame z of the points), class_map
    [H,W] (segmentation class per pixel), box_class [D] and support_classes (class indices)
    all given: where the camera sees a support plane, a box whose class is not a support
    class gets the object centre from its own points above the plane (>= min_points of
    them), else the predicted depth, else none; the other boxes keep the box rule.
    Returns positions [D,3] m (NaN where none) and sources [D] int64 (PositionSource).
    """
    dt = torch.float64
    boxes, K, T = boxes.to(dt), K.to(dt), T_cam_from_base.to(dt)
    d = boxes.shape[0]
    z = torch.full((d,), float("nan"), dtype=dt, device=boxes.device)
    src = torch.full((d,), int(PositionSource.NONE), dtype=torch.long, device=boxes.device)
    if d == 0:
        return torch.zeros((0, 3), dtype=dt, device=boxes.device), src
    rule = torch.zeros(d, dtype=torch.bool, device=boxes.device)  # boxes under the support rule
    if heights is not None and class_map is not None and box_class is not None and \
            support_classes and uv.shape[0] > 0:
        rule = _support_rule_one_camera(boxes, uv, depth, valid, K, T, min_points, heights,
                                        class_map, box_class, support_classes,
                                        support_tolerance, z, src)
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
            use = (count >= max(1, min_points)) & ~rule[s:s + chunk]
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


def _support_rule_one_camera(boxes: torch.Tensor, uv: torch.Tensor, depth: torch.Tensor,
                             valid: torch.Tensor, K: torch.Tensor, T: torch.Tensor,
                             min_points: int, heights: torch.Tensor, class_map: torch.Tensor,
                             box_class: torch.Tensor, support_classes: tuple[int, ...],
                             tol: float, z: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """`box_positions`' support rule, box by box (the reference of the batched form): fills
    z [D] / src [D] in place where the object has enough points; returns the [D] bool mask of
    the boxes under the rule."""
    d = boxes.shape[0]
    rule = torch.zeros(d, dtype=torch.bool, device=boxes.device)
    pc = point_classes(class_map[None], uv[None], valid[None])[0]  # [N]
    hs, ok = support_heights(heights, pc[None], support_classes, tol, min_points)
    if not bool(ok[0]):
        return rule
    hz = heights.float()
    above = valid & (hz > hs[0] + tol)
    u, v = uv[:, 0].float(), uv[:, 1].float()
    bx = boxes.float()
    sup = is_support(box_class.long(), support_classes)
    T_base = torch.linalg.inv(T)
    for i in range(d):
        if bool(sup[i]):
            continue
        rule[i] = True
        x1, y1, x2, y2 = bx[i]
        obj = above & (pc == int(box_class[i])) & (u >= x1) & (u <= x2) & (v >= y1) & (v <= y2)
        n = int(obj.sum())
        if n < max(1, min_points):
            continue
        k = (n + 1) // 2 - 1  # lower median
        srt = hz[obj].sort().values
        q = [srt[int(_bmt.quantile_rank(torch.tensor(n), f)) - 1] for f in TOP_QUANTILES]
        h_top = top_height(*q, tol)
        z_surf = depth[obj].float().sort().values[k]
        z[i] = centre_depth(boxes[i:i + 1][None], h_top.reshape(1, 1), hs, z_surf.reshape(1, 1),
                            torch.linalg.inv(K)[None], T_base[None])[0, 0]
        src[i] = int(PositionSource.LIDAR)
    return rule


def box_position(box_xyxy: torch.Tensor, uv: torch.Tensor, depth: torch.Tensor,
                 valid: torch.Tensor, depth_map: torch.Tensor | None, K: torch.Tensor,
                 T_cam_from_base: torch.Tensor, min_points: int = 5
                 ) -> tuple[torch.Tensor | None, PositionSource]:
    """One box [4] -> (position (3,) m in the base frame or None, PositionSource)."""
    pos, src = box_positions(box_xyxy.reshape(1, 4), uv, depth, valid, depth_map, K,
                             T_cam_from_base, min_points)
    source = PositionSource(int(src[0]))
    return (None if source == PositionSource.NONE else pos[0]), source


def _lower_median_in_boxes(z: torch.Tensor, u: torch.Tensor, v: torch.Tensor,
                           ok: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                           chunk_elems: int, quantile: float = 0.5
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Lower median (or lower `quantile`) of the values z inside boxes, for C groups at once,
    no host sync.

    z, u, v [C,N] float32 (value, x, y), ok [C,N] bool (usable), lo/hi [C,D,2] float32: the
    inclusive box lo <= (u, v) <= hi. Returns (median [C,D] float32, count [C,D] int64);
    the median is meaningless where count == 0. See `_quantiles_in_boxes`.
    """
    med, cnt = _quantiles_in_boxes(z, u, v, ok, lo, hi, chunk_elems, (quantile,))
    return med[0], cnt


def _quantiles_in_boxes(z: torch.Tensor, u: torch.Tensor, v: torch.Tensor, ok: torch.Tensor,
                        lo: torch.Tensor, hi: torch.Tensor, chunk_elems: int,
                        quantiles: tuple[float, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """`_lower_median_in_boxes` for several lower quantiles -> (values [Q,C,D], count [C,D]).
    Values are sorted once per group; per box and quantile the result is where the running
    count of inside values reaches `quantile_rank(count, q)` (ceil(count / 2) for the
    median). Static chunks over D bound the [C, d, N] masks to about `chunk_elems` entries.
    """
    c, n = z.shape
    d = lo.shape[1]
    zs, order = torch.where(ok, z, torch.full_like(z, float("inf"))).sort(dim=1)  # [C,N]
    us, vs, oks = u.gather(1, order), v.gather(1, order), ok.gather(1, order)
    out = torch.empty((len(quantiles), c, d), dtype=z.dtype, device=z.device)
    cnt = torch.empty((c, d), dtype=torch.long, device=z.device)
    step = max(1, chunk_elems // max(1, c * n))
    for s in range(0, d, step):
        lo_c, hi_c = lo[:, s:s + step], hi[:, s:s + step]  # [C,d,2]
        inside = (oks[:, None] & (us[:, None] >= lo_c[..., 0:1]) & (us[:, None] <= hi_c[..., 0:1])
                  & (vs[:, None] >= lo_c[..., 1:2]) & (vs[:, None] <= hi_c[..., 1:2]))  # [C,d,N]
        count = inside.sum(dim=2)  # [C,d]
        rank = inside.cumsum(dim=2, dtype=torch.int32)
        for i, q in enumerate(quantiles):
            k = _bmt.quantile_rank(count, q)
            first = (rank >= k[..., None]).to(torch.uint8).argmax(dim=2)
            out[i, :, s:s + step] = zs.gather(1, first)
        cnt[:, s:s + step] = count
    return out, cnt


def box_positions_batched(boxes: torch.Tensor, box_valid: torch.Tensor, uv: torch.Tensor,
                          depth: torch.Tensor, valid: torch.Tensor,
                          depth_map: torch.Tensor | None, K_inv: torch.Tensor,
                          T_base_from_cam: torch.Tensor, min_points: int = 5,
                          chunk_elems: int = 1 << 24, static: bool = True,
                          compile: bool = False, *, heights: torch.Tensor | None = None,
                          seg: torch.Tensor | None = None, box_class: torch.Tensor | None = None,
                          support_classes: tuple[int, ...] = (),
                          support_tolerance: float = DEFAULT_SUPPORT_TOLERANCE
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """`box_positions` for all C cameras x D detection slots at once, no host sync.

    boxes [C,D,4] xyxy px, box_valid [C,D] bool (unused slots get NONE); uv [C,N,2] px,
    depth [C,N] m, valid [C,N] bool (`project_points` output, N may be 0); depth_map [C,H,W] m
    or None; K_inv [C,3,3] (inverse intrinsics), T_base_from_cam [C,4,4] m.
    Same rules as `box_positions`: lower median LiDAR depth of the valid projections inside the
    box (inclusive edges) when >= min_points of them, else the lower nan-median of the
    predicted depth over the box's pixel rectangle [floor(x1), ceil(x2)) x [floor(y1), ceil(y2)),
    if finite and > 0; the box centre back-projected at that depth into the base frame.
    Support rule (support.py) with heights [N] m (base-frame z of the points), seg [C,K,H,W]
    class logits (or [C,H,W] classes), box_class [C,D] and support_classes all given; its
    object medians run through the same median paths, each class in a lane of its own
    (`support.class_lanes`).
    Returns positions [C,D,3] float64 m (NaN where none), sources [C,D] int64 PositionSource.
    static=False (for the CPU, where reading a value is no device sync): the LiDAR medians run
    per camera over its valid projections only and the predicted-depth medians only for the
    boxes that need them, each over its own pixel rectangle (host loops, data-dependent
    shapes); static=True costs O(C * D * (N + H * W)) but reads nothing on the host, or,
    on CUDA with triton (USE_TRITON), one radix-select kernel per source: O(C * D * N) for the
    LiDAR and O(box area) per box for the depth map, skipping the slots not needed.
    compile=True (with static): the element-wise steps between the medians run
    torch.compile'd (compiled.py; same math, a few fused kernels).
    """
    dt = torch.float64
    c, d = boxes.shape[:2]
    dev = boxes.device
    n = uv.shape[1]
    on = compile and static  # the element-wise steps compiled (compiled.py)
    bf = boxes.float()
    triton = static and USE_TRITON and _bmt.available(boxes)
    rule = None  # [C,D] bool: the slots under the support rule
    if d > 0 and n > 0 and heights is not None and seg is not None and box_class is not None \
            and support_classes:
        pc = point_classes(seg, uv, valid)  # [C,N]
        hs, plane = support_heights(heights, pc, support_classes, support_tolerance,
                                    min_points)
        rule = box_valid & plane[:, None] & ~is_support(box_class.long(), support_classes)
    box_rule = box_valid if rule is None else box_valid & ~rule
    med = count = None
    if d > 0 and n > 0:
        med, count = _box_medians(depth, uv, valid, bf, box_rule, static, triton, chunk_elems)
    z, src = compiled(_lidar_choice, on)(med, count, box_rule, min_points)
    if rule is not None:  # the object's own points above the support (lane per class)
        hz = heights.float()[None].expand(c, n)
        above = valid & (hz > hs[:, None] + support_tolerance)
        uvl, bl = class_lanes(uv, pc, boxes, box_class, seg.shape[-1])
        hq, n_obj = _box_quantiles(hz, uvl, above, bl, rule, static, triton, chunk_elems,
                                   TOP_QUANTILES)
        h_top = top_height(hq[0], hq[1], hq[2], support_tolerance)
        z_surf, _ = _box_medians(depth, uvl, above, bl, rule, static, triton, chunk_elems)
        use = rule & (n_obj >= max(1, min_points))
        zc = centre_depth(boxes, h_top, hs, z_surf, K_inv, T_base_from_cam)
        z = torch.where(use, zc, z)
        src = torch.where(use, int(PositionSource.LIDAR), src)
    if d > 0 and depth_map is not None:
        h, w = depth_map.shape[-2:]
        if triton:  # only each needed box's own pixel rectangle is read
            need = box_valid & (src == int(PositionSource.NONE))
            rects = compiled(_bmt.pixel_rects, on)(boxes, h, w)
            med, count = _bmt.depth_box_medians(depth_map, rects, need)
        else:
            b64 = boxes.to(dt)
            c0 = b64[..., 0].floor().clamp(min=0)
            c1 = b64[..., 2].ceil().clamp(max=w)
            r0 = b64[..., 1].floor().clamp(min=0)
            r1 = b64[..., 3].ceil().clamp(max=h)
        if static and not triton:  # every pixel is a "point" (x, y, depth); one [C, d, H*W]
            # pass per chunk
            lo = torch.stack([c0, r0], dim=2).float()
            hi = torch.stack([c1 - 1, r1 - 1], dim=2).float()  # integer px: < c1 <=> <= c1-1
            rows = torch.arange(h, device=dev, dtype=torch.float32)
            cols = torch.arange(w, device=dev, dtype=torch.float32)
            pu = cols.repeat(h)[None].expand(c, -1)  # [C,HW] pixel x
            pv = rows.repeat_interleave(w)[None].expand(c, -1)  # [C,HW] pixel y
            dm = depth_map.reshape(c, h * w).float()
            med, count = _lower_median_in_boxes(dm, pu, pv, ~dm.isnan(), lo, hi, chunk_elems)
        elif not static:  # host loop over the boxes without a LiDAR position (the previous
            # CPU path): nan-median over each box's own pixel rectangle, O(box area)
            med = torch.full((c, d), float("nan"), dtype=torch.float32, device=dev)
            count = torch.zeros((c, d), dtype=torch.long, device=dev)
            need = box_valid & (src == int(PositionSource.NONE))
            for cam, k in need.nonzero().tolist():
                x0, y0, x1, y1 = (int(t) for t in (c0[cam, k], r0[cam, k], c1[cam, k],
                                                   r1[cam, k]))
                if x1 > x0 and y1 > y0:
                    med[cam, k] = torch.nanmedian(depth_map[cam, y0:y1, x0:x1].reshape(-1))
                    count[cam, k] = 1
        z, src = compiled(_depth_choice, on)(z, src, med, count, box_valid)
    return compiled(_backproject, on)(boxes, z, K_inv, T_base_from_cam), src


def _box_medians(values: torch.Tensor, uv: torch.Tensor, ok: torch.Tensor, boxes: torch.Tensor,
                 need: torch.Tensor, static: bool, triton: bool, chunk_elems: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Lower median of values [C,N] over the ok [C,N] points with uv [C,N,2] inside each box
    [C,D,4] (inclusive) -> (median [C,D] float32, count [C,D] int64); `_box_quantiles`."""
    med, count = _box_quantiles(values, uv, ok, boxes, need, static, triton, chunk_elems,
                                (0.5,))
    return med[0], count


def _box_quantiles(values: torch.Tensor, uv: torch.Tensor, ok: torch.Tensor,
                   boxes: torch.Tensor, need: torch.Tensor, static: bool, triton: bool,
                   chunk_elems: int, quantiles: tuple[float, ...]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Lower `quantiles` of values [C,N] over the ok [C,N] points with uv [C,N,2] inside each
    box [C,D,4] (inclusive) -> (values [Q,C,D] float32, count [C,D] int64), by the path that
    `box_positions_batched` documents, the points sorted (or binned) once for all quantiles.
    need [C,D]: the slots that read the result (the Triton kernel skips the others, the CPU
    path the cameras without one; their count is then 0)."""
    c, d = boxes.shape[:2]
    bf = boxes.float()
    if triton:
        return _bmt.lidar_box_quantiles(values, uv, ok, bf, quantiles, need=need)
    if static:
        return _quantiles_in_boxes(values.float(), uv[..., 0].float(), uv[..., 1].float(), ok,
                                   bf[..., 0:2], bf[..., 2:4], chunk_elems, quantiles)
    out = torch.zeros((len(quantiles), c, d), dtype=torch.float32, device=boxes.device)
    count = torch.zeros((c, d), dtype=torch.long, device=boxes.device)
    for cam in range(c):  # per camera over its ok points only
        idx = ok[cam].nonzero().flatten()
        if idx.numel() and bool(need[cam].any()):
            q = uv[cam, idx].float()
            one = torch.ones((1, idx.numel()), dtype=torch.bool, device=boxes.device)
            mc, cc = _quantiles_in_boxes(values[cam, idx].float()[None], q[None, :, 0],
                                         q[None, :, 1], one, bf[cam:cam + 1, :, 0:2],
                                         bf[cam:cam + 1, :, 2:4], chunk_elems, quantiles)
            out[:, cam], count[cam] = mc[:, 0], cc[0]
    return out, count


def _lidar_choice(med: torch.Tensor | None, count: torch.Tensor | None,
                  box_valid: torch.Tensor, min_points: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Depth z [C,D] float64 m (NaN: none yet) and source [C,D] int64 from the LiDAR medians
    (med [C,D] float32 m, count [C,D]; None: no points or no slots)."""
    z = torch.full(box_valid.shape, float("nan"), dtype=torch.float64, device=box_valid.device)
    src = torch.zeros(box_valid.shape, dtype=torch.long, device=box_valid.device)
    if med is None or count is None:
        return z, src
    use = box_valid & (count >= max(1, min_points))
    z = torch.where(use, med.to(torch.float64), z)
    return z, torch.where(use, int(PositionSource.LIDAR), src)


def _depth_choice(z: torch.Tensor, src: torch.Tensor, med: torch.Tensor, count: torch.Tensor,
                  box_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The predicted-depth median (med [C,D] m, count [C,D]) where the LiDAR gave none."""
    med = med.to(torch.float64)
    use = box_valid & (src == int(PositionSource.NONE)) & (count > 0) & \
        med.isfinite() & (med > 0)
    return torch.where(use, med, z), torch.where(use, int(PositionSource.PREDICTED_DEPTH), src)


def _backproject(boxes: torch.Tensor, z: torch.Tensor, K_inv: torch.Tensor,
                 T_base_from_cam: torch.Tensor) -> torch.Tensor:
    """Box centres (boxes [C,D,4] px) at depth z [C,D] m -> base-frame points [C,D,3] float64
    (NaN rows where z is NaN)."""
    dt = torch.float64
    b64 = boxes.to(dt)
    cu = (b64[..., 0] + b64[..., 2]) * 0.5
    cv = (b64[..., 1] + b64[..., 3]) * 0.5
    pix = torch.stack([cu, cv, torch.ones_like(cu)], dim=2)  # [C,D,3]
    rays = torch.einsum("cij,cdj->cdi", K_inv.to(dt), pix)
    p_cam = rays * z[..., None]
    T = T_base_from_cam.to(dt)
    return torch.einsum("cij,cdj->cdi", T[:, :3, :3], p_cam) + T[:, None, :3, 3]
