"""Whole-row Triton GEMV kernels with the decode step's neighbours fused in, as torch.library
ops (triton_decode.py says how the ops run; each op has a torch CPU path with the same
meaning). At batch 1 a small model's step is a chain of short, latency-bound kernels; these
take the RMSNorm before a projection and the residual add after one into the GEMV itself.

kestrel::rms_gemv(x, norm_w, eps, w, bias) -> y [M, N] in x's dtype
    y = F.linear(rms_norm(x) * norm_w, w, bias): the attention block's RMSNorm + qkv projection
    (x [M, K], w [N, K], bias [N] or None). Every program normalises its row of x itself
    (K elements, from L2) rather than waiting for a norm kernel; the normalised row is rounded
    as transformers' RMSNorm rounds it, the sum with the bias once at the end.
kestrel::gemv_add(x, w, res) -> y [M, N] in res's dtype
    y = res + (x @ w.T) rounded to res's dtype first (as `res + F.linear(x, w)`): the output
    projection and w_down with their residual adds.

kestrel::rms_gemv_pdl, kestrel::gemv_add_pdl: the same ops, their kernels launched with
    programmatic dependent launch (triton_common.py): each reads its first weight tile, then
    waits for the kernel before it.

Each program computes BLOCK_N outputs of one row over the whole of K in one tile (no split-K,
no reduction kernel): block_shape() picks the tile from K so that one load covers it, which
suits K <= a few thousand. fp32 accumulation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kestrel_models.planner.triton_common import (HAVE_TRITON, launch, need_triton, register, tl,
                                                  triton)

__all__ = ["rms_gemv", "gemv_add", "rms_gemv_pdl", "gemv_add_pdl", "block_shape", "TILE_ELEMS",
           "MAX_BLOCK_K"]

TILE_ELEMS = 4096  # weight elements per program and load (BLOCK_N * BLOCK_K)
MAX_BLOCK_K = 2048  # longer rows loop over K in tiles of this length


def block_shape(k: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K): BLOCK_K = K rounded up to a power of 2 (at least 16, at most
    MAX_BLOCK_K), BLOCK_N = the outputs that fill TILE_ELEMS with it."""
    bk = min(MAX_BLOCK_K, max(16, 1 << (k - 1).bit_length()))
    return max(1, TILE_ELEMS // bk), bk


if HAVE_TRITON:
    @triton.jit
    def _row_rstd(row_ptr, eps, K: tl.constexpr, BLOCK_K: tl.constexpr):
        """1 / sqrt(mean(x^2) + eps) of the K elements at row_ptr, in fp32."""
        ss = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            xv = tl.load(row_ptr + k, mask=k < K, other=0.0).to(tl.float32)
            ss += xv * xv
        return 1.0 / tl.sqrt(tl.sum(ss, 0) / K + eps)

    @triton.jit
    def _w_tile(w_ptr, n, nok, swn, k, ok):
        """The weight tile w[n, k] ([BLOCK_N, BLOCK_K]; zero outside rows nok, columns ok)."""
        return tl.load(w_ptr + n[:, None] * swn + k[None, :], mask=nok[:, None] & ok[None, :],
                       other=0.0)

    @triton.jit
    def _rms_row(xv, rstd, nv):
        """The RMSNorm of a row (fp32 rstd) with the roundings of transformers' Llama/Qwen2
        RMSNorm in x's dtype: x * rstd rounded, times the weight, rounded (F.rms_norm rounds
        once, at the end); fp32 out."""
        xn = (xv.to(tl.float32) * rstd).to(xv.dtype)
        return (xn.to(tl.float32) * nv.to(tl.float32)).to(xv.dtype).to(tl.float32)

    @triton.jit
    def _rms_gemv_kernel(x_ptr, nw_ptr, w_ptr, b_ptr, o_ptr, eps, N, K: tl.constexpr, sxm, swn,
                         som, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        pn, m = tl.program_id(0), tl.program_id(1)
        n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        nok = n < N
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        # the first weight tile (all of K when K <= BLOCK_K): read before the wait, since the
        # weights do not depend on the kernel before this one
        k = tl.arange(0, BLOCK_K)
        ok = k < K
        wt = _w_tile(w_ptr, n, nok, swn, k, ok)
        if PDL:
            tl.extra.cuda.gdc_wait()
        rstd = _row_rstd(x_ptr + m * sxm, eps, K, BLOCK_K)
        xv = tl.load(x_ptr + m * sxm + k, mask=ok, other=0.0)
        nv = tl.load(nw_ptr + k, mask=ok, other=0.0)
        acc = wt.to(tl.float32) * _rms_row(xv, rstd, nv)[None, :]
        for k0 in range(BLOCK_K, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            ok = k < K
            wt = _w_tile(w_ptr, n, nok, swn, k, ok)
            xv = tl.load(x_ptr + m * sxm + k, mask=ok, other=0.0)
            nv = tl.load(nw_ptr + k, mask=ok, other=0.0)
            acc += wt.to(tl.float32) * _rms_row(xv, rstd, nv)[None, :]
        y = tl.sum(acc, 1)
        if HAS_BIAS:  # added before the one rounding, as F.linear's addmm does
            y += tl.load(b_ptr + n, mask=nok, other=0.0).to(tl.float32)
        tl.store(o_ptr + m * som + n, y.to(o_ptr.dtype.element_ty), mask=nok)

    @triton.jit
    def _gemv_add_kernel(x_ptr, w_ptr, res_ptr, y_ptr, N, K: tl.constexpr, sxm, swn, srm, sym,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        pn, m = tl.program_id(0), tl.program_id(1)
        n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        nok = n < N
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        k = tl.arange(0, BLOCK_K)  # the first weight tile before the wait (_rms_gemv_kernel)
        ok = k < K
        wt = _w_tile(w_ptr, n, nok, swn, k, ok)
        if PDL:
            tl.extra.cuda.gdc_wait()
        xv = tl.load(x_ptr + m * sxm + k, mask=ok, other=0.0)
        acc = wt.to(tl.float32) * xv.to(tl.float32)[None, :]
        for k0 in range(BLOCK_K, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            ok = k < K
            wt = _w_tile(w_ptr, n, nok, swn, k, ok)
            xv = tl.load(x_ptr + m * sxm + k, mask=ok, other=0.0)
            acc += wt.to(tl.float32) * xv.to(tl.float32)[None, :]
        r = tl.load(res_ptr + m * srm + n, mask=nok, other=0.0)
        y = r.to(tl.float32) + tl.sum(acc, 1).to(r.dtype).to(tl.float32)
        tl.store(y_ptr + m * sym + n, y.to(y_ptr.dtype.element_ty), mask=nok)


def _check(name: str, x: Tensor, w: Tensor) -> None:
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"{name}: x [M, K] and w [N, K] expected, got {tuple(x.shape)} and "
                         f"{tuple(w.shape)}")


def _rms_gemv_run(x: Tensor, norm_w: Tensor, eps: float, w: Tensor, bias: Tensor | None,
                  pdl: bool) -> Tensor:
    _check("rms_gemv", x, w)
    if x.device.type != "cuda":
        return F.linear(F.rms_norm(x, (x.shape[-1],), norm_w, eps), w, bias)
    need_triton("attn_proj='triton'")
    x = x if x.stride(-1) == 1 else x.contiguous()
    (m, k), n = x.shape, w.shape[0]
    bn, bk = block_shape(k)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    launch(_rms_gemv_kernel, (triton.cdiv(n, bn), m), pdl,
           x, norm_w, w, bias if bias is not None else y, y, eps, n, K=k, sxm=x.stride(0),
           swn=w.stride(0), som=y.stride(0), HAS_BIAS=bias is not None, BLOCK_N=bn, BLOCK_K=bk)
    return y


def _gemv_add_run(x: Tensor, w: Tensor, res: Tensor, pdl: bool) -> Tensor:
    _check("gemv_add", x, w)
    if res.shape != (x.shape[0], w.shape[0]):
        raise ValueError(f"gemv_add: res must be [M, N] = {(x.shape[0], w.shape[0])}, got "
                         f"{tuple(res.shape)}")
    if x.device.type != "cuda":
        return res + F.linear(x, w).to(res.dtype)
    need_triton("attn_proj='triton' / mlp='triton_fused'")
    x = x if x.stride(-1) == 1 else x.contiguous()
    (m, k), n = x.shape, w.shape[0]
    bn, bk = block_shape(k)
    y = torch.empty((m, n), dtype=res.dtype, device=x.device)
    launch(_gemv_add_kernel, (triton.cdiv(n, bn), m), pdl,
           x, w, res, y, n, k, x.stride(0), w.stride(0), res.stride(0), y.stride(0),
           BLOCK_N=bn, BLOCK_K=bk)
    return y


def _rms_gemv(x: Tensor, norm_w: Tensor, eps: float, w: Tensor, bias: Tensor | None) -> Tensor:
    return _rms_gemv_run(x, norm_w, eps, w, bias, pdl=False)


def _rms_gemv_pdl(x: Tensor, norm_w: Tensor, eps: float, w: Tensor,
                  bias: Tensor | None) -> Tensor:
    return _rms_gemv_run(x, norm_w, eps, w, bias, pdl=True)


def _rms_gemv_fake(x: Tensor, norm_w: Tensor, eps: float, w: Tensor,
                   bias: Tensor | None) -> Tensor:
    return x.new_empty((x.shape[0], w.shape[0]))


def _gemv_add(x: Tensor, w: Tensor, res: Tensor) -> Tensor:
    return _gemv_add_run(x, w, res, pdl=False)


def _gemv_add_pdl(x: Tensor, w: Tensor, res: Tensor) -> Tensor:
    return _gemv_add_run(x, w, res, pdl=True)


def _gemv_add_fake(x: Tensor, w: Tensor, res: Tensor) -> Tensor:
    return res.new_empty((x.shape[0], w.shape[0]))


rms_gemv = register("rms_gemv", _rms_gemv)
gemv_add = register("gemv_add", _gemv_add)
# the same ops launched with PDL (triton_common.py): opaque to inductor
rms_gemv_pdl = register("rms_gemv_pdl", _rms_gemv_pdl, fake=_rms_gemv_fake, opaque=True)
gemv_add_pdl = register("gemv_add_pdl", _gemv_add_pdl, fake=_gemv_add_fake, opaque=True)
