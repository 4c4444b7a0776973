"""LiDAR positions of objects on a table (perception/support.py, the support rule of
lidar.box_positions / box_positions_batched): a ray-cast tabletop scene shaped like the sim's
(table top at z = 0.40 m, a LiDAR above it, a camera looking down at ~40 deg), the object's
centre within 1 cm where the box median is centimetres off, and the batched paths equal to
the per-camera reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kestrel_models.perception import PositionSource, box_positions, lidar, project_points
from kestrel_models.perception.lidar import box_positions_batched
from kestrel_models.perception.support import (
    TOP_QUANTILES,
    centre_depth,
    class_lanes,
    point_classes,
    support_heights,
    top_height,
)

torch.set_num_threads(1)

TABLE, CUBE, TALL = 1, 2, 4  # class indices (the sim's: table, red_cube, blue_cylinder)
TABLE_Z = 0.40  # m, top surface
TABLE_XY = ((0.20, 0.90), (-0.50, 0.50))  # m, x and y extent of the top
H, W = 96, 128  # px
K = np.array([[103.0, 0.0, 63.5], [0.0, 103.0, 47.5], [0.0, 0.0, 1.0]])  # ~50 deg vertical
# objects: (class, centre m, half extents m); the centre is the sim's ground truth (the centre
# of the geoms' bounding box)
CUBE_AT = (CUBE, (0.47, 0.12, TABLE_Z + 0.025), (0.025, 0.025, 0.025))
TALL_AT = (TALL, (0.62, -0.15, TABLE_Z + 0.04), (0.025, 0.025, 0.04))


def look_at(eye, target) -> np.ndarray:
    """T_cam_from_base [4,4] of a camera at `eye` looking at `target` (optical frame: x
    right, y down, z forward; base z up)."""
    eye, target = np.asarray(eye, float), np.asarray(target, float)
    z = target - eye
    z /= np.linalg.norm(z)
    x = np.cross(z, [0.0, 0.0, 1.0])
    x /= np.linalg.norm(x)
    y = np.cross(z, x)
    T = np.eye(4)
    T[:3, :3] = np.stack([x, y, z])
    T[:3, 3] = -T[:3, :3] @ eye
    return T


CAM_EYE = (1.35, 0.0, 1.05)  # the sim's camera
T_CAM = look_at(CAM_EYE, (0.58, 0.0, 0.40))
T_CAM2 = look_at((0.55, -0.80, 0.95), (0.55, 0.0, 0.40))  # a second camera, from the side


def cast(origin: np.ndarray, dirs: np.ndarray, objects) -> tuple[np.ndarray, np.ndarray]:
    """Rays from origin [3] along dirs [R,3] against the floor (z = 0, class 0), the table top
    and the objects' boxes: (distance along the ray [R] (inf: no hit), class [R])."""
    best = np.full(len(dirs), np.inf)
    cls = np.zeros(len(dirs), np.int64)
    with np.errstate(divide="ignore", invalid="ignore"):
        for z0, bounds, k in ((0.0, None, 0), (TABLE_Z, TABLE_XY, TABLE)):
            t = (z0 - origin[2]) / dirs[:, 2]
            p = origin + t[:, None] * dirs
            ok = t > 1e-9
            if bounds is not None:
                ok &= (p[:, 0] >= bounds[0][0]) & (p[:, 0] <= bounds[0][1])
                ok &= (p[:, 1] >= bounds[1][0]) & (p[:, 1] <= bounds[1][1])
            hit = ok & (t < best)
            best[hit], cls[hit] = t[hit], k
        for k, c, half in objects:  # slab test
            lo = (np.asarray(c) - half - origin) / dirs
            hi = (np.asarray(c) + half - origin) / dirs
            t0 = np.nanmax(np.minimum(lo, hi), axis=1)
            t1 = np.nanmin(np.maximum(lo, hi), axis=1)
            hit = (t0 <= t1) & (t0 > 1e-9) & (t0 < best)
            best[hit], cls[hit] = t0[hit], k
    return best, cls


def class_map(T_cam_from_base: np.ndarray, objects) -> np.ndarray:
    """[H,W] class of every pixel (ray through its centre), as a segmentation would give."""
    v, u = np.mgrid[0:H, 0:W]
    pix = np.stack([u.ravel(), v.ravel(), np.ones(H * W)], axis=1).astype(float)
    T_base = np.linalg.inv(T_cam_from_base)
    dirs = (np.linalg.solve(K, pix.T).T) @ T_base[:3, :3].T
    return cast(T_base[:3, 3], dirs, objects)[1].reshape(H, W)


