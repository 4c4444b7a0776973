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
    kestrel::decode_attention_fused_pdl: the same, launched with PDL (triton_common.py); it
    reads pos and its first block of cached keys before it waits for the qkv kernel.
    The kernel takes the new key from registers (the cache is read only below pos[b]: no
    read-after-write inside the kernel); kv_len only bounds the CPU path's key slice.
kestrel::decode_attention_fused_split(qkv, cis, k_cache, v_cache, pos, sem, kv_len, chunk,
                                     window) -> out
    the same op with the keys split over programs (chunk > 0) in ONE kernel: each (row, kv
    head, chunk) program stores its partial softmax state, then adds 1 to its (row, kv head)
    counter in sem (attn_sem(): int32, zero; acq_rel at GPU scope, after a CTA barrier); the
    program that arrives last combines the partials and sets the counter back to zero.

The MLP block's GEMV ops are in triton_mlp.py, the guarded `import triton` and the op
registration in triton_common.py: without triton (CPU CI) the ops still exist and their CPU
path runs; their CUDA path raises RuntimeError saying that triton is missing.
Launch configurations (BLOCK_* below): constants picked on an H200 with the kernel
micro-benchmarks, not autotuned at runtime. In the compiled step the fused attention runs 4
pointwise kernels per layer fewer than 'triton' (RoPE, the cast and two index_put kernels);
figures in docs/benchmarks/planner_h200.md.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kestrel_models.planner.triton_common import (HAVE_TRITON, launch, need_triton, register, tl,
                                                  triton, wrap)

if HAVE_TRITON:
    from kestrel_models.planner.triton_common import _last_arrival

__all__ = ["HAVE_TRITON", "decode_attention", "decode_attention_fused",
           "decode_attention_fused_pdl", "decode_attention_fused_split", "attn_sem",
           "attention_ref", "fused_ref",
           "ATTN_BLOCK_L", "attn_block_l", "fused_blocks"]

ATTN_BLOCK_L = 128  # keys per loop iteration of the one-pass attention kernel (chunk = 0)
# Launched with PDL, the fused kernel reads its first block of keys before the wait at head
# dims up to ATTN_PREFETCH_MAX_HD, in blocks of up to ATTN_PREFETCH_BLOCK_L keys
# (planner_steps_h100's notes: faster at the SmolVLM-256M shape's 64, slower at Qwen2.5-VL-3B's
# 128; without PDL the same change was slower, so those launches keep ATTN_BLOCK_L, no early read).
ATTN_PREFETCH_MAX_HD = 64
ATTN_PREFETCH_BLOCK_L = 256
ATTN_BLOCK_BYTES = 32 * 1024  # at most this per K (or V) block in shared memory: see attn_block_l
if HAVE_TRITON:
    @triton.jit
    def _flash_block(q, kt, vt, ok, m_i, l_i, acc, IEEE: tl.constexpr):
        """One block of _flash's online softmax from keys already loaded (kt [HD, BLOCK_L],
        vt [BLOCK_L, HD], valid where ok) -> (m_i, l_i, acc). A block with no valid key
        leaves the state as it is, also an empty one (m_i = -inf)."""
        if IEEE:
            sc = tl.dot(q, kt, input_precision="ieee")
        else:
            sc = tl.dot(q, kt)
        sc = tl.where(ok[None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # exp(-inf - 0) = 0, not NaN
        alpha = tl.exp(m_i - m_ref)
        pr = tl.exp(sc - m_ref[:, None])
        if IEEE:
            pv = tl.dot(pr.to(vt.dtype), vt, input_precision="ieee")
        else:
            pv = tl.dot(pr.to(vt.dtype), vt)
        return m_new, l_i * alpha + tl.sum(pr, 1), acc * alpha[:, None] + pv

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
            vt = tl.load(vb + offs[:, None] * svl + d[None, :], mask=ok[:, None], other=0.0)
            m_i, l_i, acc = _flash_block(q, kt, vt, ok, m_i, l_i, acc, IEEE)
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
                           SEM: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr):
        b, hk, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        if PDL:  # triton_common.py
            tl.extra.cuda.gdc_launch_dependents()
            if not PREFETCH:  # every input below comes from the kernels before
                tl.extra.cuda.gdc_wait()
        p = tl.load(pos_ptr + b).to(tl.int32)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, HD)
        kb = k_ptr + b * skb + hk * skh
        vb = v_ptr + b * svb + hk * svh
        start = s * CHUNK
        end = p  # keys below pos from the cache (pos itself: from registers, below)
        if N_SPLIT > 1:
            end = tl.minimum(start + CHUNK, end)
        if window > 0:  # sliding window: keys > p - window only
            start = tl.maximum(start, p - window + 1)
        if PREFETCH:
            # The first block of cached keys, before the wait: pos and the cache below pos are
            # written before the decode step's PDL chain (earlier steps, prefill), never in it.
            offs = start + tl.arange(0, BLOCK_L)
            ok0 = offs < end
            kt0 = tl.load(kb + offs[None, :] * skl + d[:, None], mask=ok0[None, :], other=0.0)
            vt0 = tl.load(vb + offs[:, None] * svl + d[None, :], mask=ok0[:, None], other=0.0)
            if PDL:  # qkv comes from the kernel before
                tl.extra.cuda.gdc_wait()
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
        tl.store(kb + p * skl + d, kn, mask=first & (d < HD))
        tl.store(vb + p * svl + d, vn, mask=first & (d < HD))
        s_new = tl.sum(q.to(tl.float32) * kn.to(tl.float32)[None, :], 1)  # [G_PAD]
        m_i = tl.where(first, s_new, float("-inf"))
        l_i = tl.where(first, 1.0, 0.0) + tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, HD], tl.float32) + tl.where(first, vn.to(tl.float32), 0.0)[None, :]
        lo = start
        if PREFETCH:
            m_i, l_i, acc = _flash_block(q, kt0, vt0, ok0, m_i, l_i, acc, IEEE)
            lo = start + BLOCK_L
        _flash(q, kb, vb, skl, svl, m_i, l_i, acc, lo, end, o_ptr, m_ptr, l_ptr, b, hk, s, sob, G,
               G_PAD, HD, BLOCK_L, N_SPLIT, IEEE)
        if SEM:  # the last split of (row, kv head) to finish combines all of them
            if _last_arrival(sem_ptr + b * HKV + hk, N_SPLIT):
                _combine(m_ptr, l_ptr, o_ptr, y_ptr, soy, b, hk, HKV, G, G_PAD, HD, N_SPLIT)
                tl.atomic_xchg(sem_ptr + b * HKV + hk, 0)  # ready for the next call

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


