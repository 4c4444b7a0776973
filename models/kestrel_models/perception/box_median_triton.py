"""Lower medians of values inside boxes as one Triton kernel (LiDAR depth and predicted depth).

Computes what `lidar._lower_median_in_boxes` returns (the torch reference), for the two uses
in `lidar.box_positions_batched(static=True)`:

lidar_box_medians(depth [C,N] m, uv [C,N,2] px, valid [C,N] bool, boxes [C,D,4] xyxy px, need)
    count = number of valid points with x1 <= u <= x2 and y1 <= v <= y2 (inclusive, float32
    compares), median = the ceil(count/2)-th smallest depth among them (NaN depths rank last,
    as torch.sort puts them); with `quantile` q the `quantile_rank(count, q)`-th smallest
    (q = 0.5: the median).
depth_box_medians(depth_map [C,H,W] m, rect [C,D,4] int32 (col0, row0, col1, row1), need)
    count = number of non-NaN pixels in the rectangle [col0, col1) x [row0, row1), median as
    above. Only the rectangle is read: the loop bound (its area) is read from memory inside
    the kernel, so the launch grid stays fixed and nothing is read on the host.

Both return (median [C,D] float32, count [C,D] int64); the median is meaningless where count
== 0. `need` [C,D] bool (optional): slots where it is False are skipped and return count 0
(box_positions_batched passes the slots whose median it can use).

Algorithm: one program per (camera, box), radix select over the float bits. A float32 maps
to an int32 key whose signed order is the float order (`_float_key`: flip the magnitude bits of
negatives; NaN -> the largest key). Pass 0 counts the inside values and builds a 256-bin
histogram of the top key byte; the bin where the running count reaches k = ceil(count/2) is
the median's top byte; passes 1-3 histogram the next byte among the values that share the
bytes chosen so far. No sort, no [C,D,N] masks; the median is the key decoded back to float
(bit exact). LiDAR mode (LIDAR_COMPACT): pass 0 also writes the box's inside keys, in order,
to a scratch row, so passes 1-3 read `count` keys instead of all N points; the rectangle mode
reads the rectangle 4 times (no scratch). LiDAR mode with LIDAR_PREBIN (the default): a first
kernel bins the points instead, over a grid of (point block, camera) programs: each loads its
block of points ONCE, tests it against every box of its camera and appends the inside keys to
the boxes' scratch rows (one atomic per program and box reserves the space; the order within a
row is arbitrary, which a histogram does not see); the select kernel then runs all 4 passes
over `count` keys. Before it, one program per box scanned all N points in pass 0 (~60 loop
iterations of 2048 points, in one wave: latency bound). `radix_select_torch` is the same
algorithm in torch (CPU tests check it against the reference, the GPU tests check the kernel).

Launches are graph-capturable (fixed grid, no host reads) once compiled: call the function
once outside the capture (the region graph's eager warm-up does). `import triton` is optional:
without it (or on CPU tensors) `available()` is False and the functions raise RuntimeError.
"""

from __future__ import annotations

import torch

try:  # the GPU path only; CPU CI has no triton
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except ImportError:
    triton = tl = None  # type: ignore[assignment]
    HAVE_TRITON = False

__all__ = ["HAVE_TRITON", "available", "lidar_box_medians", "lidar_box_quantiles",
           "depth_box_medians", "pixel_rects", "quantile_rank", "radix_select_torch",
           "BLOCK_LIDAR", "BLOCK_RECT", "NUM_WARPS", "LIDAR_COMPACT", "LIDAR_PREBIN",
           "BLOCK_BIN"]

BLOCK_LIDAR = 2048  # points per loop iteration (LiDAR mode)
BLOCK_RECT = 2048  # pixels per loop iteration (rectangle mode)
NUM_WARPS = 8
LIDAR_COMPACT = True  # LiDAR mode: compact the inside keys in pass 0 (see lidar_box_medians)
LIDAR_PREBIN = True  # LiDAR mode: bin the points into the boxes first (module docstring)
BLOCK_BIN = 1024  # points per program of the binning kernel


def quantile_rank(count: torch.Tensor, quantile: float = 0.5) -> torch.Tensor:
    """1-based rank of the lower `quantile` among `count` values: floor((count - 1) * q) + 1
    (q = 0.5: ceil(count / 2), the lower median; q = 1: the largest). count [...] int64;
    the rank is meaningless (0 or 1) where count == 0. The kernel computes the same in
    float32, exact for counts below 2**24."""
    return ((count - 1).clamp(min=0).to(torch.float32) * float(quantile)).floor().long() + 1