def lidar_scan(objects, rings: int = 32, azimuths: int = 360) -> np.ndarray:
    """[N,3] hits of the sim's LiDAR (at (0.55, 0, 1.10), elevations -1.50..-0.25 rad)."""
    e, a = np.meshgrid(np.linspace(-1.50, -0.25, rings),
                       np.linspace(-np.pi, np.pi, azimuths, endpoint=False), indexing="ij")
    dirs = np.stack([np.cos(e) * np.cos(a), np.cos(e) * np.sin(a), np.sin(e)], -1).reshape(-1, 3)
    origin = np.array([0.55, 0.0, 1.10])
    t, _ = cast(origin, dirs, objects)
    ok = np.isfinite(t) & (t < 5.0)
    return (origin + t[ok, None] * dirs[ok]).astype(np.float32)


def tight_box(cmap: np.ndarray, k: int) -> torch.Tensor:
    ys, xs = np.nonzero(cmap == k)
    return torch.tensor([xs.min() - 0.5, ys.min() - 0.5, xs.max() + 0.5, ys.max() + 0.5])


def scene(objects=(CUBE_AT, TALL_AT), T=T_CAM):
    pts = torch.from_numpy(lidar_scan(objects))
    cmap = torch.from_numpy(class_map(T, objects))
    Tt, Kt = torch.from_numpy(T), torch.from_numpy(K)
    uv, z, ok = project_points(pts, Tt[None], Kt[None], (H, W))
    return pts, cmap, Tt, Kt, uv[0], z[0], ok[0]


def test_cube_on_a_table_gets_its_centre_not_the_table() -> None:
    """The box median mixes the table around the cube, the table behind it and the floor
    behind the table (all projected into the box): centimetres off. The support rule: within
    1 cm of the centre, for the cube and a taller box, by every path."""
    pts, cmap, T, Kt, uv, z, ok = scene()
    boxes = torch.stack([tight_box(cmap.numpy(), CUBE), tight_box(cmap.numpy(), TALL)])
    cls = torch.tensor([CUBE, TALL])
    gt = torch.tensor([CUBE_AT[1], TALL_AT[1]], dtype=torch.float64)
    old, old_src = box_positions(boxes, uv, z, ok, None, Kt, T)
    assert old_src.tolist() == [int(PositionSource.LIDAR)] * 2
    assert ((old - gt).norm(dim=1) > 0.02).all()  # why the support rule exists
    rule = dict(heights=pts[:, 2], box_class=cls, support_classes=(TABLE,))
    pos, src = box_positions(boxes, uv, z, ok, None, Kt, T, class_map=cmap, **rule)
    assert src.tolist() == [int(PositionSource.LIDAR)] * 2
    err = (pos - gt).norm(dim=1)
    assert (err < 0.01).all(), err
    for static in (True, False):  # the node's paths: one camera, two slots + an unused one
        bp, bs = box_positions_batched(
            torch.cat([boxes, torch.zeros(1, 4)])[None], torch.tensor([[True, True, False]]),
            uv[None], z[None], ok[None], None, torch.linalg.inv(Kt)[None],
            torch.linalg.inv(T)[None], 5, static=static, heights=pts[:, 2],
            seg=cmap[None], box_class=torch.tensor([[CUBE, TALL, 0]]),
            support_classes=(TABLE,))
        assert bs[0].tolist() == [*src.tolist(), int(PositionSource.NONE)]
        torch.testing.assert_close(bp[0, :2], pos, rtol=0, atol=1e-9)


