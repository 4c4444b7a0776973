"""Object centres from LiDAR points, for objects resting on a support surface (a table).

Why: the box rule (`lidar.box_positions`: the median depth of every LiDAR point projected into
a detection box) mostly measures what surrounds a small object: the table around it, and
points the camera cannot see that project into the box all the same (the table behind the
object, the floor behind the table). And even the object's own points lie on its visible
surface, not at its centre. The support rule, per camera and detection:

- point class: the segmentation class at each point's nearest pixel (`point_classes`);
- support height h_s: the lower median base-frame height (z) of the points whose class is a
  support class, used only where a horizontal plane is seen there: >= min_points such points,
  at least half of them within `tolerance` of h_s (`support_heights`);
- object points of a detection of class k (k not a support class): the points inside its box
  whose class is k and whose height is above h_s + tolerance. This drops the support seen
  through the mask's edges and whatever the camera cannot see below it;
- centre height h_c = (h_top + h_s) / 2, h_top = the height of the object's top face
  (`top_height`): the lower median of the object points' heights where the quarter of
  them below it lies on a plane at the median, else their upper quartile (a LiDAR above the
  objects sees their top faces, and also the sides of the tall or distant ones). The
  position is where the ray
  through the box centre reaches h_c: the centre of an object standing on the support, as the
  sim's ground truth defines it (the centre of its geoms' bounding box). A ray within about
  10 degrees of horizontal (a height error would move the point far along it) takes the object
  points' lower median depth instead, a point on their visible surface (`centre_depth`).

Conventions as lidar.py; the base frame's z axis points up (REP 103) and the support surface
is horizontal in it. Static shapes, no host reads: usable in the CUDA-graph region.
"""

from __future__ import annotations

import torch

# rays flatter than this (sine of the elevation above the base x-y plane, ~10 deg) take the
# object's surface depth: at 10 deg a 1 mm error of h_c moves the point 5.7 mm along the ray
MIN_RAY_ELEVATION_SIN = 0.17
# the quantiles of the object points' heights that `top_height` reads
TOP_QUANTILES = (0.25, 0.5, 0.75)
LANE_GAP = 8.0  # px between two classes' lanes in `class_lanes`


