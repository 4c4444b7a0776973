"""Triton kernels for the decode step (S = 1 per row) as torch.library ops inductor keeps inside
the compiled, CUDA-graph-captured step; every op has a torch CPU path with the same meaning, so
the same op and call sites run in CPU CI (no triton needed there).

kestrel::decode_attention(q, k, v, pos, chunk, window) -> out
    q [B, H, hd] (pre-scaled by 1/sqrt(hd)), k, v [B, Hkv, L, hd] (cache rows, any strides with
    a contiguous last dim), pos [B] long -> out [B, H * hd] in q's dtype: row b attends keys
    0..pos[b] (pos[b] < L; with window > 0 only keys > pos[b] - window: sliding-window
    attention), query head h reads kv head h // (H / Hkv). Flash decoding: one
    program per (row, kv head) handles the G = H / Hkv query heads of its kv head together
    (G padded to 16 rows for tl.dot), online softmax in fp32, looping only over positions
    <= pos[b] (read from the tensor: no recompile, graph-safe). chunk = 0: one pass; chunk > 0:
    the positions are split into chunks of that many keys, one program per (row, kv head,
    chunk) (chunks past pos[b] exit at once), then a combine kernel (two kernels in all).
kestrel::decode_attention_fused(qkv, cis, k_cache, v_cache, pos, kv_len, chunk, window) -> out
    the same attention from the raw qkv projection [B, (H + 2 Hkv) * hd] (q/k features in RoPE
    pair order, q pre-scaled): RoPE of q and k at pos (cis [B, hd/2, 2] float32 = cos, sin),
    k (roped) and v written IN PLACE into the caches k_cache, v_cache [max_batch, Hkv, max_len,
    hd] at (row b < B, pos[b]) (mutates_args), then attention over keys 0..pos[b] (within the
    window, as decode_attention) -> [B, H*hd].
    The kernel takes the new key from registers (the cache is read only below pos[b]: no
    read-after-write inside the kernel); kv_len only bounds the CPU path's key slice.
kestrel::decode_attention_fused_split(qkv, cis, k_cache, v_cache, pos, sem, kv_len, chunk,
                                     window) -> out
    the same op with the keys split over programs (chunk > 0) in ONE kernel: each (row, kv
    head, chunk) program stores its partial softmax state, then adds 1 to its (row, kv head)
    counter in sem (attn_sem(): int32, zero; acq_rel at GPU scope, after a CTA barrier); the
    program that arrives last combines the partials and sets the counter back to zero.
kestrel::silu_gemv_add(x, w, res, sem, n_split, silu) -> y [M, N] in res's dtype
    res + the sum over splits of silu_gemv's partials, in one kernel: the last split to
    arrive at each (row, block of outputs) counter (gemv_sem()) adds them up with the
    residual (the same roundings as `res + partial.sum(0).to(res.dtype)`).
kestrel::silu_gemv(x, w, n_split, silu) -> partial [n_split, M, N] float32
    split-K GEMV: sum over dim 0 = a @ w.T with a = silu(x[:, :F]) * x[:, F:] (silu=True,
    x [M, 2F], w [N, F]: the SwiGLU product fused into w_down's prologue) or a = x (x [M, K]).
    Split s covers K-range [s * kc, (s + 1) * kc), kc = ceil(K / n_split) rounded up to the
    block (so the caller's `.sum(0)` + residual add fuse into one inductor kernel).
kestrel::rms_w13_silu(x, norm_w, eps, w13) -> a [M, F]
    a = silu(h @ wg.T) * (h @ wu.T), h = rms_norm(x) * norm_w, w13 = [wg; wu] [2F, K]: RMSNorm,
    the w13 GEMV and the SwiGLU product in one kernel (fp32 accumulation).

`import triton` happens only here and is guarded: without triton (CPU CI) the ops still exist
and their CPU path runs; their CUDA path raises RuntimeError saying that triton is missing.
Launch configurations (BLOCK_* below): constants picked on an H200 with the kernel
micro-benchmarks, not autotuned at runtime. In the compiled step the fused attention runs 4
pointwise kernels per layer fewer than 'triton' (RoPE, the cast and two index_put kernels);
figures in docs/benchmarks/planner_h200.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

try:  # the GPU path only
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except ImportError:  # CPU CI: the ops' torch path still works
    triton = tl = None  # type: ignore[assignment]
    HAVE_TRITON = False

__all__ = ["HAVE_TRITON", "decode_attention", "decode_attention_fused",
           "decode_attention_fused_split", "silu_gemv",
           "silu_gemv_add", "attn_sem", "gemv_sem",
           "rms_w13_silu", "mlp_triton", "attention_ref", "fused_ref", "ATTN_BLOCK_L",
           "attn_block_l", "GEMV_CFG"]

ATTN_BLOCK_L = 128  # keys per loop iteration of the one-pass attention kernel (chunk = 0)
ATTN_BLOCK_BYTES = 32 * 1024  # at most this per K (or V) block in shared memory: see attn_block_l
# GEMV launch shapes: (BLOCK_N, BLOCK_K, n_split) for w_down, (BLOCK_N, BLOCK_K) for w13.
GEMV_CFG = {"down": (32, 128, 16), "w13": (8, 128)}
_OP = (torch.library.triton_op if HAVE_TRITON and hasattr(torch.library, "triton_op")
       else None)


def _need_triton(what: str) -> None:
    if not HAVE_TRITON or _OP is None:
        raise RuntimeError(f"{what}: the CUDA path needs triton (and torch >= 2.6), which is "
                           f"missing here (import triton failed); use the default options")


def _wrap(kernel):  # noqa: ANN001, ANN202 - a triton JITFunction
    return torch.library.wrap_triton(kernel)


if HAVE_TRITON:
    @triton.jit
    def _flash(q, kb, vb, skl, svl, m_i, l_i, acc, start, end, o_ptr, m_ptr, l_ptr, b, hk, s,
               sob, G: tl.constexpr, G_PAD: tl.constexpr, HD: tl.constexpr,
               BLOCK_L: tl.constexpr, N_SPLIT: tl.constexpr, IEEE: tl.constexpr):
        """Online softmax over keys [start, end) of one (row, kv head), from state (m_i, l_i,
        acc), then the output (N_SPLIT = 1) or the split's partials (m, l, acc)."""
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, HD)
        for j in range(start, end, BLOCK_L):
            offs = j + tl.arange(0, BLOCK_L)
            ok = offs < end
            kt = tl.load(kb + offs[None, :] * skl + d[:, None], mask=ok[None, :], other=0.0)
            if IEEE:
                sc = tl.dot(q, kt, input_precision="ieee")  # [G_PAD, BLOCK_L] fp32
            else:
                sc = tl.dot(q, kt)
            sc = tl.where(ok[None, :], sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, 1))
            alpha = tl.exp(m_i - m_new)
            pr = tl.exp(sc - m_new[:, None])
            l_i = l_i * alpha + tl.sum(pr, 1)
            vt = tl.load(vb + offs[:, None] * svl + d[None, :], mask=ok[:, None], other=0.0)
            if IEEE:
                pv = tl.dot(pr.to(vt.dtype), vt, input_precision="ieee")
            else:
                pv = tl.dot(pr.to(vt.dtype), vt)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        rows = hk * G + g
        if N_SPLIT == 1:
            out = acc / l_i[:, None]
            tl.store(o_ptr + b * sob + rows[:, None] * HD + d[None, :],
                     out.to(o_ptr.dtype.element_ty), mask=(g < G)[:, None])
        else:  # partials: m, l [B, Hkv, N_SPLIT, G_PAD], acc [B, Hkv, N_SPLIT, G_PAD, HD]
            # (an empty split stores m = -inf, l = 0, acc = 0)
            base = (b * tl.num_programs(1) + hk) * N_SPLIT + s
            tl.store(m_ptr + base * G_PAD + g, m_i)
            tl.store(l_ptr + base * G_PAD + g, l_i)
            tl.store(o_ptr + (base * G_PAD + g)[:, None] * HD + d[None, :], acc)

    @triton.jit
    def _attn_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, o_ptr, m_ptr, l_ptr, sqb, sqh, skb, skh, skl,
                     svb, svh, svl, sob, window, G: tl.constexpr, G_PAD: tl.constexpr,
                     HD: tl.constexpr, BLOCK_L: tl.constexpr, CHUNK: tl.constexpr,
                     N_SPLIT: tl.constexpr, IEEE: tl.constexpr):
        b, hk, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        p = tl.load(pos_ptr + b).to(tl.int32)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, HD)
        q = tl.load(q_ptr + b * sqb + (hk * G + g)[:, None] * sqh + d[None, :],
                    mask=(g < G)[:, None], other=0.0)  # [G_PAD, HD]
        m_i = tl.full([G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, HD], tl.float32)
        start = s * CHUNK
        end = p + 1
        if N_SPLIT > 1:
            end = tl.minimum(start + CHUNK, end)
        if window > 0:  # sliding window: keys > p - window only
            start = tl.maximum(start, p - window + 1)
        kb = k_ptr + b * skb + hk * skh
        vb = v_ptr + b * svb + hk * svh
        _flash(q, kb, vb, skl, svl, m_i, l_i, acc, start, end, o_ptr, m_ptr, l_ptr, b, hk, s,
               sob, G, G_PAD, HD, BLOCK_L, N_SPLIT, IEEE)

    @triton.jit
    def _fused_attn_kernel(x_ptr, cis_ptr, k_ptr, v_ptr, pos_ptr, o_ptr, m_ptr, l_ptr, y_ptr,
                           sem_ptr, sxb, scb, skb, skh, skl, svb, svh, svl, sob, soy, window,
                           H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr,
                           G_PAD: tl.constexpr, HD: tl.constexpr, BLOCK_L: tl.constexpr,
                           CHUNK: tl.constexpr, N_SPLIT: tl.constexpr, IEEE: tl.constexpr,
                           SEM: tl.constexpr):
        b, hk, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        p = tl.load(pos_ptr + b).to(tl.int32)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, HD)
        # RoPE on adjacent pairs (2i, 2i+1): x' = x * cos + x[d ^ 1] * (-sin | +sin)
        cs = tl.load(cis_ptr + b * scb + (d // 2) * 2)  # [HD] fp32
        sn = tl.load(cis_ptr + b * scb + (d // 2) * 2 + 1)
        sn = tl.where(d % 2 == 0, -sn, sn)
        dsw = d ^ 1
        xb = x_ptr + b * sxb
        qm = (g < G)[:, None]
        qoff = (hk * G + g)[:, None] * HD
        qa = tl.load(xb + qoff + d[None, :], mask=qm, other=0.0).to(tl.float32)
        qs = tl.load(xb + qoff + dsw[None, :], mask=qm, other=0.0).to(tl.float32)
        q = (qa * cs[None, :] + qs * sn[None, :]).to(k_ptr.dtype.element_ty)  # [G_PAD, HD]
        ka = tl.load(xb + (H + hk) * HD + d).to(tl.float32)
        ks = tl.load(xb + (H + hk) * HD + dsw).to(tl.float32)
        kn = (ka * cs + ks * sn).to(k_ptr.dtype.element_ty)  # [HD] the new key, roped
        vn = tl.load(xb + (H + HKV + hk) * HD + d).to(v_ptr.dtype.element_ty)
        first = s == 0  # split 0 writes the cache and holds the new key
        kb = k_ptr + b * skb + hk * skh
        vb = v_ptr + b * svb + hk * svh
        tl.store(kb + p * skl + d, kn, mask=first & (d < HD))
        tl.store(vb + p * svl + d, vn, mask=first & (d < HD))
        s_new = tl.sum(q.to(tl.float32) * kn.to(tl.float32)[None, :], 1)  # [G_PAD]
        m_i = tl.where(first, s_new, float("-inf"))
        l_i = tl.where(first, 1.0, 0.0) + tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, HD], tl.float32) + tl.where(first, vn.to(tl.float32), 0.0)[None, :]
        start = s * CHUNK
        end = p  # keys below pos from the cache (pos itself: the registers above)
        if N_SPLIT > 1:
            end = tl.minimum(start + CHUNK, end)
        if window > 0:  # sliding window: keys > p - window only
            start = tl.maximum(start, p - window + 1)
        _flash(q, kb, vb, skl, svl, m_i, l_i, acc, start, end, o_ptr, m_ptr, l_ptr, b, hk, s,
               sob, G, G_PAD, HD, BLOCK_L, N_SPLIT, IEEE)
        if SEM:  # the last split of (row, kv head) to finish combines all of them
            if _last_arrival(sem_ptr + b * HKV + hk, N_SPLIT):
                _combine(m_ptr, l_ptr, o_ptr, y_ptr, soy, b, hk, HKV, G, G_PAD, HD, N_SPLIT)
                tl.atomic_xchg(sem_ptr + b * HKV + hk, 0)  # ready for the next call

    @triton.jit
    def _last_arrival(sem_ptr, n):
        """True in the program that arrives n-th at the counter sem_ptr (each of n programs
        calls this once after its stores). The CTA barrier orders all threads' stores before
        the counter's acq_rel add at GPU scope, so the last program sees every partial (its
        loads bypass L1: .cg)."""
        tl.debug_barrier()
        return tl.atomic_add(sem_ptr, 1, sem="acq_rel", scope="gpu") == n - 1

    @triton.jit
    def _combine(m_ptr, l_ptr, a_ptr, o_ptr, sob, b, hk, n_kv, G: tl.constexpr,
                 G_PAD: tl.constexpr, HD: tl.constexpr, N_SPLIT: tl.constexpr):
        """Output rows of (row b, kv head hk) from the N_SPLIT partials (m, l, acc)."""
        base = (b * n_kv + hk) * N_SPLIT
        sp = tl.arange(0, N_SPLIT)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, HD)
        mi = tl.load(m_ptr + (base + sp)[:, None] * G_PAD + g[None, :],
                     cache_modifier=".cg")  # [N_SPLIT, G_PAD]
        li = tl.load(l_ptr + (base + sp)[:, None] * G_PAD + g[None, :], cache_modifier=".cg")
        mx = tl.max(mi, 0)  # the split holding pos is never empty: finite
        w = tl.exp(mi - mx[None, :])  # empty splits: exp(-inf) = 0
        den = tl.sum(w * li, 0)  # [G_PAD]
        ai = tl.load(a_ptr + ((base + sp)[:, None, None] * G_PAD + g[None, :, None]) * HD
                     + d[None, None, :], cache_modifier=".cg")  # [N_SPLIT, G_PAD, HD]
        out = tl.sum(ai * w[:, :, None], 0) / den[:, None]
        rows = hk * G + g
        tl.store(o_ptr + b * sob + rows[:, None] * HD + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=(g < G)[:, None])

    @triton.jit
    def _attn_combine(m_ptr, l_ptr, a_ptr, o_ptr, sob, G: tl.constexpr, G_PAD: tl.constexpr,
                      HD: tl.constexpr, N_SPLIT: tl.constexpr):
        b, hk = tl.program_id(0), tl.program_id(1)
        _combine(m_ptr, l_ptr, a_ptr, o_ptr, sob, b, hk, tl.num_programs(1), G, G_PAD, HD,
                 N_SPLIT)

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
            wt = tl.load(w_ptr + n[:, None] * swn + k[None, :],
                         mask=(n < N)[:, None] & ok[None, :], other=0.0)
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
                    sxm, swn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pn, m = tl.program_id(0), tl.program_id(1)
        ss = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            xv = tl.load(x_ptr + m * sxm + k, mask=k < K, other=0.0).to(tl.float32)
            ss += xv * xv
        rstd = 1.0 / tl.sqrt(tl.sum(ss, 0) / K + eps)
        n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        nok = n < F_
        ag = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        au = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            ok = k < K
            xv = tl.load(x_ptr + m * sxm + k, mask=ok, other=0.0)
            nv = tl.load(nw_ptr + k, mask=ok, other=0.0)
            h = (xv.to(tl.float32) * rstd * nv.to(tl.float32)).to(xv.dtype).to(tl.float32)
            msk = nok[:, None] & ok[None, :]
            wg = tl.load(w_ptr + n[:, None] * swn + k[None, :], mask=msk, other=0.0)
            wu = tl.load(w_ptr + (n + F_)[:, None] * swn + k[None, :], mask=msk, other=0.0)
            ag += wg.to(tl.float32) * h[None, :]
            au += wu.to(tl.float32) * h[None, :]
        gt = tl.sum(ag, 1)
        out = gt * tl.sigmoid(gt) * tl.sum(au, 1)
        tl.store(o_ptr + m * F_ + n, out.to(o_ptr.dtype.element_ty), mask=nok)


# ---- torch reference paths (CPU, and the meaning of each op) ---------------------------------
def attention_ref(q: Tensor, k: Tensor, v: Tensor, pos: Tensor, window: int = 0) -> Tensor:
    """The grouped decode attention in torch (as kvmodel._attn_grouped with S = 1):
    q [B, H, hd], k, v [B, Hkv, L, hd], pos [B] -> [B, H * hd] (q's dtype). window > 0: keys
    in (pos - window, pos] only."""
    b, h, hd = q.shape
    hkv, L = k.shape[1], k.shape[2]
    g = h // hkv
    ar = torch.arange(L, device=q.device)[None]
    ok = ar <= pos[:, None]
    if window > 0:
        ok = ok & (ar > pos[:, None] - window)
    mask = torch.where(ok, 0.0, float("-inf"))  # [B, L] float32
    sc = torch.matmul(q.view(b, hkv, g, hd), k.transpose(-1, -2))  # [B, Hkv, G, L]
    p = torch.softmax(sc + mask[:, None, None], dim=-1).to(v.dtype)
    return torch.matmul(p, v).reshape(b, h * hd)


def fused_ref(qkv: Tensor, cis: Tensor, k_cache: Tensor, v_cache: Tensor, pos: Tensor,
              kv_len: int, window: int = 0) -> Tensor:
    """decode_attention_fused in torch (the eager engine's math: complex RoPE product, index
    write, grouped attention over keys < kv_len): mutates k_cache, v_cache rows [0, B)."""
    b, hkv, hd = qkv.shape[0], k_cache.shape[1], k_cache.shape[3]
    x = qkv.view(b, -1, hd // 2, 2)  # [B, H + 2 Hkv, hd/2, 2]
    n_heads = x.shape[1] - 2 * hkv
    z = torch.view_as_complex(x[:, :n_heads + hkv].float().contiguous())
    qk = torch.view_as_real(z * torch.view_as_complex(cis.contiguous())[:, None])
    qk = qk.flatten(2).to(qkv.dtype)  # [B, H + Hkv, hd]
    bi = torch.arange(b, device=qkv.device)
    k_cache[bi, :, pos] = qk[:, n_heads:].to(k_cache.dtype)  # [B, Hkv, hd]
    v_cache[bi, :, pos] = x[:, n_heads + hkv:].flatten(2).to(v_cache.dtype)
    return attention_ref(qk[:, :n_heads], k_cache[:b, :, :kv_len], v_cache[:b, :, :kv_len], pos,
                         window)


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
    gate, up = F.linear(h, w13).float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


# ---- the ops --------------------------------------------------------------------------------
def _decode_attention(q: Tensor, k: Tensor, v: Tensor, pos: Tensor, chunk: int,
                      window: int = 0) -> Tensor:
    if q.device.type != "cuda":
        return attention_ref(q, k, v, pos, window)
    _need_triton("decode_attention='triton'")
    return _attention_triton(q, k, v, pos, chunk, window)


def attn_block_l(elem_bytes: int, hd: int, chunk: int = 0) -> int:
    """Keys per loop iteration of the attention kernels: ATTN_BLOCK_L (at most `chunk` when
    split), halved while one K (or V) block of that many keys would exceed ATTN_BLOCK_BYTES. The
    kernel keeps a K and a V block per pipeline stage in shared memory: fp32 at head dim 128
    asked 272 KiB at 128 keys, over the 227 KiB a Hopper block may have (Triton
    OutOfResources); bf16 at head dim 128 and fp32 at 64 keep 128 keys."""
    blk = ATTN_BLOCK_L if chunk <= 0 else min(ATTN_BLOCK_L, chunk)
    while blk > 16 and blk * hd * elem_bytes > ATTN_BLOCK_BYTES:
        blk //= 2
    return blk


def _attention_triton(q: Tensor, k: Tensor, v: Tensor, pos: Tensor, chunk: int,
                      window: int = 0) -> Tensor:
    q = q if q.stride(-1) == 1 else q.contiguous()
    b, h, hd = q.shape
    hkv, L = k.shape[1], k.shape[2]
    g = h // hkv
    gp = max(16, triton.next_power_of_2(g))
    out = torch.empty((b, h * hd), dtype=q.dtype, device=q.device)
    ieee = q.dtype == torch.float32
    n_split = 1 if chunk <= 0 else triton.next_power_of_2(-(-L // chunk))
    if n_split == 1:
        _wrap(_attn_kernel)[(b, hkv, 1)](
            q, k, v, pos, out, out, out, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            k.stride(2), v.stride(0), v.stride(1), v.stride(2), out.stride(0), window, G=g,
            G_PAD=gp, HD=hd, BLOCK_L=attn_block_l(k.element_size(), hd), CHUNK=0, N_SPLIT=1,
            IEEE=ieee)
        return out
    blk = attn_block_l(k.element_size(), hd, chunk)
    ml = torch.empty((2, b, hkv, n_split, gp), dtype=torch.float32, device=q.device)
    part = torch.empty((b, hkv, n_split, gp, hd), dtype=torch.float32, device=q.device)
    _wrap(_attn_kernel)[(b, hkv, n_split)](
        q, k, v, pos, part, ml[0], ml[1], q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        k.stride(2), v.stride(0), v.stride(1), v.stride(2), 0, window, G=g, G_PAD=gp, HD=hd,
        BLOCK_L=blk, CHUNK=chunk, N_SPLIT=n_split, IEEE=ieee)
    _wrap(_attn_combine)[(b, hkv)](ml[0], ml[1], part, out, out.stride(0), G=g, G_PAD=gp,
                                   HD=hd, N_SPLIT=n_split)
    return out


def _decode_attention_fused(qkv: Tensor, cis: Tensor, k_cache: Tensor, v_cache: Tensor,
                            pos: Tensor, kv_len: int, chunk: int, window: int = 0) -> Tensor:
    if qkv.device.type != "cuda":
        return fused_ref(qkv, cis, k_cache, v_cache, pos, kv_len, window)
    _need_triton("decode_attention='triton_fused'")
    return _fused_triton(qkv, cis, k_cache, v_cache, pos, kv_len, chunk, window)


def _decode_attention_fused_split(qkv: Tensor, cis: Tensor, k_cache: Tensor, v_cache: Tensor,
                                  pos: Tensor, sem: Tensor, kv_len: int, chunk: int,
                                  window: int = 0) -> Tensor:
    if qkv.device.type != "cuda":
        return fused_ref(qkv, cis, k_cache, v_cache, pos, kv_len, window)
    _need_triton("decode_attention='triton_fused_split'")
    if chunk <= 0:
        raise ValueError(f"decode_attention_fused_split: chunk = {chunk} must be > 0")
    return _fused_triton(qkv, cis, k_cache, v_cache, pos, kv_len, chunk, window, sem)


def attn_sem(max_batch: int, n_kv_heads: int, device: torch.device | str) -> Tensor:
    """The zeroed arrival counters of decode_attention_fused's one-kernel split (one per
    (row, kv head); each call leaves them zero again)."""
    return torch.zeros(max_batch * n_kv_heads, dtype=torch.int32, device=device)


def _fused_triton(qkv: Tensor, cis: Tensor, k_cache: Tensor, v_cache: Tensor, pos: Tensor,
                  kv_len: int, chunk: int, window: int = 0, sem: Tensor | None = None
                  ) -> Tensor:
    qkv = qkv if qkv.stride(-1) == 1 else qkv.contiguous()
    cis = cis.contiguous()
    b, hkv, hd = qkv.shape[0], k_cache.shape[1], k_cache.shape[3]
    h = qkv.shape[1] // hd - 2 * hkv
    g = h // hkv
    gp = max(16, triton.next_power_of_2(g))
    out = torch.empty((b, h * hd), dtype=qkv.dtype, device=qkv.device)
    ieee = qkv.dtype == torch.float32
    n_split = 1 if chunk <= 0 else triton.next_power_of_2(-(-kv_len // chunk))
    strides = (qkv.stride(0), cis.stride(0), k_cache.stride(0), k_cache.stride(1),
               k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2))
    meta = dict(H=h, HKV=hkv, G=g, G_PAD=gp, HD=hd, IEEE=ieee, N_SPLIT=n_split)
    if n_split == 1:
        _wrap(_fused_attn_kernel)[(b, hkv, 1)](
            qkv, cis, k_cache, v_cache, pos, out, out, out, out, pos, *strides, out.stride(0),
            0, window, BLOCK_L=attn_block_l(k_cache.element_size(), hd), CHUNK=0, SEM=False,
            **meta)
        return out
    ml = torch.empty((2, b, hkv, n_split, gp), dtype=torch.float32, device=qkv.device)
    part = torch.empty((b, hkv, n_split, gp, hd), dtype=torch.float32, device=qkv.device)
    one = sem is not None  # one kernel: the last split to finish combines
    _wrap(_fused_attn_kernel)[(b, hkv, n_split)](
        qkv, cis, k_cache, v_cache, pos, part, ml[0], ml[1], out, sem if one else pos,
        *strides, 0, out.stride(0), window,
        BLOCK_L=attn_block_l(k_cache.element_size(), hd, chunk), CHUNK=chunk, SEM=one, **meta)
    if not one:
        _wrap(_attn_combine)[(b, hkv)](ml[0], ml[1], part, out, out.stride(0), G=g, G_PAD=gp,
                                       HD=hd, N_SPLIT=n_split)
    return out


def _silu_gemv(x: Tensor, w: Tensor, n_split: int, silu: bool) -> Tensor:
    if x.device.type != "cuda":
        return _silu_gemv_ref(x, w, n_split, silu, GEMV_CFG["down"][1])
    _need_triton("mlp='triton'")
    return _silu_gemv_triton(x, w, n_split, silu)


def _silu_gemv_triton(x: Tensor, w: Tensor, n_split: int, silu: bool) -> Tensor:
    bn, bk, _ = GEMV_CFG["down"]
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, (n, k) = x.shape[0], w.shape
    out = torch.empty((n_split, m, n), dtype=torch.float32, device=x.device)
    _wrap(_gemv_kernel)[(triton.cdiv(n, bn), n_split, m)](
        x, w, out, out, out, out, m, n, k, x.stride(0), w.stride(0), 0, 0,
        KC=_chunks(k, n_split, bk), BLOCK_N=bn, BLOCK_K=bk, SILU=silu, SEM=False,
        N_SPLIT=n_split)
    return out


def gemv_sem(rows: int, n: int, device: torch.device | str) -> Tensor:
    """The zeroed arrival counters of silu_gemv_add for up to `rows` rows and n outputs (one
    per (row, block of outputs); each call leaves them zero again)."""
    return torch.zeros(rows * -(-n // GEMV_CFG["down"][0]), dtype=torch.int32, device=device)


def _silu_gemv_add(x: Tensor, w: Tensor, res: Tensor, sem: Tensor, n_split: int,
                   silu: bool) -> Tensor:
    if x.device.type != "cuda":
        part = _silu_gemv_ref(x, w, n_split, silu, GEMV_CFG["down"][1])
        return res + part.sum(0).to(res.dtype)
    _need_triton("mlp='triton_down'")
    return _silu_gemv_add_triton(x, w, res, sem, n_split, silu)


def _silu_gemv_add_triton(x: Tensor, w: Tensor, res: Tensor, sem: Tensor, n_split: int,
                          silu: bool) -> Tensor:
    bn, bk, _ = GEMV_CFG["down"]
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, (n, k) = x.shape[0], w.shape
    if n_split & (n_split - 1) or sem.numel() < m * triton.cdiv(n, bn):
        raise ValueError(f"silu_gemv_add: n_split {n_split} must be a power of 2 and sem "
                         f"must hold {m * triton.cdiv(n, bn)} counters (has {sem.numel()})")
    part = torch.empty((n_split, m, n), dtype=torch.float32, device=x.device)
    y = torch.empty((m, n), dtype=res.dtype, device=x.device)
    _wrap(_gemv_kernel)[(triton.cdiv(n, bn), n_split, m)](
        x, w, part, res, y, sem, m, n, k, x.stride(0), w.stride(0), res.stride(0), y.stride(0),
        KC=_chunks(k, n_split, bk), BLOCK_N=bn, BLOCK_K=bk, SILU=silu, SEM=True,
        N_SPLIT=n_split)
    return y


def _rms_w13_silu(x: Tensor, norm_w: Tensor, eps: float, w13: Tensor) -> Tensor:
    if x.device.type != "cuda":
        return _rms_w13_ref(x, norm_w, eps, w13)
    _need_triton("mlp='triton'")
    return _rms_w13_triton(x, norm_w, eps, w13)


def _rms_w13_triton(x: Tensor, norm_w: Tensor, eps: float, w13: Tensor) -> Tensor:
    x = x if x.stride(-1) == 1 else x.contiguous()
    bn, bk = GEMV_CFG["w13"]
    m, k = x.shape
    f = w13.shape[0] // 2
    out = torch.empty((m, f), dtype=x.dtype, device=x.device)
    _wrap(_w13_kernel)[(triton.cdiv(f, bn), m)](x, norm_w, w13, out, eps, F_=f, K=k,
                                                sxm=x.stride(0), swn=w13.stride(0),
                                                BLOCK_N=bn, BLOCK_K=bk)
    return out


def _register(name: str, fn):  # noqa: ANN001, ANN202
    """triton_op (inductor traces into the body: the kernels join the compiled graph) when
    torch has it, else a plain custom op (its fake impl is the same body)."""
    if _OP is not None:
        return _OP(f"kestrel::{name}", fn, mutates_args=())
    op = torch.library.custom_op(f"kestrel::{name}", fn, mutates_args=())
    op.register_fake(fn)
    return op


decode_attention = _register("decode_attention", _decode_attention)
if _OP is not None:  # the caches are written in place (functionalized; inductor reinplaces)
    decode_attention_fused = _OP("kestrel::decode_attention_fused", _decode_attention_fused,
                                 mutates_args=("k_cache", "v_cache"))
    decode_attention_fused_split = _OP("kestrel::decode_attention_fused_split",
                                       _decode_attention_fused_split,
                                       mutates_args=("k_cache", "v_cache", "sem"))
else:
    decode_attention_fused = torch.library.custom_op(
        "kestrel::decode_attention_fused", _decode_attention_fused,
        mutates_args=("k_cache", "v_cache"))
    decode_attention_fused_split = torch.library.custom_op(
        "kestrel::decode_attention_fused_split", _decode_attention_fused_split,
        mutates_args=("k_cache", "v_cache", "sem"))

    @decode_attention_fused.register_fake
    def _fused_fake(qkv: Tensor, cis: Tensor, k_cache: Tensor, v_cache: Tensor, pos: Tensor,
                    kv_len: int, chunk: int, window: int = 0) -> Tensor:
        hd = k_cache.shape[3]
        return qkv.new_empty((qkv.shape[0], qkv.shape[1] - 2 * k_cache.shape[1] * hd))

    @decode_attention_fused_split.register_fake
    def _fused_split_fake(qkv: Tensor, cis: Tensor, k_cache: Tensor, v_cache: Tensor,
                          pos: Tensor, sem: Tensor, kv_len: int, chunk: int, window: int = 0
                          ) -> Tensor:
        hd = k_cache.shape[3]
        return qkv.new_empty((qkv.shape[0], qkv.shape[1] - 2 * k_cache.shape[1] * hd))
silu_gemv = _register("silu_gemv", _silu_gemv)
if _OP is not None:  # the counters return to zero; declared mutated all the same
    silu_gemv_add = _OP("kestrel::silu_gemv_add", _silu_gemv_add, mutates_args=("sem",))
else:
    silu_gemv_add = torch.library.custom_op("kestrel::silu_gemv_add", _silu_gemv_add,
                                            mutates_args=("sem",))

    @silu_gemv_add.register_fake
    def _gemv_add_fake(x: Tensor, w: Tensor, res: Tensor, sem: Tensor, n_split: int,
                       silu: bool) -> Tensor:
        return res.new_empty((x.shape[0], w.shape[0]))
rms_w13_silu = _register("rms_w13_silu", _rms_w13_silu)


def mlp_triton(x: Tensor, norm_w: Tensor, eps: float, w13: Tensor, w2: Tensor,
               fuse_w13: bool, sem: Tensor | None = None) -> Tensor:
    """The SwiGLU block with residual for one decode position: x [B, 1, D] -> [B, 1, D].
    fuse_w13: RMSNorm + w13 + SiLU*up in one Triton kernel, then the split-K w_down GEMV;
    else RMSNorm + w13 as plain torch (inductor's GEMV) and SiLU*up fused into w_down.
    sem (gemv_sem(B, D)): the w_down kernel also sums its splits and adds the residual (the
    last split to finish each block of outputs does); without it a separate reduction does."""
    x2 = x[:, 0]
    n_split = GEMV_CFG["down"][2]
    if fuse_w13:
        a, silu = rms_w13_silu(x2, norm_w, eps, w13), False
    else:
        a, silu = F.linear(F.rms_norm(x2, (x2.shape[-1],), norm_w, eps), w13), True
    if sem is not None:
        return silu_gemv_add(a, w2, x2, sem, n_split, silu)[:, None]
    return x + silu_gemv(a, w2, n_split, silu).sum(0).to(x.dtype)[:, None]