# ---- the ops --------------------------------------------------------------------------------
def _decode_attention(q: Tensor, k: Tensor, v: Tensor, pos: Tensor, chunk: int,
                      window: int = 0) -> Tensor:
    if q.device.type != "cuda":
        return attention_ref(q, k, v, pos, window)
    need_triton("decode_attention='triton'")
    return _attention_triton(q, k, v, pos, chunk, window)


def attn_block_l(elem_bytes: int, hd: int, chunk: int = 0, most: int = ATTN_BLOCK_L) -> int:
    """Keys per loop iteration of the attention kernels: `most` (at most `chunk` when split),
    halved while one K (or V) block of that many keys would exceed ATTN_BLOCK_BYTES. The
    kernel keeps a K and a V block per pipeline stage in shared memory: fp32 at head dim 128
    asked 272 KiB at 128 keys, over the 227 KiB a Hopper block may have (Triton
    OutOfResources); bf16 at head dim 128 and fp32 at 64 keep 128 keys (256 at most: bf16 at 64
    takes 256)."""
    blk = most if chunk <= 0 else min(most, chunk)
    while blk > 16 and blk * hd * elem_bytes > ATTN_BLOCK_BYTES:
        blk //= 2
    return blk


def fused_blocks(pdl: bool, elem_bytes: int, hd: int, chunk: int = 0) -> tuple[bool, int]:
    """(whether the fused kernel reads its first block of keys before its PDL wait, keys per
    block): only PDL launches at head dims up to ATTN_PREFETCH_MAX_HD do, in blocks of up to
    ATTN_PREFETCH_BLOCK_L keys; every other launch takes attn_block_l's ATTN_BLOCK_L."""
    prefetch = pdl and hd <= ATTN_PREFETCH_MAX_HD
    most = ATTN_PREFETCH_BLOCK_L if prefetch else ATTN_BLOCK_L
    return prefetch, attn_block_l(elem_bytes, hd, chunk, most)


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
        wrap(_attn_kernel)[(b, hkv, 1)](
            q, k, v, pos, out, out, out, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            k.stride(2), v.stride(0), v.stride(1), v.stride(2), out.stride(0), window, G=g,
            G_PAD=gp, HD=hd, BLOCK_L=attn_block_l(k.element_size(), hd), CHUNK=0, N_SPLIT=1,
            IEEE=ieee)
        return out
    blk = attn_block_l(k.element_size(), hd, chunk)
    ml = torch.empty((2, b, hkv, n_split, gp), dtype=torch.float32, device=q.device)
    part = torch.empty((b, hkv, n_split, gp, hd), dtype=torch.float32, device=q.device)
    wrap(_attn_kernel)[(b, hkv, n_split)](
        q, k, v, pos, part, ml[0], ml[1], q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        k.stride(2), v.stride(0), v.stride(1), v.stride(2), 0, window, G=g, G_PAD=gp, HD=hd,
        BLOCK_L=blk, CHUNK=chunk, N_SPLIT=n_split, IEEE=ieee)
    wrap(_attn_combine)[(b, hkv)](ml[0], ml[1], part, out, out.stride(0), G=g, G_PAD=gp,
                                  HD=hd, N_SPLIT=n_split)
    return out