def point_classes(seg: torch.Tensor, uv: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Class of each projected point's nearest pixel.

    seg: [C,K,H,W] class logits (the argmax is taken at the points only) or [C,H,W] class
    indices; uv [C,N,2] px, valid [C,N] bool (`project_points`). Returns [C,N] int64, -1
    where the projection is not valid.
    """
    c = valid.shape[0]
    h, w = seg.shape[-2:]
    u = torch.where(valid, uv[..., 0], 0).round().clamp(0, w - 1).long()
    v = torch.where(valid, uv[..., 1], 0).round().clamp(0, h - 1).long()
    cam = torch.arange(c, device=valid.device)[:, None]  # [C,1]
    if seg.dim() == 4:  # [C,N,K] logits at the points (any memory layout, no copy of seg)
        cls = seg[cam, :, v, u].argmax(dim=-1)
    else:
        cls = seg[cam, v, u].long()
    return torch.where(valid, cls, -1)


def is_support(classes: torch.Tensor, support_classes: tuple[int, ...]) -> torch.Tensor:
    """classes [...] int64 -> [...] bool: the class is one of support_classes."""
    out = torch.zeros_like(classes, dtype=torch.bool)
    for s in support_classes:
        out |= classes == int(s)
    return out


def support_heights(heights: torch.Tensor, point_class: torch.Tensor,
                    support_classes: tuple[int, ...], tolerance: float, min_points: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Height of the support surface seen by each camera.

    heights [N] m (base-frame z of the points, shared by the cameras; NaN rows allowed),
    point_class [C,N] int64 (`point_classes`). Returns (h_s [C] float32 m: lower median
    height of the support-class points, ok [C] bool: >= min_points of them and at least half
    within `tolerance` m of h_s, i.e. a horizontal plane).
    """
    c, n = point_class.shape
    hz = heights.float()[None].expand(c, n)
    sup = is_support(point_class, support_classes) & hz.isfinite()
    cnt = sup.sum(dim=1)  # [C]
    if n == 0:
        return torch.full((c,), float("nan"), device=hz.device), cnt > 0
    srt = torch.where(sup, hz, torch.full_like(hz, float("inf"))).sort(dim=1).values
    k = ((cnt + 1) // 2 - 1).clamp(min=0)
    hs = srt.gather(1, k[:, None])[:, 0]  # inf where cnt == 0
    near = (sup & ((hz - hs[:, None]).abs() <= tolerance)).sum(dim=1)
    return hs, (cnt >= max(1, min_points)) & (2 * near >= cnt)


def class_lanes(uv: torch.Tensor, point_class: torch.Tensor, boxes: torch.Tensor,
                box_class: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Points and boxes moved to one horizontal lane per class, so that the plain box test
    (`lidar._lower_median_in_boxes`, the Triton box medians) keeps only a box's own class.

    uv [C,N,2] px, point_class [C,N] (-1: any lane, such points must be excluded by the
    caller's valid mask), boxes [C,D,4] xyxy px, box_class [C,D]; width: image width, px.
    x of class k moves by k * (width + LANE_GAP); box x edges are clipped to [-1, width]
    first (in-image points keep their inside test), so lanes never overlap.
    Returns (uv [C,N,2] float64, boxes [C,D,4] float64).
    """
    step = float(width) + LANE_GAP
    dt = torch.float64
    lp = point_class.clamp(min=0).to(dt) * step
    uvl = torch.stack([uv[..., 0].to(dt) + lp, uv[..., 1].to(dt)], dim=-1)
    b = boxes.to(dt)
    lb = box_class.clamp(min=0).to(dt) * step
    bl = torch.stack([b[..., 0].clamp(-1.0, float(width)) + lb, b[..., 1],
                      b[..., 2].clamp(-1.0, float(width)) + lb, b[..., 3]], dim=-1)
    return uvl, bl


def top_height(q25: torch.Tensor, q50: torch.Tensor, q75: torch.Tensor, tolerance: float
               ) -> torch.Tensor:
    """Height of an object's top face from the lower quartile, median and upper quartile of
    its points' heights (m, any shape, TOP_QUANTILES): the median where the quarter of the
    points below it lies within tolerance / 2 of it (a plane at the median: the top face seen
    from above; whatever lies above it, such as an arm over the object whose points take the
    object's class at a mask edge, is ignored), else the upper quartile (the median is on a
    side: an object far from the LiDAR, or taller than it is wide, shows it more of its
    side than of its top, and that median sits centimetres below the top)."""
    return torch.where(q50 - q25 <= 0.5 * tolerance, q50, q75)


def centre_depth(boxes: torch.Tensor, h_top: torch.Tensor, h_s: torch.Tensor,
                 z_surface: torch.Tensor, K_inv: torch.Tensor, T_base_from_cam: torch.Tensor
                 ) -> torch.Tensor:
    """Camera depth (z, m) of the point on each box centre's ray at height (h_top + h_s) / 2.

    boxes [C,D,4] xyxy px, h_top [C,D] m, h_s [C] m, z_surface [C,D] m (used for rays within
    asin(MIN_RAY_ELEVATION_SIN) of horizontal and where the height is behind the camera),
    K_inv [C,3,3], T_base_from_cam [C,4,4]. Returns [C,D] float64.
    """
    dt = torch.float64
    b = boxes.to(dt)
    cu, cv = (b[..., 0] + b[..., 2]) * 0.5, (b[..., 1] + b[..., 3]) * 0.5
    pix = torch.stack([cu, cv, torch.ones_like(cu)], dim=-1)  # [C,D,3]
    rays = torch.einsum("cij,cdj->cdi", K_inv.to(dt), pix)  # camera frame, z = 1
    T = T_base_from_cam.to(dt)
    d = torch.einsum("cij,cdj->cdi", T[:, :3, :3], rays)  # base frame direction
    h_c = (h_top.to(dt) + h_s.to(dt)[:, None]) * 0.5
    t = (h_c - T[:, None, 2, 3]) / d[..., 2]  # ray parameter; inf / NaN where d_z == 0
    steep = d[..., 2].abs() >= MIN_RAY_ELEVATION_SIN * d.norm(dim=-1)
    use = steep & (t > 0)
    return torch.where(use, t * rays[..., 2], z_surface.to(dt))