def _check_quantile(quantile: float) -> None:
    if not 0.0 <= quantile <= 1.0:
        raise ValueError(f"quantile = {quantile!r}: must be in [0, 1]")

if HAVE_TRITON:
    @triton.jit
    def _float_key(x):
        """float32 -> int32 key, signed order = float order, NaN (either sign) largest."""
        b = x.to(tl.int32, bitcast=True)
        k = b ^ ((b >> 31) & 0x7FFFFFFF)
        return tl.where(x != x, 0x7FFFFFFF, k)

    @triton.jit
    def _load_chunk(it, cam, z_ptr, u_ptr, v_ptr, ok_ptr, N, s_zc, s_zn, s_uc, s_un, s_oc,
                    s_on, bx0, by0, bx1, by1, r0, c0, width, area, s_h, s_w,
                    RECT: tl.constexpr, BLOCK: tl.constexpr):
        """Keys [BLOCK] int32 and inside [BLOCK] bool of loop iteration `it`."""
        offs = it * BLOCK + tl.arange(0, BLOCK)
        if RECT:
            inb = offs < area
            row = r0 + offs // width
            col = c0 + offs % width
            z = tl.load(z_ptr + cam * s_zc + row * s_h + col * s_w, mask=inb,
                        other=float("nan"))
            inside = inb & (z == z)
        else:
            inb = offs < N
            u = tl.load(u_ptr + cam * s_uc + offs * s_un, mask=inb, other=0.0)
            v = tl.load(v_ptr + cam * s_uc + offs * s_un, mask=inb, other=0.0)
            ok = tl.load(ok_ptr + cam * s_oc + offs * s_on, mask=inb, other=0)
            z = tl.load(z_ptr + cam * s_zc + offs * s_zn, mask=inb, other=0.0)
            inside = inb & (ok != 0) & (u >= bx0) & (u <= bx1) & (v >= by0) & (v <= by1)
        return _float_key(z), inside

    @triton.jit
    def _bin_kernel(z_ptr, u_ptr, v_ptr, ok_ptr, box_ptr, need_ptr, scr_ptr, cnt_ptr, D, N,
                    s_zc, s_zn, s_uc, s_un, s_oc, s_on, HAS_NEED: tl.constexpr,
                    BLOCK: tl.constexpr):
        """Grid (cdiv(N, BLOCK), C): the keys of block pid0 of camera pid1's points appended to
        the scratch row (cam * D + box) of every box that holds them; cnt [C*D] int32 (zeroed
        before) ends as each box's count."""
        cam = tl.program_id(1)
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inb = offs < N
        u = tl.load(u_ptr + cam * s_uc + offs * s_un, mask=inb, other=0.0)
        v = tl.load(v_ptr + cam * s_uc + offs * s_un, mask=inb, other=0.0)
        ok = inb & (tl.load(ok_ptr + cam * s_oc + offs * s_on, mask=inb, other=0) != 0)
        key = _float_key(tl.load(z_ptr + cam * s_zc + offs * s_zn, mask=inb, other=0.0))
        for d in range(0, D):
            row = cam * D + d
            use = True
            if HAS_NEED:
                use = tl.load(need_ptr + row) != 0
            if use:
                bx0 = tl.load(box_ptr + row * 4 + 0)
                by0 = tl.load(box_ptr + row * 4 + 1)
                bx1 = tl.load(box_ptr + row * 4 + 2)
                by1 = tl.load(box_ptr + row * 4 + 3)
                inside = ok & (u >= bx0) & (u <= bx1) & (v >= by0) & (v <= by1)
                n_in = tl.sum(inside.to(tl.int32), axis=0)
                if n_in > 0:
                    base = tl.atomic_add(cnt_ptr + row, n_in)
                    dst = base + tl.cumsum(inside.to(tl.int32), axis=0) - 1
                    tl.store(scr_ptr + row.to(tl.int64) * N + dst, key, mask=inside)

    @triton.jit
    def _box_median_kernel(z_ptr, u_ptr, v_ptr, ok_ptr, box_ptr, rect_ptr, need_ptr, scr_ptr,
                           med_ptr, cnt_ptr, D, N, s_zc, s_zn, s_uc, s_un, s_oc, s_on, s_h, s_w,
                           RECT: tl.constexpr, HAS_NEED: tl.constexpr, COMPACT: tl.constexpr,
                           BLOCK: tl.constexpr, PREBINNED: tl.constexpr = False,
                           QUANTILE: tl.constexpr = 0.5):
        # PREBINNED (LiDAR): scr row pid already holds the box's keys (_bin_kernel) and
        # rect_ptr (unused in LiDAR mode) points at their int32 counts; all 4 passes read them
        pid = tl.program_id(0)  # = cam * D + box
        cam = pid // D
        bx0 = 0.0
        by0 = 0.0
        bx1 = 0.0
        by1 = 0.0
        r0 = 0
        c0 = 0
        width = 1
        area = 0
        if RECT:
            c0 = tl.load(rect_ptr + pid * 4 + 0)
            r0 = tl.load(rect_ptr + pid * 4 + 1)
            c1 = tl.load(rect_ptr + pid * 4 + 2)
            r1 = tl.load(rect_ptr + pid * 4 + 3)
            w = tl.maximum(c1 - c0, 0)
            area = w * tl.maximum(r1 - r0, 0)
            width = tl.maximum(w, 1)
            n_it = tl.cdiv(area, BLOCK)
        else:
            bx0 = tl.load(box_ptr + pid * 4 + 0)
            by0 = tl.load(box_ptr + pid * 4 + 1)
            bx1 = tl.load(box_ptr + pid * 4 + 2)
            by1 = tl.load(box_ptr + pid * 4 + 3)
            n_it = tl.cdiv(N, BLOCK)
        if HAS_NEED:
            n_it = tl.where(tl.load(need_ptr + pid) != 0, n_it, 0)
        bins = tl.arange(0, 512)
        cnt = tl.sum(tl.zeros([BLOCK], dtype=tl.int32), axis=0)
        if PREBINNED:
            cnt += tl.load(rect_ptr + pid)
        kk = cnt
        pref = cnt
        for p in tl.static_range(4):
            hist = tl.zeros([512], dtype=tl.int32)
            n_p = n_it
            if p > 0 or PREBINNED:
                if COMPACT or PREBINNED:  # passes 1-3 (all 4: prebinned) read compacted keys
                    n_p = tl.cdiv(cnt, BLOCK)
            for it in range(0, n_p):
                if p == 0 and PREBINNED:
                    offs = it * BLOCK + tl.arange(0, BLOCK)
                    match = offs < cnt
                    key = tl.load(scr_ptr + pid.to(tl.int64) * N + offs, mask=match, other=0)
                    digit = (key >> 24) + 128
                elif p == 0:
                    key, inside = _load_chunk(it, cam, z_ptr, u_ptr, v_ptr, ok_ptr, N, s_zc,
                                              s_zn, s_uc, s_un, s_oc, s_on, bx0, by0, bx1, by1,
                                              r0, c0, width, area, s_h, s_w, RECT, BLOCK)
                    if COMPACT:  # inside keys -> scratch row pid, in order, from 0
                        dst = cnt + tl.cumsum(inside.to(tl.int32), axis=0) - 1
                        tl.store(scr_ptr + pid.to(tl.int64) * N + dst, key, mask=inside)
                    cnt += tl.sum(inside.to(tl.int32), axis=0)
                    match = inside
                    digit = (key >> 24) + 128  # top byte of the signed key -> [0, 255]
                else:
                    if COMPACT or PREBINNED:
                        offs = it * BLOCK + tl.arange(0, BLOCK)
                        inside = offs < cnt
                        key = tl.load(scr_ptr + pid.to(tl.int64) * N + offs, mask=inside,
                                      other=0)
                    else:
                        key, inside = _load_chunk(it, cam, z_ptr, u_ptr, v_ptr, ok_ptr, N, s_zc,
                                                  s_zn, s_uc, s_un, s_oc, s_on, bx0, by0, bx1,
                                                  by1, r0, c0, width, area, s_h, s_w, RECT,
                                                  BLOCK)
                    match = inside & ((key >> (32 - 8 * p)) == pref)
                    digit = (key >> (24 - 8 * p)) & 0xFF
                hist += tl.histogram(tl.where(match, digit, 256), 512)  # bin 256: the rest
            if p == 0:
                kk = (tl.maximum(cnt - 1, 0).to(tl.float32) * QUANTILE).to(tl.int32) + 1
                n_it = tl.where(cnt > 0, n_it, 0)
                if COMPACT and not PREBINNED:
                    tl.debug_barrier()  # the CTA's scratch stores before its loads
            cum = tl.cumsum(hist, axis=0)
            sel = tl.sum((cum < kk).to(tl.int32), axis=0)  # first bin with cum >= kk
            kk -= tl.sum(tl.where(bins < sel, hist, 0), axis=0)
            if p == 0:
                pref = sel - 128
            else:
                pref = pref * 256 + sel
        bits = pref ^ ((pref >> 31) & 0x7FFFFFFF)  # the key map is its own inverse
        tl.store(med_ptr + pid, bits.to(tl.float32, bitcast=True))
        tl.store(cnt_ptr + pid, cnt.to(tl.int64))


