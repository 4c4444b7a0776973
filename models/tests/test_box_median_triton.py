"""Box medians as a Triton kernel (perception/box_median_triton.py) == the torch reference
(`lidar._lower_median_in_boxes`, the static path of `box_positions_batched`).

CPU: the reference's edge cases the kernel relies on (inclusive edges, empty boxes, all NaN,
ties, NaN values ranked last), the kernel's radix-select algorithm in torch against the
reference, the pixel rectangles against the reference's pixel masks, and the dispatch falling
back to the torch path without triton/CUDA. GPU (marked gpu): EXACT equality of the kernel
(medians where count > 0, counts) and of box_positions_batched with the kernel vs the torch
path at the node's sizes (6 cameras x 20 slots, 131072 points, 640x640 depth), random and
adversarial inputs, each LiDAR mode (points binned into the boxes first, the default; one
program per box scanning every point, with and without compaction), and the kernels inside a
torch.cuda.CUDAGraph (replay with new inputs)."""

from __future__ import annotations

import pytest
import torch
from kestrel_models.perception import box_median_triton as bmt
from kestrel_models.perception import lidar
from kestrel_models.perception.lidar import (
    PositionSource,
    _lower_median_in_boxes,
    box_positions_batched,
)

torch.set_num_threads(1)
gpu = pytest.mark.skipif(not (torch.cuda.is_available() and bmt.HAVE_TRITON),
                         reason="needs a CUDA GPU and triton")
C, D, N, HW = 6, 20, 131072, (640, 640)  # the node's sizes


def ref_lidar(z, uv, ok, boxes):
    bf = boxes.float()
    return _lower_median_in_boxes(z.float(), uv[..., 0].float(), uv[..., 1].float(), ok,
                                  bf[..., 0:2], bf[..., 2:4], 1 << 24)


def ref_depth(dm, boxes):
    """The torch static path's predicted-depth medians (lidar.box_positions_batched)."""
    c, h, w = dm.shape
    b = boxes.double()
    c0, c1 = b[..., 0].floor().clamp(min=0), b[..., 2].ceil().clamp(max=w)
    r0, r1 = b[..., 1].floor().clamp(min=0), b[..., 3].ceil().clamp(max=h)
    lo = torch.stack([c0, r0], 2).float()
    hi = torch.stack([c1 - 1, r1 - 1], 2).float()
    pu = torch.arange(w, device=dm.device).float().repeat(h)[None].expand(c, -1)
    pv = torch.arange(h, device=dm.device).float().repeat_interleave(w)[None].expand(c, -1)
    d = dm.reshape(c, h * w).float()
    return _lower_median_in_boxes(d, pu, pv, ~d.isnan(), lo, hi, 1 << 24)


def inside_mask(uv, ok, boxes):  # [C,D,N] as the reference builds it
    u, v = uv[..., 0][:, None], uv[..., 1][:, None]
    b = boxes.float()
    return (ok[:, None] & (u >= b[..., 0:1]) & (u <= b[..., 2:3]) & (v >= b[..., 1:2])
            & (v <= b[..., 3:4]))


def assert_same(got, ref, need=None):
    (gm, gc), (rm, rc) = got, ref
    if need is not None:  # skipped slots: count 0
        assert (gc[~need] == 0).all()
        gc, rc, gm, rm = gc[need], rc[need], gm[need], rm[need]
    assert torch.equal(gc, rc), (gc - rc).abs().max()
    m = rc > 0
    torch.testing.assert_close(gm[m], rm[m], rtol=0, atol=0, equal_nan=True)


def adversarial_points(g, c, n, hw, dev="cpu"):
    """Few distinct depths (ties), NaN/inf/negative/-0 depths among valid points, points on
    integer coordinates (box edges), invalid points."""
    h, w = hw
    uv = torch.stack([torch.randint(0, w, (c, n), generator=g).float(),
                      torch.randint(0, h, (c, n), generator=g).float()], 2)
    uv[:, ::3] += torch.rand(c, (n + 2) // 3, 2, generator=g)
    z = torch.randint(0, 5, (c, n), generator=g).float() * 0.5
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, -1.5])
    pick = torch.randint(0, 40, (c, n), generator=g)
    z = torch.where(pick < len(specials), specials[pick.clamp(max=len(specials) - 1)], z)
    ok = torch.rand(c, n, generator=g) < 0.8
    return z.to(dev), uv.to(dev), ok.to(dev)