@pytest.mark.parametrize("xy", [(0.31, -0.40), (0.35, 0.42)])
def test_a_tall_object_far_from_the_lidar_is_placed_from_its_top(xy, monkeypatch) -> None:
    """An 8 cm tall object near the table's edge, far from the LiDAR: most of its points are on
    its side, so their median height is well below its top, and the centre on the box's ray
    lands centimetres off. h_top from `top_height` (the upper quartile here): within 1 cm, by
    every path."""
    tall = (TALL, (xy[0], xy[1], TABLE_Z + 0.04), (0.025, 0.025, 0.04))
    pts, cmap, T, Kt, uv, z, ok = scene(objects=(CUBE_AT, tall))
    box = tight_box(cmap.numpy(), TALL)[None]
    gt = torch.tensor([tall[1]], dtype=torch.float64)
    rule = dict(heights=pts[:, 2], box_class=torch.tensor([TALL]), support_classes=(TABLE,))

    def errors() -> list[float]:
        pos, src = box_positions(box, uv, z, ok, None, Kt, T, class_map=cmap, **rule)
        assert src.tolist() == [int(PositionSource.LIDAR)]
        out = [float((pos - gt).norm())]
        for static in (True, False):
            bp, _ = box_positions_batched(
                box[None], torch.tensor([[True]]), uv[None], z[None], ok[None], None,
                torch.linalg.inv(Kt)[None], torch.linalg.inv(T)[None], 5, static=static,
                heights=pts[:, 2], seg=cmap[None], box_class=torch.tensor([[TALL]]),
                support_classes=(TABLE,))
            out.append(float((bp[0] - gt).norm()))
        return out

    assert max(errors()) < 0.01, errors()
    monkeypatch.setattr(lidar, "top_height", lambda q25, q50, q75, tol: q50)  # the median
    assert min(errors()) > 0.015, errors()


def _quartiles(heights: list[float]) -> list[torch.Tensor]:
    srt = torch.tensor(sorted(heights))
    return [srt[int((len(heights) - 1) * f)] for f in TOP_QUANTILES]


def test_top_height_of_measured_objects() -> None:
    """Heights (m) of the object points of three detections in the sim (table top 0.40 m):
    an 8 cm cylinder far from the LiDAR, most points on its side (top 0.48); a 5 cm cube with
    some side points (top 0.45); a cube under the arm, whose points above it (0.50) took the
    cube's class at the mask's edge. top_height finds each top; the median misses the
    cylinder's by 3.7 cm, the upper quartile the covered cube's by 5 cm."""
    tol = 0.01
    cylinder = [0.412, 0.414, 0.434, 0.434, 0.441, 0.441, 0.443, 0.468, 0.471] + [0.48] * 5
    cube = [0.411, 0.418, 0.423, 0.425, 0.426, 0.432, 0.439, 0.445] + [0.45] * 21
    covered = [0.436] + [0.45] * 36 + [0.5] * 14
    for heights, top in ((cylinder, 0.48), (cube, 0.45), (covered, 0.45)):
        q = _quartiles(heights)
        assert float(top_height(*q, tol)) == pytest.approx(top, abs=1e-6), heights
    assert float(_quartiles(cylinder)[1]) < 0.445 and float(_quartiles(covered)[2]) == 0.5
    # elementwise over tensors of any shape
    qs = [torch.stack([a, b]) for a, b in zip(_quartiles(cylinder), _quartiles(covered),
                                              strict=True)]
    torch.testing.assert_close(top_height(*qs, tol), torch.tensor([0.48, 0.45]))


def test_logits_and_class_map_give_the_same_point_classes() -> None:
    _, cmap, _, _, uv, _, ok = scene()
    logits = torch.nn.functional.one_hot(cmap, 7).permute(2, 0, 1).float()[None]
    logits = logits.contiguous(memory_format=torch.channels_last)  # any layout
    a, b = point_classes(logits, uv[None], ok[None]), point_classes(cmap[None], uv[None],
                                                                    ok[None])
    assert torch.equal(a, b) and (a[~ok[None]] == -1).all()
    assert {TABLE, CUBE, TALL} <= set(a[ok[None]].tolist())


def test_support_height_needs_a_horizontal_plane() -> None:
    pts, cmap, _, _, uv, _, ok = scene()
    pc = point_classes(cmap[None], uv[None], ok[None])
    hs, plane = support_heights(pts[:, 2], pc, (TABLE,), 0.01, 5)
    assert plane.tolist() == [True] and hs.item() == pytest.approx(TABLE_Z, abs=1e-6)
    # the same points labelled "table" on a wall (heights spread 1 cm apart): no plane
    wall = torch.arange(pts.shape[0], dtype=torch.float32) % 100 * 0.01
    assert support_heights(wall, pc, (TABLE,), 0.01, 5)[1].tolist() == [False]
    # too few support points, or no support class at all: no plane
    assert support_heights(pts[:, 2], pc, (TABLE,), 0.01, 10**6)[1].tolist() == [False]
    assert support_heights(pts[:, 2], pc, (5,), 0.01, 5)[1].tolist() == [False]