def available(t: torch.Tensor) -> bool:
    """True when the kernel can run on tensors like `t` (triton importable, t on CUDA)."""
    return HAVE_TRITON and t.is_cuda


def _check(t: torch.Tensor) -> None:
    if not HAVE_TRITON:
        raise RuntimeError("box_median_triton: triton is not installed (use the torch path)")
    if not t.is_cuda:
        raise RuntimeError(f"box_median_triton: tensors must be on CUDA, got {t.device}")


def _need_arg(need: torch.Tensor | None, c: int, d: int, like: torch.Tensor) -> torch.Tensor:
    if need is None:
        return like  # unused (HAS_NEED=False)
    if tuple(need.shape) != (c, d):
        raise ValueError(f"need: shape {tuple(need.shape)}, expected {(c, d)}")
    return need.to(torch.bool).contiguous().view(torch.uint8)


def lidar_box_medians(depth: torch.Tensor, uv: torch.Tensor, valid: torch.Tensor,
                      boxes: torch.Tensor, need: torch.Tensor | None = None,
                      compact: bool | None = None, block: int | None = None,
                      num_warps: int | None = None, prebin: bool | None = None,
                      quantile: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
    """depth [C,N] m, uv [C,N,2] px, valid [C,N] bool, boxes [C,D,4] xyxy px (inclusive)
    -> (median [C,D] float32 m, count [C,D] int64); see the module docstring. quantile: the
    lower quantile selected instead of the median (`quantile_rank`).
    prebin (default LIDAR_PREBIN): bin the points into the boxes' scratch rows first (one
    pass over the points for all boxes), then select; else compact (default LIDAR_COMPACT):
    pass 0 of each box's program scans all N points and writes its inside keys to the scratch
    and passes 1-3 read only those. The scratch is [C*D, N] int32 (allocated per call: 63 MB
    at the node's sizes). block / num_warps default to BLOCK_LIDAR / NUM_WARPS."""
    med, cnt = lidar_box_quantiles(depth, uv, valid, boxes, (quantile,), need, compact, block,
                                   num_warps, prebin)
    return med[0], cnt


def lidar_box_quantiles(depth: torch.Tensor, uv: torch.Tensor, valid: torch.Tensor,
                        boxes: torch.Tensor, quantiles: tuple[float, ...],
                        need: torch.Tensor | None = None, compact: bool | None = None,
                        block: int | None = None, num_warps: int | None = None,
                        prebin: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`lidar_box_medians` for several lower quantiles of the same points -> (values [Q,C,D]
    float32, count [C,D] int64). With prebin the points are binned once and each quantile is
    one select kernel over the binned keys."""
    _check(depth)
    for q in quantiles:
        _check_quantile(q)
    c, n = depth.shape
    d = boxes.shape[1]
    med = torch.empty((len(quantiles), c, d), dtype=torch.float32, device=depth.device)
    cnt = torch.empty((c, d), dtype=torch.long, device=depth.device)
    if c * d == 0:
        return med, cnt
    z = depth.float()
    uvf = uv.float()
    u, v = uvf[..., 0], uvf[..., 1]  # strided views, same strides
    ok = valid.to(torch.bool).view(torch.uint8)
    bx = boxes.float().contiguous()
    nd = _need_arg(need, c, d, ok)
    prebin = LIDAR_PREBIN if prebin is None else prebin
    if prebin and compact is not None:
        raise ValueError("lidar_box_medians: 'compact' applies to prebin=False only")
    compact = LIDAR_COMPACT if compact is None else compact
    strides = (z.stride(0), z.stride(1), u.stride(0), u.stride(1), ok.stride(0), ok.stride(1))
    scr = torch.empty((c * d, n) if compact or prebin else (1,), dtype=torch.int32,
                      device=z.device)
    counts = bx  # unused unless prebin
    if prebin:
        counts = torch.zeros(c * d, dtype=torch.int32, device=z.device)
        _bin_kernel[(triton.cdiv(n, BLOCK_BIN), c)](
            z, u, v, ok, bx, nd, scr, counts, d, n, *strides, HAS_NEED=need is not None,
            BLOCK=BLOCK_BIN, num_warps=4)
    for i, q in enumerate(quantiles):  # the compact mode rewrites its scratch rows each time
        _box_median_kernel[(c * d,)](
            z, u, v, ok, bx, counts, nd, scr, med[i], cnt, d, n, *strides, 0, 0, RECT=False,
            HAS_NEED=need is not None, COMPACT=compact and not prebin,
            BLOCK=block or BLOCK_LIDAR, num_warps=num_warps or NUM_WARPS, PREBINNED=prebin,
            QUANTILE=float(q))
    return med, cnt


def depth_box_medians(depth_map: torch.Tensor, rect: torch.Tensor,
                      need: torch.Tensor | None = None, block: int | None = None,
                      num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """depth_map [C,H,W] m (NaN = no depth), rect [C,D,4] int (col0, row0, col1, row1), half
    open and inside [0, W] x [0, H] (`pixel_rects`) -> (median [C,D] float32, count [C,D]).
    block / num_warps default to BLOCK_RECT / NUM_WARPS."""
    _check(depth_map)
    c = depth_map.shape[0]
    d = rect.shape[1]
    med = torch.empty((c, d), dtype=torch.float32, device=depth_map.device)
    cnt = torch.empty((c, d), dtype=torch.long, device=depth_map.device)
    if c * d == 0:
        return med, cnt
    dm = depth_map.float()
    rc = rect.to(torch.int32).contiguous()
    nd = _need_arg(need, c, d, rc)
    _box_median_kernel[(c * d,)](
        dm, dm, dm, rc, rc, rc, nd, rc, med, cnt, d, 0, dm.stride(0), 0, 0, 0, 0, 0,
        dm.stride(1), dm.stride(2), RECT=True, HAS_NEED=need is not None, COMPACT=False,
        BLOCK=block or BLOCK_RECT, num_warps=num_warps or NUM_WARPS)
    return med, cnt


def pixel_rects(boxes: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """boxes [C,D,4] xyxy px -> int32 [C,D,4] (col0, row0, col1, row1): the pixel rectangle
    [floor(x1), ceil(x2)) x [floor(y1), ceil(y2)) clipped to the image; NaN edges give an
    empty rectangle (the reference's compares with NaN are all False)."""
    b = boxes.to(torch.float64)
    c0, r0 = b[..., 0].floor(), b[..., 1].floor()
    c1, r1 = b[..., 2].ceil(), b[..., 3].ceil()

    def lo(x: torch.Tensor, m: int) -> torch.Tensor:
        return torch.where(x.isnan(), torch.full_like(x, m), x.clamp(0, m))

    def hi(x: torch.Tensor, m: int) -> torch.Tensor:
        return torch.where(x.isnan(), torch.zeros_like(x), x.clamp(0, m))

    return torch.stack([lo(c0, w), lo(r0, h), hi(c1, w), hi(r1, h)], dim=-1).to(torch.int32)


def _float_key_torch(x: torch.Tensor) -> torch.Tensor:
    b = x.float().contiguous().view(torch.int32)
    k = b ^ ((b >> 31) & 0x7FFFFFFF)
    return torch.where(x.isnan(), torch.full_like(k, 0x7FFFFFFF), k)


def radix_select_torch(z: torch.Tensor, inside: torch.Tensor, quantile: float = 0.5
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's algorithm in torch (for tests): z [C,N] float32, inside [C,D,N] bool ->
    (lower median, or lower `quantile`, [C,D] float32, count [C,D] int64) by 4 byte-wise
    histogram passes."""
    _check_quantile(quantile)
    key = _float_key_torch(z)[:, None, :].expand_as(inside)  # [C,D,N] int32
    cnt = inside.sum(dim=2)
    kk = quantile_rank(cnt, quantile)
    pref = torch.zeros_like(cnt)
    bins = torch.arange(256, device=z.device)
    for p in range(4):
        if p == 0:
            match, digit = inside, (key >> 24).long() + 128
        else:
            match = inside & ((key >> (32 - 8 * p)).long() == pref[..., None])
            digit = ((key >> (24 - 8 * p)) & 0xFF).long()
        hist = (match[..., None] & (digit[..., None] == bins)).sum(dim=2)  # [C,D,256]
        cum = hist.cumsum(dim=2)
        sel = (cum < kk[..., None]).sum(dim=2)
        kk = kk - (hist * (bins < sel[..., None])).sum(dim=2)
        pref = sel - 128 if p == 0 else pref * 256 + sel
    k32 = pref.to(torch.int32)
    bits = k32 ^ ((k32 >> 31) & 0x7FFFFFFF)
    return bits.view(torch.float32), cnt