def adversarial_boxes(g, c, d, hw, dev="cpu"):
    h, w = hw
    xy = torch.randint(-20, w, (c, d, 2), generator=g).float()
    wh = torch.randint(0, w // 2, (c, d, 2), generator=g).float()
    boxes = torch.cat([xy, xy + wh], 2)
    boxes[:, 1::4, :2] += 0.5  # fractional edges
    boxes[:, 0] = torch.tensor([0.0, 0.0, float(w), float(h)])  # whole image
    boxes[:, 2] = torch.tensor([5.0, 5.0, 5.0, 5.0])  # one point / one pixel
    boxes[:, 3] = torch.tensor([30.0, 30.0, 10.0, 40.0])  # x1 > x2: empty
    boxes[:, 4] = torch.tensor([float("nan"), 0.0, 50.0, 50.0])  # NaN edge: empty
    boxes[:, 5] = torch.tensor([-float("inf"), -5.0, float("inf"), 1e30])  # unbounded
    boxes[:, 6] = torch.tensor([w + 3.0, 0.0, w + 50.0, 20.0])  # outside the image
    return boxes.to(dev)


# ---------------------------------------------------------------- CPU: reference and algorithm
def test_reference_edges_ties_empty_nan() -> None:
    # 1 camera, points at x = 0..9 (y = 0), depths 9..0 (reversed), point 3 invalid
    u = torch.arange(10.0)[None]
    z = (9 - torch.arange(10.0))[None]
    ok = torch.ones(1, 10, dtype=torch.bool)
    ok[0, 3] = False
    lo = torch.tensor([[[2.0, 0.0], [4.0, 0.0], [4.0, 1.0], [0.0, 0.0], [7.0, 0.0]]])
    hi = torch.tensor([[[5.0, 0.0], [4.0, 0.0], [9.0, 1.0], [9.0, 0.0], [8.0, 0.0]]])
    med, cnt = _lower_median_in_boxes(z, u, torch.zeros_like(u), ok, lo, hi, 1 << 20)
    assert cnt.tolist() == [[3, 1, 0, 9, 2]]  # inclusive edges: x=2,4,5; x=4 alone; y=1 none
    assert med[0, 0] == 5.0  # depths {7, 5, 4}: 2nd smallest of 3
    assert med[0, 1] == 5.0
    assert med[0, 3] == 4.0  # 9 values, 5th smallest of {0..9} \ {6}
    assert med[0, 4] == 1.0  # {2, 1}: lower median = smaller
    # ties and NaN values ranked last (a valid point with a NaN depth)
    z2 = torch.tensor([[3.0, 3.0, 3.0, 1.0, float("nan"), float("nan")]])
    ok2 = torch.ones(1, 6, dtype=torch.bool)
    lo2, hi2 = torch.zeros(1, 3, 2), torch.tensor([[[5.0, 0.0], [2.0, 0.0], [5.0, 0.0]]])
    lo2[0, 2, 0] = 4.0
    m2, c2 = _lower_median_in_boxes(z2, torch.arange(6.0)[None], torch.zeros(1, 6), ok2, lo2,
                                    hi2, 1 << 20)
    assert c2.tolist() == [[6, 3, 2]]
    assert m2[0, 0] == 3.0 and m2[0, 1] == 3.0 and m2[0, 2].isnan()


@pytest.mark.slow
def test_radix_select_algorithm_equals_reference() -> None:
    g = torch.Generator().manual_seed(0)
    hw = (40, 60)
    nan_medians = 0
    for trial in range(4):
        z, uv, ok = adversarial_points(g, 2, 700, hw)
        if trial == 2:  # continuous random values, wide range
            z = torch.randn(2, 700, generator=g) * 1e3
        if trial == 3:  # mostly NaN depths among the valid points: NaN medians
            z = torch.where(torch.rand(2, 700, generator=g) < 0.6, float("nan"), z)
        boxes = adversarial_boxes(g, 2, 9, hw)
        ref = ref_lidar(z, uv, ok, boxes)
        got = bmt.radix_select_torch(z, inside_mask(uv, ok, boxes))
        assert_same(got, ref)
        assert (ref[1] > 0).sum() >= 5
        nan_medians += int(ref[0][ref[1] > 0].isnan().sum())
    assert nan_medians > 0


@pytest.mark.parametrize("q", [0.0, 0.25, 0.75, 1.0])
def test_quantiles_equal_a_sort_and_the_radix_select(q) -> None:
    """The lower quantile (the support rule's h_top) by the reference: the
    floor((count - 1) * q) + 1-th smallest of each box's values, as a sort gives it; the
    kernel's algorithm in torch gives the same."""
    g = torch.Generator().manual_seed(int(q * 100))
    hw = (40, 60)
    z = torch.randn(2, 500, generator=g)
    uv = torch.rand(2, 500, 2, generator=g) * torch.tensor([60.0, 40.0])
    ok = torch.rand(2, 500, generator=g) < 0.8
    boxes = adversarial_boxes(g, 2, 9, hw)
    bf = boxes.float()
    ref = _lower_median_in_boxes(z, uv[..., 0], uv[..., 1], ok, bf[..., 0:2], bf[..., 2:4],
                                 1 << 20, quantile=q)
    inside = inside_mask(uv, ok, boxes)
    for c in range(2):
        for d in range(9):
            vals = z[c][inside[c, d]].sort().values
            assert int(ref[1][c, d]) == vals.numel()
            if vals.numel():
                assert ref[0][c, d] == vals[int((vals.numel() - 1) * q)]
    assert (ref[1] > 3).sum() >= 4
    assert_same(bmt.radix_select_torch(z, inside, quantile=q), ref)
    several, cnt = lidar._quantiles_in_boxes(z, uv[..., 0], uv[..., 1], ok, bf[..., 0:2],
                                             bf[..., 2:4], 1 << 20, (0.5, q))
    assert_same((several[1], cnt), ref)  # one sort for several quantiles: the same values
    assert_same((several[0], cnt), ref_lidar(z, uv, ok, boxes))
    with pytest.raises(ValueError, match="quantile = 1.5"):
        bmt.radix_select_torch(z, inside, quantile=1.5)


def test_pixel_rects_and_depth_algorithm_equal_reference() -> None:
    g = torch.Generator().manual_seed(1)
    c, d, (h, w) = 2, 9, (30, 50)
    dm = torch.randint(0, 6, (c, h, w), generator=g).float() * 0.25
    dm[0, :10] = float("nan")
    dm[1] = float("nan")  # all NaN: count 0 everywhere
    dm[0, 20:, 40:] = -0.0
    boxes = adversarial_boxes(g, c, d, (h, w))
    ref = ref_depth(dm, boxes)
    rect = bmt.pixel_rects(boxes, h, w)  # the kernel's rectangles as masks
    rows, cols = torch.arange(h)[:, None], torch.arange(w)[None]
    r = rect[..., None, None]
    mask = ((cols >= r[..., 0, :, :]) & (cols < r[..., 2, :, :]) & (rows >= r[..., 1, :, :])
            & (rows < r[..., 3, :, :]))  # [C,D,H,W]
    inside = mask.reshape(c, d, h * w) & ~dm.reshape(c, 1, h * w).isnan()
    assert_same(bmt.radix_select_torch(dm.reshape(c, h * w), inside), ref)
    assert (ref[1][1] == 0).all() and (ref[1][0] > 0).sum() >= 4
    assert rect[0, 3].tolist()[2] <= rect[0, 3].tolist()[0]  # x1 > x2: empty
    assert rect[0, 4, 0] == w  # NaN edge: empty


def test_dispatch_falls_back_without_triton_or_cuda() -> None:
    assert not bmt.available(torch.zeros(1))  # CPU tensors never take the kernel
    if not bmt.HAVE_TRITON:
        with pytest.raises(RuntimeError, match="triton"):
            bmt.lidar_box_medians(torch.zeros(1, 4), torch.zeros(1, 4, 2),
                                  torch.ones(1, 4, dtype=torch.bool), torch.zeros(1, 2, 4))
    g = torch.Generator().manual_seed(2)
    hw = (40, 60)
    z, uv, ok = adversarial_points(g, 2, 500, hw)
    z = z.abs().nan_to_num(1.0, 1.0, 1.0) + 0.1
    boxes = adversarial_boxes(g, 2, 8, hw)
    dm = torch.rand(2, *hw, generator=g) + 0.5
    eye = torch.eye(3).expand(2, 3, 3)
    bv = torch.ones(2, 8, dtype=torch.bool)
    out = {}
    for flag in (True, False):
        lidar.USE_TRITON = flag
        try:
            out[flag] = box_positions_batched(boxes, bv, uv, z, ok, dm, eye,
                                              torch.eye(4).expand(2, 4, 4), 3)
        finally:
            lidar.USE_TRITON = True
    assert torch.equal(out[True][1], out[False][1])
    torch.testing.assert_close(out[True][0], out[False][0], rtol=0, atol=0, equal_nan=True)
    assert {int(PositionSource.LIDAR), int(PositionSource.PREDICTED_DEPTH)} <= set(
        out[True][1].flatten().tolist())


# ---------------------------------------------------------------- GPU: the kernel
def real_inputs(seed: int, adversarial: bool):
    g = torch.Generator().manual_seed(seed)
    h, w = HW
    if adversarial:
        z, uv, ok = adversarial_points(g, C, N, HW)
        boxes = adversarial_boxes(g, C, D, HW)
        dm = torch.randint(0, 8, (C, h, w), generator=g).float() * 0.5
        dm[0, :300] = float("nan")
        dm[1] = float("nan")
        dm[2, ::2] = -0.0
    else:
        uv = torch.rand(C, N, 2, generator=g) * torch.tensor([w, h]) - 0.5
        z = 0.5 + 50 * torch.rand(C, N, generator=g)
        ok = torch.rand(C, N, generator=g) < 0.7
        xy = torch.rand(C, D, 2, generator=g) * torch.tensor([w, h])
        boxes = torch.cat([xy, xy + torch.rand(C, D, 2, generator=g) * 200], 2)
        dm = 0.5 + 50 * torch.rand(C, h, w, generator=g)
        dm[:, :50] = float("nan")
    return [t.cuda() for t in (z, uv, ok, boxes, dm)]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("seed,adversarial", [(0, False), (1, True), (2, True)])
def test_kernel_equals_reference_real_sizes(seed, adversarial) -> None:
    z, uv, ok, boxes, dm = real_inputs(seed, adversarial)
    ref = ref_lidar(z, uv, ok, boxes)
    assert_same(bmt.lidar_box_medians(z, uv, ok, boxes, prebin=True), ref)
    for compact in (True, False):
        assert_same(bmt.lidar_box_medians(z, uv, ok, boxes, compact=compact, prebin=False),
                    ref)
    rect = bmt.pixel_rects(boxes, *HW)
    assert_same(bmt.depth_box_medians(dm, rect), ref_depth(dm, boxes))
    if seed == 1:  # another launch configuration: same values
        assert_same(bmt.lidar_box_medians(z, uv, ok, boxes, block=1024, num_warps=4), ref)
        assert_same(bmt.depth_box_medians(dm, rect, block=4096, num_warps=16),
                    ref_depth(dm, boxes))
    need = torch.rand(C, D, device="cuda") < 0.5
    for prebin in (True, False):
        assert_same(bmt.lidar_box_medians(z, uv, ok, boxes, need, prebin=prebin),
                    ref_lidar(z, uv, ok, boxes), need)
    assert_same(bmt.depth_box_medians(dm, rect, need), ref_depth(dm, boxes), need)
    # non-contiguous inputs (a strided depth map view, float64 uv) give the same values
    dm2 = torch.full((C, 2, *HW), 7.0, device="cuda")
    dm2[:, 1] = dm
    assert_same(bmt.depth_box_medians(dm2[:, 1], rect), ref_depth(dm, boxes))
    assert_same(bmt.lidar_box_medians(z, uv.double(), ok, boxes), ref_lidar(z, uv, ok, boxes))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("q", [0.0, 0.75, 1.0])
def test_kernel_quantile_equals_reference(q) -> None:
    z, uv, ok, boxes, _ = real_inputs(8, True)
    bf = boxes.float()
    ref = _lower_median_in_boxes(z.float(), uv[..., 0].float(), uv[..., 1].float(), ok,
                                 bf[..., 0:2], bf[..., 2:4], 1 << 24, quantile=q)
    for prebin in (True, False):
        assert_same(bmt.lidar_box_medians(z, uv, ok, boxes, prebin=prebin, quantile=q), ref)
        several, cnt = bmt.lidar_box_quantiles(z, uv, ok, boxes, (0.5, q), prebin=prebin)
        assert_same((several[1], cnt), ref)  # binned once, selected per quantile
        assert_same((several[0], cnt), ref_lidar(z, uv, ok, boxes))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 1000, 131073])
