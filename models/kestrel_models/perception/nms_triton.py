"""The dense class-wise NMS of `postprocess.batched_nms_dense` as two Triton kernels.

Same inputs and result as the torch path (keep [B,N] bool, converged [] bool), for the static
(CUDA-graphed) decode of the perception node:
  1. `_suppress_kernel`, grid (B, N/BI, N/BJ): suppress[b,i,j] = IoU(box i, box j) > iou_thr
     and j > i and valid[b,i], as uint8, with the torch path's IoU formula and operation order
     (no FMA contraction, IEEE division), so the same pairs cross the threshold;
  2. `_round_kernel`, grid (B, N/BJ), launched rounds + 1 times: keep'[j] = valid[j] and no
     i with suppress[i,j] and keep[i] (ping-pong buffers); the last launch also records per
     program whether any keep changed, so converged = nothing changed in the check round.
Why: in torch each round is a [B,N,N] elementwise AND plus an any() reduction, and the IoU
matrix another dozen [B,N,N] elementwise kernels, a large share of the postprocess stage.
Here: one pass writing the uint8 matrix and one light pass per round.

Launches are graph-capturable (fixed grids, no host reads) once compiled: the region graph's
eager warm-up compiles them. `import triton` is optional: without it (or on CPU tensors)
`available()` is False and `nms_dense` raises RuntimeError (the caller uses the torch path).
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

__all__ = ["HAVE_TRITON", "available", "nms_dense"]

BI, BJ = 32, 128  # suppress tile (rows i, columns j)
RI, RJ = 512, 16  # round kernel: rows per loop step, columns per program (bench_nms_rounds.py)
NUM_WARPS = 4

if HAVE_TRITON:
    @triton.jit
    def _suppress_kernel(boxes_ptr, valid_ptr, out_ptr, n, iou_ptr,
                         BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr):
        b = tl.program_id(0)
        i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        j = tl.program_id(2) * BLOCK_J + tl.arange(0, BLOCK_J)
        mi, mj = i < n, j < n
        base = boxes_ptr + b * n * 4
        ax1 = tl.load(base + i * 4 + 0, mask=mi, other=0.0)
        ay1 = tl.load(base + i * 4 + 1, mask=mi, other=0.0)
        ax2 = tl.load(base + i * 4 + 2, mask=mi, other=0.0)
        ay2 = tl.load(base + i * 4 + 3, mask=mi, other=0.0)
        bx1 = tl.load(base + j * 4 + 0, mask=mj, other=0.0)
        by1 = tl.load(base + j * 4 + 1, mask=mj, other=0.0)
        bx2 = tl.load(base + j * 4 + 2, mask=mj, other=0.0)
        by2 = tl.load(base + j * 4 + 3, mask=mj, other=0.0)
        # as postprocess._box_iou_batched: areas, clamped overlap, inter / clamp(union)
        area_a = tl.maximum(ax2 - ax1, 0.0) * tl.maximum(ay2 - ay1, 0.0)
        area_b = tl.maximum(bx2 - bx1, 0.0) * tl.maximum(by2 - by1, 0.0)
        iw = tl.maximum(tl.minimum(ax2[:, None], bx2[None, :])
                        - tl.maximum(ax1[:, None], bx1[None, :]), 0.0)
        ih = tl.maximum(tl.minimum(ay2[:, None], by2[None, :])
                        - tl.maximum(ay1[:, None], by1[None, :]), 0.0)
        inter = iw * ih
        union = tl.maximum(area_a[:, None] + area_b[None, :] - inter, 1e-9)
        iou = tl.math.div_rn(inter, union)
        vi = tl.load(valid_ptr + b * n + i, mask=mi, other=0)
        iou_thr = tl.load(iou_ptr)  # fp32 from memory: a new threshold needs no recapture
        sup = (iou > iou_thr) & (j[None, :] > i[:, None]) & (vi[:, None] != 0)
        m2 = mi[:, None] & mj[None, :]
        tl.store(out_ptr + b * n * n + i[:, None] * n + j[None, :], sup.to(tl.uint8), mask=m2)

    @triton.jit
    def _round_kernel(sup_ptr, valid_ptr, keep_in_ptr, keep_out_ptr, changed_ptr, n,
                      BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr):
        b = tl.program_id(0)
        pj = tl.program_id(1)
        j = pj * BLOCK_J + tl.arange(0, BLOCK_J)
        mj = j < n
        hit = tl.zeros([BLOCK_J], dtype=tl.int32)
        for i0 in range(0, n, BLOCK_I):
            i = i0 + tl.arange(0, BLOCK_I)
            mi = i < n
            ki = tl.load(keep_in_ptr + b * n + i, mask=mi, other=0).to(tl.int32)
            s = tl.load(sup_ptr + b * n * n + i[:, None] * n + j[None, :],
                        mask=mi[:, None] & mj[None, :], other=0).to(tl.int32)
            hit = tl.maximum(hit, tl.max(s * ki[:, None], axis=0))
        vj = tl.load(valid_ptr + b * n + j, mask=mj, other=0).to(tl.int32)
        old = tl.load(keep_in_ptr + b * n + j, mask=mj, other=0).to(tl.int32)
        new = tl.where(hit == 0, vj, 0)
        tl.store(keep_out_ptr + b * n + j, new.to(tl.uint8), mask=mj)
        changed = tl.max(tl.where(mj, (new != old).to(tl.int32), 0), axis=0)
        tl.store(changed_ptr + b * tl.num_programs(1) + pj, changed)


def available(t: torch.Tensor) -> bool:
    """True when the kernels can run on tensors like `t` (triton importable, t on CUDA)."""
    return HAVE_TRITON and t.is_cuda


def nms_dense(boxes: torch.Tensor, valid: torch.Tensor, iou_thr: float | torch.Tensor,
              rounds: int) -> tuple[torch.Tensor, torch.Tensor]:
    """boxes [B,N,4] xyxy (already offset by class, sorted by descending score per image),
    valid [B,N] bool -> (keep [B,N] bool after `rounds` rounds + the check round, converged []
    bool), as `postprocess.batched_nms_dense`. No host sync. iou_thr: a float or a 0-d/[1]
    fp32 tensor on the boxes' device (read by the kernel: a captured graph follows its value)."""
    if not available(boxes):
        raise RuntimeError("nms_triton: needs triton and CUDA tensors (use the torch path)")
    bsz, n = valid.shape
    boxes = boxes.float().contiguous()
    v8 = valid.to(torch.uint8).contiguous()
    thr = iou_thr.reshape(1).float() if torch.is_tensor(iou_thr) else \
        torch.full((1,), float(iou_thr), dtype=torch.float32, device=boxes.device)
    sup = torch.empty((bsz, n, n), dtype=torch.uint8, device=boxes.device)
    _suppress_kernel[(bsz, triton.cdiv(n, BI), triton.cdiv(n, BJ))](
        boxes, v8, sup, n, thr, BLOCK_I=BI, BLOCK_J=BJ, num_warps=NUM_WARPS,
        enable_fp_fusion=False)
    nj = triton.cdiv(n, RJ)
    changed = torch.empty((bsz, nj), dtype=torch.int32, device=boxes.device)
    bufs = (v8.clone(), torch.empty_like(v8))
    for r in range(max(1, rounds) + 1):  # the last one is the check round
        _round_kernel[(bsz, nj)](sup, v8, bufs[r % 2], bufs[(r + 1) % 2], changed, n,
                                 BLOCK_I=RI, BLOCK_J=RJ, num_warps=NUM_WARPS)
    keep = bufs[(max(1, rounds) + 1) % 2].bool()
    return keep, changed.amax() == 0