def test_class_lanes_keep_each_box_to_its_own_class() -> None:
    """A point counts for a box only in the box's class lane; image-edge boxes and points of
    neighbouring lanes never meet."""
    uv = torch.tensor([[[10.0, 10.0], [10.0, 10.0], [-0.5, 5.0], [W - 0.51, 5.0]]])
    pc = torch.tensor([[2, 3, 3, 2]])
    boxes = torch.tensor([[[0.0, 0, 20, 20], [-3.0, 0, W + 3.0, 20]]])
    bc = torch.tensor([[3, 2]])
    uvl, bl = class_lanes(uv, pc, boxes, bc, W)
    inside = ((uvl[..., 0][:, None] >= bl[..., 0:1]) & (uvl[..., 0][:, None] <= bl[..., 2:3])
              & (uvl[..., 1][:, None] >= bl[..., 1:2]) & (uvl[..., 1][:, None] <= bl[..., 3:4]))
    assert inside[0].tolist() == [[False, True, False, False], [True, False, False, True]]


def test_a_flat_ray_takes_the_object_surface_depth() -> None:
    """Rays within ~10 deg of horizontal would turn a height error into a large error along
    the ray: the object's surface depth instead; a steep ray meets the centre height."""
    k_inv = torch.eye(3, dtype=torch.float64)[None]
    box = torch.tensor([[[-0.1, -0.1, 0.1, 0.1]]])  # centre pixel (0, 0): the optical axis
    flat = torch.eye(4, dtype=torch.float64)
    flat[:3, :3] = torch.tensor([[0.0, 0, 1], [-1, 0, 0], [0, -1, 0]])  # looks along base +x
    down = torch.eye(4, dtype=torch.float64)
    down[:3, :3] = torch.tensor([[1.0, 0, 0], [0, -1, 0], [0, 0, -1]])  # looks down base -z
    down[2, 3] = 2.0  # camera 2 m above the base origin
    h_top, h_s, surf = torch.tensor([[0.5]]), torch.tensor([0.3]), torch.tensor([[1.7]])
    assert centre_depth(box, h_top, h_s, surf, k_inv, flat[None]).item() == pytest.approx(1.7)
    assert centre_depth(box, h_top, h_s, surf, k_inv, down[None]).item() == pytest.approx(1.6)


def test_few_object_points_fall_back_to_predicted_depth_and_the_table_keeps_the_box() -> None:
    """An object with fewer than min_points points of its own gets the predicted depth (not
    the box median of the table around it); a detection of the support class itself keeps
    the box median; without segmentation every box takes the box median."""
    pts, cmap, T, Kt, uv, z, ok = scene()
    boxes = torch.stack([tight_box(cmap.numpy(), CUBE), tight_box(cmap.numpy(), TABLE)])
    cls = torch.tensor([CUBE, TABLE])
    dmap = torch.full((H, W), 0.9)
    rule = dict(heights=pts[:, 2], class_map=cmap, box_class=cls, support_classes=(TABLE,))
    box_rule, box_src = box_positions(boxes, uv, z, ok, dmap, Kt, T, 5)
    pos, src = box_positions(boxes, uv, z, ok, dmap, Kt, T, 5, **rule)
    assert src.tolist() == [int(PositionSource.LIDAR)] * 2
    torch.testing.assert_close(pos[1], box_rule[1])  # the table: box median
    n_cube = int(((cmap[uv[:, 1].round().long().clamp(0, H - 1),
                        uv[:, 0].round().long().clamp(0, W - 1)] == CUBE) & ok
                  & (pts[:, 2] > TABLE_Z + 0.01)).sum())
    assert n_cube >= 10
    few, few_src = box_positions(boxes, uv, z, ok, dmap, Kt, T, n_cube + 1, **rule)
    assert few_src[0] == PositionSource.PREDICTED_DEPTH
    assert few_src[1] == PositionSource.LIDAR  # the table has plenty
    none, none_src = box_positions(boxes, uv, z, ok, None, Kt, T, n_cube + 1, **rule)
    assert none_src[0] == PositionSource.NONE and torch.isnan(none[0]).all()