def test_kernel_point_counts_off_the_block_size(n) -> None:
    """Point counts that are not a multiple of BLOCK_BIN / BLOCK_LIDAR (the tail blocks'
    masks), each mode, adversarial points and boxes."""
    g = torch.Generator().manual_seed(n)
    z, uv, ok = (t.cuda() for t in adversarial_points(g, C, n, HW))
    boxes = adversarial_boxes(g, C, D, HW).cuda()
    ref = ref_lidar(z, uv, ok, boxes)
    assert_same(bmt.lidar_box_medians(z, uv, ok, boxes, prebin=True), ref)
    for compact in (True, False):
        assert_same(bmt.lidar_box_medians(z, uv, ok, boxes, compact=compact, prebin=False),
                    ref)
    with pytest.raises(ValueError, match="compact"):
        bmt.lidar_box_medians(z, uv, ok, boxes, compact=True, prebin=True)


def positions(inp, use_triton: bool):
    z, uv, ok, boxes, dm = inp
    lidar.USE_TRITON = use_triton
    try:
        k_inv = torch.eye(3, device="cuda").expand(C, 3, 3)
        t = torch.eye(4, device="cuda").expand(C, 4, 4)
        bv = torch.ones(C, D, dtype=torch.bool, device="cuda")
        bv[:, -3:] = False
        return box_positions_batched(boxes, bv, uv, z, ok, dm, k_inv, t, 5)
    finally:
        lidar.USE_TRITON = True


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("seed,adversarial", [(3, False), (4, True)])
def test_box_positions_batched_triton_equals_torch(seed, adversarial) -> None:
    inp = real_inputs(seed, adversarial)
    inp[2][:, : N // 2] = False  # fewer points: some boxes fall back to the depth map
    (pt, st), (pr, sr) = positions(inp, True), positions(inp, False)
    assert torch.equal(st, sr)
    torch.testing.assert_close(pt, pr, rtol=0, atol=0, equal_nan=True)
    assert (sr == int(PositionSource.PREDICTED_DEPTH)).any() or adversarial


@gpu
@pytest.mark.gpu
def test_kernel_in_cuda_graph_replays_new_inputs() -> None:
    static = real_inputs(5, False)
    positions(static, True)  # compiles the kernels outside the capture
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        positions(static, True)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = positions(static, True)
    for seed, adv in ((6, False), (7, True)):
        new = real_inputs(seed, adv)
        new[2][:, : N // 2] = False
        for dst, src in zip(static, new, strict=True):
            dst.copy_(src)
        g.replay()
        torch.cuda.synchronize()
        ref_pos, ref_src = positions(new, False)
        assert torch.equal(out[1], ref_src)
        torch.testing.assert_close(out[0], ref_pos, rtol=0, atol=0, equal_nan=True)