def _fused_run(qkv: Tensor, cis: Tensor, k_cache: Tensor, v_cache: Tensor, pos: Tensor,
               kv_len: int, chunk: int, window: int, pdl: bool) -> Tensor:
    if qkv.device.type != "cuda":
        return fused_ref(qkv, cis, k_cache, v_cache, pos, kv_len, window)
    need_triton("decode_attention='triton_fused'")
    return _fused_triton(qkv, cis, k_cache, v_cache, pos, kv_len, chunk, window, pdl=pdl)


def _decode_attention_fused(qkv: Tensor, cis: Tensor, k_cache: Tensor, v_cache: Tensor,
                            pos: Tensor, kv_len: int, chunk: int, window: int = 0) -> Tensor:
    return _fused_run(qkv, cis, k_cache, v_cache, pos, kv_len, chunk, window, pdl=False)


def _decode_attention_fused_pdl(qkv: Tensor, cis: Tensor, k_cache: Tensor, v_cache: Tensor,
                                pos: Tensor, kv_len: int, chunk: int, window: int = 0
                                ) -> Tensor:
    return _fused_run(qkv, cis, k_cache, v_cache, pos, kv_len, chunk, window, pdl=True)


def _decode_attention_fused_split(qkv: Tensor, cis: Tensor, k_cache: Tensor, v_cache: Tensor,
                                  pos: Tensor, sem: Tensor, kv_len: int, chunk: int,
                                  window: int = 0) -> Tensor:
    if chunk <= 0:
        raise ValueError(f"decode_attention_fused_split: chunk = {chunk} must be > 0")
    if qkv.device.type != "cuda":
        return fused_ref(qkv, cis, k_cache, v_cache, pos, kv_len, window)
    need_triton("decode_attention='triton_fused_split'")
    return _fused_triton(qkv, cis, k_cache, v_cache, pos, kv_len, chunk, window, sem)


def attn_sem(max_batch: int, n_kv_heads: int, device: torch.device | str) -> Tensor:
    """The zeroed arrival counters of decode_attention_fused's one-kernel split (one per
    (row, kv head); each call leaves them zero again)."""
    return torch.zeros(max_batch * n_kv_heads, dtype=torch.int32, device=device)


def _fused_triton(qkv: Tensor, cis: Tensor, k_cache: Tensor, v_cache: Tensor, pos: Tensor,
                  kv_len: int, chunk: int, window: int = 0, sem: Tensor | None = None,
                  pdl: bool = False) -> Tensor:
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
    prefetch, blk = fused_blocks(pdl, k_cache.element_size(), hd, chunk if n_split > 1 else 0)
    meta = dict(H=h, HKV=hkv, G=g, G_PAD=gp, HD=hd, IEEE=ieee, N_SPLIT=n_split,
                PREFETCH=prefetch, BLOCK_L=blk)
    if n_split == 1:
        launch(_fused_attn_kernel, (b, hkv, 1), pdl,
               qkv, cis, k_cache, v_cache, pos, out, out, out, out, pos, *strides,
               out.stride(0), 0, window, CHUNK=0, SEM=False, **meta)
        return out
    ml = torch.empty((2, b, hkv, n_split, gp), dtype=torch.float32, device=qkv.device)
    part = torch.empty((b, hkv, n_split, gp, hd), dtype=torch.float32, device=qkv.device)
    one = sem is not None  # one kernel: the last split to finish combines
    launch(_fused_attn_kernel, (b, hkv, n_split), pdl,
           qkv, cis, k_cache, v_cache, pos, part, ml[0], ml[1], out, sem if one else pos,
           *strides, 0, out.stride(0), window, CHUNK=chunk, SEM=one, **meta)
    if not one:
        wrap(_attn_combine)[(b, hkv)](ml[0], ml[1], part, out, out.stride(0), G=g, G_PAD=gp,
                                      HD=hd, N_SPLIT=n_split)
    return out


def _fused_fake(qkv: Tensor, cis: Tensor, k_cache: Tensor, v_cache: Tensor, pos: Tensor,
                kv_len: int, chunk: int, window: int = 0) -> Tensor:
    hd = k_cache.shape[3]
    return qkv.new_empty((qkv.shape[0], qkv.shape[1] - 2 * k_cache.shape[1] * hd))


def _fused_split_fake(qkv: Tensor, cis: Tensor, k_cache: Tensor, v_cache: Tensor, pos: Tensor,
                      sem: Tensor, kv_len: int, chunk: int, window: int = 0) -> Tensor:
    return _fused_fake(qkv, cis, k_cache, v_cache, pos, kv_len, chunk, window)


decode_attention = register("decode_attention", _decode_attention)
decode_attention_fused = register("decode_attention_fused", _decode_attention_fused,
                                  ("k_cache", "v_cache"), _fused_fake)
decode_attention_fused_pdl = register("decode_attention_fused_pdl", _decode_attention_fused_pdl,
                                      ("k_cache", "v_cache"), _fused_fake, opaque=True)
decode_attention_fused_split = register("decode_attention_fused_split",
                                        _decode_attention_fused_split,
                                        ("k_cache", "v_cache", "sem"), _fused_split_fake)
