"""Triton GEMV kernels of the decode step's MLP block, as torch.library ops (triton_decode.py
says how the ops run; every op has a torch CPU path with the same meaning).

kestrel::silu_gemv(x, w, n_split, silu) -> partial [n_split, M, N] float32
    split-K GEMV: sum over dim 0 = a @ w.T with a = silu(x[:, :F]) * x[:, F:] (silu=True,
    x [M, 2F], w [N, F]: the SwiGLU product fused into w_down's prologue) or a = x (x [M, K]).
    Split s covers K-range [s * kc, (s + 1) * kc), kc = ceil(K / n_split) rounded up to the
    block (so the caller's `.sum(0)` + residual add fuse into one inductor kernel).
kestrel::silu_gemv_add(x, w, res, sem, n_split, silu) -> y [M, N] in res's dtype
    res + the sum over splits of silu_gemv's partials, in one kernel: the last split to
    arrive at each (row, block of outputs) counter (gemv_sem()) adds them up with the
    residual (the same roundings as `res + partial.sum(0).to(res.dtype)`).
kestrel::rms_w13_silu(x, norm_w, eps, w13) -> a [M, F]
    a = silu(h @ wg.T) * (h @ wu.T), h = rms_norm(x) * norm_w, w13 = [wg; wu] [2F, K]: RMSNorm,
    the w13 GEMV and the SwiGLU product in one kernel (fp32 accumulation; h, gate, up and
    silu(gate) rounded to x's dtype as transformers' RMSNorm and MLP round them).
mlp_triton(..., whole_rows=True): rms_w13_silu, then triton_gemv.gemv_add for w_down and the
    residual: the whole block in two kernels (pdl=True: kestrel::rms_w13_silu_pdl and
    kestrel::gemv_add_pdl, the same kernels launched with PDL, triton_common.py).

Launch configurations (GEMV_CFG): constants picked on an H200 with the kernel
micro-benchmarks, not autotuned at runtime. rms_w13_silu takes a whole row per tile
(triton_gemv.block_shape) when K <= triton_gemv.MAX_BLOCK_K, GEMV_CFG['w13'] otherwise
(planner_steps_h100.md: whole rows the faster; its notes have the comparison).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kestrel_models.planner.triton_common import (HAVE_TRITON, launch, need_triton, register, tl,
                                                  triton, wrap)
from kestrel_models.planner.triton_gemv import MAX_BLOCK_K, block_shape, gemv_add, gemv_add_pdl

if HAVE_TRITON:
    from kestrel_models.planner.triton_common import _last_arrival
    from kestrel_models.planner.triton_gemv import _rms_row, _row_rstd, _w_tile

__all__ = ["silu_gemv", "silu_gemv_add", "gemv_sem", "rms_w13_silu", "rms_w13_silu_pdl",
           "mlp_triton", "GEMV_CFG"]

# GEMV launch shapes: (BLOCK_N, BLOCK_K, n_split) for w_down, (BLOCK_N, BLOCK_K) for w13 rows
# longer than MAX_BLOCK_K.
GEMV_CFG = {"down": (32, 128, 16), "w13": (8, 128)}

if HAVE_TRITON:
    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, o_ptr, res_ptr, y_ptr, sem_ptr, M, N, K, sxm, swn, srm, sym,
                     KC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SILU: tl.constexpr, SEM: tl.constexpr, N_SPLIT: tl.constexpr):
        pn, s, m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(s * KC, s * KC + KC, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            ok = k < K
            if SILU:  # a = silu(gate) * up, gate = x[m, :K], up = x[m, K:2K]
                gt = tl.load(x_ptr + m * sxm + k, mask=ok, other=0.0).to(tl.float32)
                up = tl.load(x_ptr + m * sxm + K + k, mask=ok, other=0.0).to(tl.float32)
                a = gt * tl.sigmoid(gt) * up
            else:
                a = tl.load(x_ptr + m * sxm + k, mask=ok, other=0.0).to(tl.float32)
            wt = _w_tile(w_ptr, n, n < N, swn, k, ok)
            acc += wt.to(tl.float32) * a[None, :]
        tl.store(o_ptr + (s * M + m) * N + n, tl.sum(acc, 1), mask=n < N)
        if SEM:  # the last split of this block of outputs: y = res + sum of the splits
            cnt = sem_ptr + m * tl.num_programs(0) + pn
            if _last_arrival(cnt, N_SPLIT):
                sp = tl.arange(0, N_SPLIT)
                part = tl.load(o_ptr + (sp[:, None] * M + m) * N + n[None, :],
                               mask=(n < N)[None, :], other=0.0, cache_modifier=".cg")
                r = tl.load(res_ptr + m * srm + n, mask=n < N, other=0.0)
                y = (r.to(tl.float32) + tl.sum(part, 0).to(r.dtype).to(tl.float32))
                tl.store(y_ptr + m * sym + n, y.to(y_ptr.dtype.element_ty), mask=n < N)
                tl.atomic_xchg(cnt, 0)  # ready for the next call

    @triton.jit
    def _w13_kernel(x_ptr, nw_ptr, w_ptr, o_ptr, eps, F_: tl.constexpr, K: tl.constexpr,
                    sxm, swn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        pn, m = tl.program_id(0), tl.program_id(1)
        n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        nok = n < F_
        if PDL:  # triton_common.py: the first weight tiles before the wait
            tl.extra.cuda.gdc_launch_dependents()
        k = tl.arange(0, BLOCK_K)
        ok = k < K
        wg = _w_tile(w_ptr, n, nok, swn, k, ok)
        wu = _w_tile(w_ptr, n + F_, nok, swn, k, ok)
        if PDL:
            tl.extra.cuda.gdc_wait()
        rstd = _row_rstd(x_ptr + m * sxm, eps, K, BLOCK_K)
        h = _rms_row(tl.load(x_ptr + m * sxm + k, mask=ok, other=0.0), rstd,
                     tl.load(nw_ptr + k, mask=ok, other=0.0))
        ag = wg.to(tl.float32) * h[None, :]
        au = wu.to(tl.float32) * h[None, :]
        for k0 in range(BLOCK_K, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            ok = k < K
            xv = tl.load(x_ptr + m * sxm + k, mask=ok, other=0.0)
            nv = tl.load(nw_ptr + k, mask=ok, other=0.0)
            h = _rms_row(xv, rstd, nv)
            wg = _w_tile(w_ptr, n, nok, swn, k, ok)
            wu = _w_tile(w_ptr, n + F_, nok, swn, k, ok)
            ag += wg.to(tl.float32) * h[None, :]
            au += wu.to(tl.float32) * h[None, :]
        # gate, up and SiLU(gate) rounded to the output dtype, as torch's ops between them
        # (and transformers' MLP) round them
        dt = o_ptr.dtype.element_ty
        gt = tl.sum(ag, 1).to(dt).to(tl.float32)
        up = tl.sum(au, 1).to(dt).to(tl.float32)
        out = (gt * tl.sigmoid(gt)).to(dt).to(tl.float32) * up
        tl.store(o_ptr + m * F_ + n, out.to(o_ptr.dtype.element_ty), mask=nok)


def _chunks(k: int, n_split: int, block: int) -> int:
    """K-range length of one split (a multiple of block)."""
    per = -(-k // n_split)  # ceil(K / n_split)
    return -(-per // block) * block


def _silu_gemv_ref(x: Tensor, w: Tensor, n_split: int, silu: bool, block: int) -> Tensor:
    k = w.shape[1]
    a = (F.silu(x[:, :k].float()) * x[:, k:].float()) if silu else x.float()
    kc = _chunks(k, n_split, block)
    wf = w.float()
    return torch.stack([a[:, i * kc:(i + 1) * kc] @ wf[:, i * kc:(i + 1) * kc].T
                        for i in range(n_split)])


def _rms_w13_ref(x: Tensor, norm_w: Tensor, eps: float, w13: Tensor) -> Tensor:
    h = F.rms_norm(x, (x.shape[-1],), norm_w, eps)
    gate, up = F.linear(h, w13).chunk(2, dim=-1)
    return F.silu(gate) * up


def _silu_gemv(x: Tensor, w: Tensor, n_split: int, silu: bool) -> Tensor:
    if x.device.type != "cuda":
        return _silu_gemv_ref(x, w, n_split, silu, GEMV_CFG["down"][1])
    need_triton("mlp='triton'")
    return _silu_gemv_triton(x, w, n_split, silu)


def _silu_gemv_triton(x: Tensor, w: Tensor, n_split: int, silu: bool) -> Tensor:
    bn, bk, _ = GEMV_CFG["down"]
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, (n, k) = x.shape[0], w.shape
    out = torch.empty((n_split, m, n), dtype=torch.float32, device=x.device)
    wrap(_gemv_kernel)[(triton.cdiv(n, bn), n_split, m)](
        x, w, out, out, out, out, m, n, k, x.stride(0), w.stride(0), 0, 0,
        KC=_chunks(k, n_split, bk), BLOCK_N=bn, BLOCK_K=bk, SILU=silu, SEM=False,
        N_SPLIT=n_split)
    return out


def _n_counters(rows: int, n: int) -> int:
    """silu_gemv_add's arrival counters for rows x n outputs: one per (row, block of outputs)."""
    return rows * -(-n // GEMV_CFG["down"][0])


def gemv_sem(rows: int, n: int, device: torch.device | str) -> Tensor:
    """The zeroed arrival counters of silu_gemv_add for up to `rows` rows and n outputs (each
    call leaves them zero again)."""
    return torch.zeros(_n_counters(rows, n), dtype=torch.int32, device=device)


def _silu_gemv_add(x: Tensor, w: Tensor, res: Tensor, sem: Tensor, n_split: int,
                   silu: bool) -> Tensor:
    need = _n_counters(x.shape[0], w.shape[0])
    if n_split & (n_split - 1) or sem.numel() < need:
        raise ValueError(f"silu_gemv_add: n_split {n_split} must be a power of 2 and sem "
                         f"must hold {need} counters (has {sem.numel()})")
    if x.device.type != "cuda":
        part = _silu_gemv_ref(x, w, n_split, silu, GEMV_CFG["down"][1])
        return res + part.sum(0).to(res.dtype)
    need_triton("mlp='triton_down_residual'")
    return _silu_gemv_add_triton(x, w, res, sem, n_split, silu)


def _silu_gemv_add_triton(x: Tensor, w: Tensor, res: Tensor, sem: Tensor, n_split: int,
                          silu: bool) -> Tensor:
    bn, bk, _ = GEMV_CFG["down"]
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, (n, k) = x.shape[0], w.shape
    part = torch.empty((n_split, m, n), dtype=torch.float32, device=x.device)
    y = torch.empty((m, n), dtype=res.dtype, device=x.device)
    wrap(_gemv_kernel)[(triton.cdiv(n, bn), n_split, m)](
        x, w, part, res, y, sem, m, n, k, x.stride(0), w.stride(0), res.stride(0), y.stride(0),
        KC=_chunks(k, n_split, bk), BLOCK_N=bn, BLOCK_K=bk, SILU=silu, SEM=True,
        N_SPLIT=n_split)
    return y


def _rms_w13_run(x: Tensor, norm_w: Tensor, eps: float, w13: Tensor, pdl: bool) -> Tensor:
    if x.device.type != "cuda":
        return _rms_w13_ref(x, norm_w, eps, w13)
    need_triton("mlp='triton'")
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x.shape
    bn, bk = block_shape(k) if k <= MAX_BLOCK_K else GEMV_CFG["w13"]
    f = w13.shape[0] // 2
    out = torch.empty((m, f), dtype=x.dtype, device=x.device)
    launch(_w13_kernel, (triton.cdiv(f, bn), m), pdl, x, norm_w, w13, out, eps, F_=f, K=k,
           sxm=x.stride(0), swn=w13.stride(0), BLOCK_N=bn, BLOCK_K=bk)
    return out


def _rms_w13_silu(x: Tensor, norm_w: Tensor, eps: float, w13: Tensor) -> Tensor:
    return _rms_w13_run(x, norm_w, eps, w13, pdl=False)


def _rms_w13_silu_pdl(x: Tensor, norm_w: Tensor, eps: float, w13: Tensor) -> Tensor:
    return _rms_w13_run(x, norm_w, eps, w13, pdl=True)


def _rms_w13_fake(x: Tensor, norm_w: Tensor, eps: float, w13: Tensor) -> Tensor:
    return x.new_empty((x.shape[0], w13.shape[0] // 2))


def _gemv_add_fake(x: Tensor, w: Tensor, res: Tensor, sem: Tensor, n_split: int,
                   silu: bool) -> Tensor:
    return res.new_empty((x.shape[0], w.shape[0]))


silu_gemv = register("silu_gemv", _silu_gemv)
# the counters return to zero; declared mutated all the same
silu_gemv_add = register("silu_gemv_add", _silu_gemv_add, ("sem",), _gemv_add_fake)
rms_w13_silu = register("rms_w13_silu", _rms_w13_silu)
rms_w13_silu_pdl = register("rms_w13_silu_pdl", _rms_w13_silu_pdl, fake=_rms_w13_fake,
                            opaque=True)  # launched with PDL (triton_common.py)


def mlp_triton(x: Tensor, norm_w: Tensor, eps: float, w13: Tensor, w2: Tensor,
               fuse_w13: bool, sem: Tensor | None = None, whole_rows: bool = False,
               pdl: bool = False) -> Tensor:
    """The SwiGLU block with residual for one decode position: x [B, 1, D] -> [B, 1, D].
    fuse_w13: RMSNorm + w13 + SiLU*up in one Triton kernel, then the split-K w_down GEMV;
    else RMSNorm + w13 as plain torch (inductor's GEMV) and SiLU*up fused into w_down.
    sem (gemv_sem(B, D)): the w_down kernel also sums its splits and adds the residual (the
    last split to finish each block of outputs does); without it a separate reduction does.
    whole_rows: RMSNorm + w13 + SiLU*up in one kernel, then w_down + residual in another over
    whole rows (triton_gemv.gemv_add): two kernels, no split-K (for short rows); pdl: those two
    launched with PDL (the ops' _pdl variants)."""
    x2 = x[:, 0]
    if whole_rows and pdl:
        return gemv_add_pdl(rms_w13_silu_pdl(x2, norm_w, eps, w13), w2, x2)[:, None]
    if whole_rows:
        return gemv_add(rms_w13_silu(x2, norm_w, eps, w13), w2, x2)[:, None]
    n_split = GEMV_CFG["down"][2]
    if fuse_w13:
        a, silu = rms_w13_silu(x2, norm_w, eps, w13), False
    else:
        a, silu = F.linear(F.rms_norm(x2, (x2.shape[-1],), norm_w, eps), w13), True
    if sem is not None:
        return silu_gemv_add(a, w2, x2, sem, n_split, silu)[:, None]
    return x + silu_gemv(a, w2, n_split, silu).sum(0).to(x.dtype)[:, None]