@pytest.mark.parametrize("static", [True, False])
def test_batched_support_rule_equals_the_per_camera_reference(static: bool) -> None:
    """Two cameras, every object's tight box plus jittered ones, of the object's class or a
    random one (the table's, another object's, one absent), min_points 3 and 30: the batched
    rule gives the reference's sources and positions (each class in its own lane)."""
    objects = (CUBE_AT, TALL_AT, (3, (0.75, 0.20, TABLE_Z + 0.02), (0.03, 0.02, 0.02)))
    g = torch.Generator().manual_seed(0)
    pts = torch.from_numpy(lidar_scan(objects, azimuths=720))
    Ts = [torch.from_numpy(T) for T in (T_CAM, T_CAM2)]
    Kt = torch.from_numpy(K)
    cmaps = torch.stack([torch.from_numpy(class_map(T.numpy(), objects)) for T in Ts])
    uv, z, ok = project_points(pts, torch.stack(Ts), Kt.expand(2, 3, 3), (H, W))
    d = 16
    boxes, classes = torch.zeros(2, d, 4), torch.zeros(2, d, dtype=torch.long)
    for cam in range(2):
        for j, (k, _, _) in enumerate(objects):
            boxes[cam, j], classes[cam, j] = tight_box(cmaps[cam].numpy(), k), k
        # jittered object boxes, of the object's class or a random one
        pick = torch.randint(0, 3, (d - 3,), generator=g)
        jitter = (torch.rand(d - 3, 4, generator=g) - 0.5) * 12
        boxes[cam, 3:] = boxes[cam, pick] + jitter
        own = torch.rand(d - 3, generator=g) < 0.6
        classes[cam, 3:] = torch.where(own, classes[cam, pick],
                                       torch.randint(1, 7, (d - 3,), generator=g))
    valid = torch.ones(2, d, dtype=torch.bool)
    valid[:, -2:] = False
    dmap = 0.5 + torch.rand(2, H, W, generator=g)
    for mp in (3, 30):
        bp, bs = box_positions_batched(
            boxes, valid, uv, z, ok, dmap, torch.linalg.inv(Kt).expand(2, 3, 3),
            torch.stack([torch.linalg.inv(T) for T in Ts]), mp, static=static,
            heights=pts[:, 2], seg=cmaps, box_class=classes, support_classes=(TABLE,))
        for cam in range(2):
            rp, rs = box_positions(boxes[cam, :-2], uv[cam], z[cam], ok[cam], dmap[cam], Kt,
                                   Ts[cam], mp, heights=pts[:, 2], class_map=cmaps[cam],
                                   box_class=classes[cam, :-2], support_classes=(TABLE,))
            assert bs[cam, :-2].tolist() == rs.tolist()
            assert (bs[cam, -2:] == int(PositionSource.NONE)).all()
            torch.testing.assert_close(bp[cam, :-2], rp, rtol=0, atol=1e-9, equal_nan=True)
        counts = torch.bincount(bs.flatten(), minlength=3).tolist()
        assert counts[int(PositionSource.LIDAR)] >= (10 if mp == 3 else 3)
        assert counts[int(PositionSource.PREDICTED_DEPTH)] >= 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_support_rule_on_cuda_equals_the_cpu() -> None:
    """The static CUDA paths (Triton box medians where triton is importable, else torch):
    the CPU's sources, positions within float64 rounding."""
    from kestrel_models.perception import lidar

    objects = (CUBE_AT, TALL_AT)
    pts = torch.from_numpy(lidar_scan(objects, azimuths=720))
    Ts = torch.stack([torch.from_numpy(T) for T in (T_CAM, T_CAM2)])
    Kt = torch.from_numpy(K).expand(2, 3, 3)
    cmaps = torch.stack([torch.from_numpy(class_map(T.numpy(), objects)) for T in Ts])
    logits = torch.nn.functional.one_hot(cmaps, 7).permute(0, 3, 1, 2).float()
    uv, z, ok = project_points(pts, Ts, Kt, (H, W))
    boxes = torch.stack([torch.stack([tight_box(c.numpy(), k) for k in (CUBE, TALL, TABLE)])
                         for c in cmaps])
    classes = torch.tensor([[CUBE, TALL, TABLE]] * 2)
    valid = torch.ones(2, 3, dtype=torch.bool)
    dmap = torch.full((2, H, W), 0.9)
    args = (boxes, valid, uv, z, ok, dmap, torch.linalg.inv(Kt), torch.linalg.inv(Ts), 5)
    rule = dict(heights=pts[:, 2], seg=logits, box_class=classes, support_classes=(TABLE,))
    ref_pos, ref_src = box_positions_batched(*args, static=True, **rule)
    assert (ref_src == int(PositionSource.LIDAR)).all()
    cuda = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
    crule = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in rule.items()}
    for use_triton in (True, False):
        lidar.USE_TRITON = use_triton
        try:
            pos, src = box_positions_batched(*cuda, static=True, **crule)
        finally:
            lidar.USE_TRITON = True
        assert torch.equal(src.cpu(), ref_src)
        torch.testing.assert_close(pos.cpu(), ref_pos, rtol=0, atol=1e-9)
